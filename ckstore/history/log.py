"""History and inspection: log (with decorations) and diff, computed from manifests (read-only).

Also the lowest-level size figure, ``stored_bytes`` (docs/design.md, "Size figures"), and the
"new" figure of a diff; sizes.py builds the other figures on them.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ckstore.errors import NotFoundError
from ckstore.format.ids import ObjectId
from ckstore.format.manifest import Commit
from ckstore.format.positions import HEADER, position_chunks
from ckstore.repository.graph import CommitGraph, kept_parents
from ckstore.repository.refs import HEADS, TAGS
from ckstore.repository.store import ObjectStore


@dataclass(frozen=True)
class Decorations:
    """The names that point at a commit, as log and show print them (git's decorations)."""

    head: bool = False  # HEAD's branch points here
    branches: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()
    best: tuple[str, ...] = ()  # metrics this commit has the best value of among the listed ones


@dataclass(frozen=True)
class LogEntry:
    id: ObjectId
    commit: Commit
    pruned_parents: tuple[ObjectId, ...]
    refs: Decorations = field(default_factory=Decorations)


@dataclass(frozen=True)
class TensorChange:
    path: str
    name: str | None  # None: a whole non-safetensors file
    status: str  # "added", "removed", "changed" or "unchanged"
    stored_bytes: int  # "new": stored size now of the objects B uses here and A uses nowhere
    rel_l2: float | None = None  # changed tensors: ||b - a|| / ||a||, where the dtype allows


@dataclass(frozen=True)
class Diff:
    """From commit ``a`` to commit ``b``; iterates over its changes."""

    a: ObjectId
    b: ObjectId
    changes: list[TensorChange]
    header_bytes: int = 0  # "new" bytes of safetensors headers (they belong to no one tensor)

    def __iter__(self) -> Iterator[TensorChange]:
        return iter(self.changes)

    def __len__(self) -> int:
        return len(self.changes)

    def counts(self) -> dict[str, int]:
        return {s: sum(c.status == s for c in self.changes) for s in ("added", "removed", "changed", "unchanged")}

    @property
    def new_bytes(self) -> int:
        """The "new" figure of ``b`` against ``a``: each new object counted once, at the first
        tensor (or file header) using it, so the changes' figures add up to it."""
        return self.header_bytes + sum(c.stored_bytes for c in self.changes)


def stored_bytes(store: ObjectStore, oids: Iterable[str]) -> int:
    """The "stored" figure: bytes of these objects' files in this repository (objects that a
    base repository holds count there, not here)."""
    return sum(store.stored_size(oid) or 0 for oid in oids)


def metric_value(entry: LogEntry, metric: str) -> float | None:
    """The numeric metric a commit recorded, or None (missing, not a number, or NaN)."""
    value: Any = entry.commit.decoded_metadata().get(metric)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return None
    return float(value)


def decorations(graph: CommitGraph) -> dict[ObjectId, Decorations]:
    """Branches and tags by the commit they point at; HEAD marks its branch's commit."""
    head = graph.head_branch()
    names: dict[ObjectId, tuple[list[str], list[str]]] = {}
    for name, oid in sorted(graph.refs.list(HEADS).items()):
        names.setdefault(oid, ([], []))[0].append(name)
    for name, oid in sorted(graph.refs.list(TAGS).items()):
        names.setdefault(oid, ([], []))[1].append(name)
    return {
        oid: Decorations(head in branches, tuple(sorted(branches, key=lambda b: b != head)), tuple(tags))
        for oid, (branches, tags) in names.items()
    }


def log(
    graph: CommitGraph,
    ref: str | Sequence[str] | None = None,
    limit: int | None = None,
    best: tuple[str, bool] | None = None,
) -> list[LogEntry]:
    """Commits reachable from ``ref`` (default HEAD; several refs: from any of them, as
    ``log --all``), newest first, at most ``limit``, each with the names pointing at it;
    ``best`` = (metric, maximize) also marks the listed commit with the best value of that
    metric (ties: the newer)."""
    starts = {graph.resolve(r) for r in ([ref or "HEAD"] if ref is None or isinstance(ref, str) else ref)}
    pruned = graph.pruned()
    seen = set(starts)
    heap = [(-graph.read_commit(start, files=False).timestamp, start) for start in starts]
    heapq.heapify(heap)
    out: list[LogEntry] = []
    while heap and (limit is None or len(out) < limit):
        _, oid = heapq.heappop(heap)
        commit = graph.read_commit(oid, files=False)  # the header: files are read when used
        gone = [p for p in commit.parents if p in pruned or not graph.store.has(p)]
        for parent in kept_parents(commit.parents, pruned):  # older kept commits stay in the history
            if parent not in seen and graph.store.has(parent):
                seen.add(parent)
                heapq.heappush(heap, (-graph.read_commit(parent, files=False).timestamp, parent))
        out.append(LogEntry(oid, commit, tuple(gone)))
    names = decorations(graph)
    top = ranked(out, *best)[:1] if best else []
    if best and out and not top:  # a typo'd metric must not pass silently
        raise NotFoundError(f"no listed commit records a numeric metric {best[0]!r}")
    marked = {top[0].id: (best[0],)} if best and top else {}
    return [replace(e, refs=replace(names.get(e.id, Decorations()), best=marked.get(e.id, ()))) for e in out]


def ranked(history: list[LogEntry], metric: str, maximize: bool) -> list[LogEntry]:
    """The entries that record ``metric``, best first (``best``, ``gc --keep-best``, log's mark)."""
    scored = [(v, e) for e in history if (v := metric_value(e, metric)) is not None]
    # Ties go to the newer commit: history is newest first and sort is stable.
    scored.sort(key=lambda pair: -pair[0] if maximize else pair[0])
    return [e for _, e in scored]


def new_objects(old: Commit | None, new: Commit) -> dict[str, tuple[str, str | None]]:
    """The "new" objects of ``new`` against ``old``: chunks ``new``'s files use and ``old``'s use
    nowhere, each with the first position using it (a tensor, ``positions.HEADER``, or None for
    a plain file)."""
    have = {c.id for c in old.all_chunks()} if old is not None else set()
    out: dict[str, tuple[str, str | None]] = {}
    for (path, name), chunks in position_chunks(new.files, header=True).items():
        for chunk in chunks:
            if chunk.id not in have and chunk.id not in out:
                out[chunk.id] = (path, name)
    return out


def diff(graph: CommitGraph, a: str, b: str) -> Diff:
    """Per tensor (and per plain file): added, removed, changed or unchanged from ``a`` to ``b``."""
    a_id, b_id = graph.resolve(a), graph.resolve(b)
    return diff_commits(graph.store, a_id, graph.read_commit(a_id), b_id, graph.read_commit(b_id))


def diff_commits(store: ObjectStore, a_id: ObjectId, old: Commit, b_id: ObjectId, new: Commit) -> Diff:
    """``diff`` of two manifests whose chunks ``store`` reads (``b`` may be files on disk, which
    ``read/folder_diff.py`` describes as a manifest)."""
    old_items, new_items = _items(old), _items(new)
    old_tensors = {(f.path, t.name): t for f in old.files for t in f.tensors}
    new_tensors = {(f.path, t.name): t for f in new.files for t in f.tensors}
    cost: dict[tuple[str, str | None], int] = {}
    for oid, where in new_objects(old, new).items():
        cost[where] = cost.get(where, 0) + (store.stored_size(oid) or 0)
    headers = sum(n for (_, part), n in cost.items() if part == HEADER)
    out = []
    changes = None
    for key, chunks in new_items.items():
        rel_l2 = None
        if key not in old_items:
            status = "added"
        elif old_items[key] == chunks:
            status = "unchanged"
        else:
            status = "changed"
            if key in old_tensors:
                if changes is None:
                    from ckstore.history.magnitude import RecordedChanges  # numpy, only when a diff needs it

                    # The change record holds a commit's changes against its first parent only.
                    changes = RecordedChanges(store, b_id, new, a_id, old, use_record=new.parents[:1] == (a_id,))
                rel_l2 = changes.change(key, old_tensors[key], new_tensors[key])
        out.append(TensorChange(key[0], key[1], status, cost.pop(key, 0), rel_l2))
    if changes is not None:
        changes.save()
    out.extend(TensorChange(k[0], k[1], "removed", 0) for k in old_items if k not in new_items)
    return Diff(a_id, b_id, out, headers)


def _items(commit: Commit) -> dict[tuple[str, str | None], list[str]]:
    return {pos: [c.id for c in chunks] for pos, chunks in position_chunks(commit.files, header=False).items()}
