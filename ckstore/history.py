"""History and inspection: log, diff and stats, computed from manifests (read-only)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from .ids import ObjectId
from .manifest import Commit, TensorEntry

if TYPE_CHECKING:
    from .repo import Repo


@dataclass(frozen=True)
class LogEntry:
    id: ObjectId
    commit: Commit
    pruned_parents: tuple[ObjectId, ...]


@dataclass(frozen=True)
class TensorChange:
    path: str
    name: str | None  # None: a whole non-safetensors file
    status: str  # "added", "removed", "changed" or "unchanged"
    stored_bytes: int  # what B's version costs beyond what A already stores
    rel_l2: float | None = None  # changed tensors: ||b - a|| / ||a||, where the dtype allows


@dataclass(frozen=True)
class Stats:
    logical_bytes: int
    stored_bytes: int
    commits: int
    objects: int

    @property
    def ratio(self) -> float:
        return self.stored_bytes / self.logical_bytes if self.logical_bytes else 0.0


def log(repo: Repo, ref: str | None = None) -> list[LogEntry]:
    """Commits reachable from ``ref`` (default HEAD), newest first."""
    start = repo.resolve(ref or "HEAD")
    pruned = repo.pruned()
    seen = {start}
    heap = [(_neg_time(repo.read_commit(start).time), start)]
    out = []
    while heap:
        _, oid = heapq.heappop(heap)
        commit = repo.read_commit(oid)
        gone = [p for p in commit.parents if p in pruned or not repo.store.has(p)]
        todo = list(commit.parents)
        while todo:
            parent = todo.pop(0)
            if parent in pruned:
                todo.extend(pruned[parent])  # older kept commits stay in the history
            elif not repo.store.has(parent):
                continue
            elif parent not in seen:
                seen.add(parent)
                heapq.heappush(heap, (_neg_time(repo.read_commit(parent).time), parent))
        out.append(LogEntry(oid, commit, tuple(gone)))
    return out


def diff(repo: Repo, a: str, b: str) -> list[TensorChange]:
    """Per tensor (and per plain file): added, removed, changed or unchanged from ``a`` to ``b``."""
    old, new = repo.read_commit(repo.resolve(a)), repo.read_commit(repo.resolve(b))
    old_items, new_items = _items(old), _items(new)
    old_tensors, new_tensors = _tensors(old), _tensors(new)
    have = {c.id for c in old.all_chunks()}
    out = []
    for key, chunks in new_items.items():
        rel_l2 = None
        if key not in old_items:
            status = "added"
        elif old_items[key] == chunks:
            status = "unchanged"
        else:
            status = "changed"
            if key in old_tensors:
                from .overlay import relative_l2  # numpy, only when a diff needs it

                rel_l2 = relative_l2(repo.store, old_tensors[key], new_tensors[key])
        cost = sum(repo.store.stored_size(c) or 0 for c in dict.fromkeys(chunks) if c not in have)
        out.append(TensorChange(key[0], key[1], status, cost, rel_l2))
    out.extend(TensorChange(k[0], k[1], "removed", 0) for k in old_items if k not in new_items)
    return out


def stats(repo: Repo) -> Stats:
    commits = repo.reachable_commits()
    stored = objects = 0
    for oid in repo.store.iter_ids():
        stored += repo.store.stored_size(oid) or 0
        objects += 1
    logical = sum(repo.read_commit(c).logical_bytes for c in commits)
    return Stats(logical, stored, len(commits), objects)


def _neg_time(time: str) -> float:
    return -datetime.fromisoformat(time).timestamp()


def _tensors(commit: Commit) -> dict[tuple[str, str | None], TensorEntry]:
    return {(f.path, t.name): t for f in commit.files for t in f.tensors}


def _items(commit: Commit) -> dict[tuple[str, str | None], list[str]]:
    out: dict[tuple[str, str | None], list[str]] = {}
    for f in commit.files:
        if f.kind == "safetensors":
            for t in f.tensors:
                out[(f.path, t.name)] = [c.id for c in t.chunks]
        else:
            out[(f.path, None)] = [c.id for c in f.chunks]
    return out
