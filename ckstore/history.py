"""History and inspection: log, diff and stats, computed from manifests (read-only)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from datetime import datetime

from .graph import CommitGraph, kept_parents
from .ids import ObjectId
from .manifest import Commit
from .positions import position_chunks


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


def log(graph: CommitGraph, ref: str | None = None) -> list[LogEntry]:
    """Commits reachable from ``ref`` (default HEAD), newest first."""
    start = graph.resolve(ref or "HEAD")
    pruned = graph.pruned()
    seen = {start}
    heap = [(_neg_time(graph.read_commit(start).time), start)]
    out = []
    while heap:
        _, oid = heapq.heappop(heap)
        commit = graph.read_commit(oid)
        gone = [p for p in commit.parents if p in pruned or not graph.store.has(p)]
        for parent in kept_parents(commit.parents, pruned):  # older kept commits stay in the history
            if parent not in seen and graph.store.has(parent):
                seen.add(parent)
                heapq.heappush(heap, (_neg_time(graph.read_commit(parent).time), parent))
        out.append(LogEntry(oid, commit, tuple(gone)))
    return out


def diff(graph: CommitGraph, a: str, b: str) -> list[TensorChange]:
    """Per tensor (and per plain file): added, removed, changed or unchanged from ``a`` to ``b``."""
    store = graph.store
    old, new = graph.read_commit(graph.resolve(a)), graph.read_commit(graph.resolve(b))
    old_items, new_items = _items(old), _items(new)
    old_tensors = {(f.path, t.name): t for f in old.files for t in f.tensors}
    new_tensors = {(f.path, t.name): t for f in new.files for t in f.tensors}
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
                from .magnitude import relative_l2  # numpy, only when a diff needs it

                rel_l2 = relative_l2(store, old_tensors[key], new_tensors[key])
        cost = sum(store.stored_size(c) or 0 for c in dict.fromkeys(chunks) if c not in have)
        out.append(TensorChange(key[0], key[1], status, cost, rel_l2))
    out.extend(TensorChange(k[0], k[1], "removed", 0) for k in old_items if k not in new_items)
    return out


def stats(graph: CommitGraph) -> Stats:
    commits = graph.reachable_commits()
    stored = objects = 0
    for oid in graph.store.iter_ids():
        stored += graph.store.stored_size(oid) or 0
        objects += 1
    logical = sum(graph.read_commit(c).logical_bytes for c in commits)
    return Stats(logical, stored, len(commits), objects)


def _neg_time(time: str) -> float:
    return -datetime.fromisoformat(time).timestamp()


def _items(commit: Commit) -> dict[tuple[str, str | None], list[str]]:
    return {pos: [c.id for c in chunks] for pos, chunks in position_chunks(commit.files, header=False).items()}
