"""How much a tensor changed: relative L2 distance, computed chunk by chunk (diff, show) or taken
from the change record (repository/change_record.py), and a commit's per-tensor statistics: as
recorded in its manifest, else computed from its chunks."""

from __future__ import annotations

import math
from collections.abc import Iterator

from ckstore.format.manifest import Commit, TensorEntry
from ckstore.format.tensor_stats import (
    NUMERIC_DTYPES,
    StatsAccumulator,
    TensorStats,
    chunk_stats,
    difference_sums,
    item_size,
)
from ckstore.repository.change_record import Sums, TensorKey, change_from_sums, read_changes, write_changes
from ckstore.repository.store import ObjectStore


def _aligned_pairs(store: ObjectStore, a: TensorEntry, b: TensorEntry, item: int) -> Iterator[tuple[bytes, bytes]]:
    """Equal-length, element-aligned byte blocks of two same-size tensors, one chunk at a time."""
    ia = (store.get_chunk(c.id, c.size) for c in a.chunks)
    ib = (store.get_chunk(c.id, c.size) for c in b.chunks)
    buf_a = buf_b = b""
    while True:
        if not buf_a:
            buf_a = next(ia, b"")
        if not buf_b:
            buf_b = next(ib, b"")
        if not buf_a or not buf_b:
            return
        n = min(len(buf_a), len(buf_b))
        n -= n % item
        if n == 0:  # a chunk boundary splits an element: join with the next chunk
            buf_a += next(ia, b"") if len(buf_a) < item else b""
            buf_b += next(ib, b"") if len(buf_b) < item else b""
            continue
        yield buf_a[:n], buf_b[:n]
        buf_a, buf_b = buf_a[n:], buf_b[n:]


def tensor_sums(store: ObjectStore, a: TensorEntry, b: TensorEntry) -> Sums | None:
    """(‖b − a‖², ‖a‖²) computed chunk by chunk; None where not defined for the dtype."""
    if a.dtype != b.dtype or a.shape != b.shape or a.dtype not in NUMERIC_DTYPES:
        return None
    item = item_size(a.dtype)
    diff_sq = base_sq = 0.0
    for block_a, block_b in _aligned_pairs(store, a, b, item):
        d, s = difference_sums(block_a, block_b, a.dtype)
        diff_sq += d
        base_sq += s
    return diff_sq, base_sq


def relative_l2(store: ObjectStore, a: TensorEntry, b: TensorEntry) -> float | None:
    """||b − a|| / ||a|| computed chunk by chunk; None where it is not defined for the dtype."""
    sums = tensor_sums(store, a, b)
    return None if sums is None else change_from_sums(sums)


class RecordedChanges:
    """The relative changes of ``commit`` against its first parent ``parent``: from the change
    record where it holds them (no tensor read), else computed, and what was computed written
    back to the record when ``save`` is called (format.md 5.2). ``use_record=False``: computed
    only (``parent`` is not the commit's first parent)."""

    def __init__(
        self,
        store: ObjectStore,
        commit_id: str,
        commit: Commit,
        parent_id: str,
        parent: Commit,
        use_record: bool = True,
    ) -> None:
        self.store, self.ids, self.commits, self.use_record = (
            store,
            (commit_id, parent_id),
            (commit, parent),
            use_record,
        )
        self.recorded = read_changes(store.backend, commit_id, commit, parent_id, parent) if use_record else {}
        self.computed: dict[TensorKey, Sums] = {}

    def change(self, key: TensorKey, old: TensorEntry, new: TensorEntry) -> float | None:
        """||new − old|| / ||old|| as relative_l2 computes it."""
        sums = self.recorded.get(key)
        if sums is None:
            sums = tensor_sums(self.store, old, new)
            if sums is None:
                return None
            self.computed[key] = sums
        return change_from_sums(sums)

    def save(self) -> None:
        if self.computed and self.use_record:
            write_changes(self.store.backend, self.ids[0], self.commits[0], self.ids[1], self.commits[1], self.computed)
            self.computed = {}


def _elements(store: ObjectStore, t: TensorEntry, item: int) -> Iterator[bytes]:
    """A tensor's bytes in element-aligned blocks, one chunk at a time."""
    rest = b""
    for c in t.chunks:
        data = rest + store.get_chunk(c.id, c.size)
        cut = len(data) - len(data) % item
        rest = data[cut:]
        if cut:
            yield data[:cut]


def computed_stats(
    store: ObjectStore,
    t: TensorEntry,
    previous: TensorEntry | None,
    recorded: tuple[RecordedChanges, TensorKey] | None = None,
) -> TensorStats | None:
    """What a commit would have recorded about ``t`` (None for a non-numeric dtype), read from its
    chunks: for commits made before statistics were recorded."""
    if t.dtype not in NUMERIC_DTYPES:
        return None
    total = StatsAccumulator()
    for block in _elements(store, t, item_size(t.dtype)):
        total.add(chunk_stats(block, t.dtype))
    figures = total.result()
    return TensorStats(figures.l2, figures.absmax, figures.nonfinite, change_against(store, t, previous, recorded))


def change_against(
    store: ObjectStore,
    t: TensorEntry,
    previous: TensorEntry | None,
    recorded: tuple[RecordedChanges, TensorKey] | None = None,
) -> float | None:
    """||t − previous|| / ||previous||, None where undefined (format.md 5.1); ``recorded``: where
    the change record may hold it, and under which key."""
    if previous is None or previous.dtype != t.dtype or previous.shape != t.shape:
        return None
    if [c.id for c in previous.chunks] == [c.id for c in t.chunks]:
        return 0.0
    change = recorded[0].change(recorded[1], previous, t) if recorded else relative_l2(store, previous, t)
    return change if change is not None and math.isfinite(change) else None


def commit_stats(
    store: ObjectStore, commit: Commit, parent: Commit | None, ids: tuple[str, str] | None = None
) -> dict[tuple[str, str], TensorStats]:
    """Every numeric tensor's statistics by (path, name): the recorded ones, computing what a
    manifest lacks (no stats, or a change it did not record although there is a parent). With
    ``ids`` (the commit's and its first parent's), changes come from the change record where it
    has them, and those computed are added to it."""
    previous = {(f.path, t.name): t for f in parent.files for t in f.tensors} if parent else {}
    changes = RecordedChanges(store, ids[0], commit, ids[1], parent) if ids and parent is not None else None
    out: dict[tuple[str, str], TensorStats] = {}
    for f in commit.files:
        for t in f.tensors:
            key = (f.path, t.name)
            before = previous.get(key)
            where = (changes, key) if changes is not None else None
            figures = t.stats
            if figures is None:
                figures = computed_stats(store, t, before, where)
            elif figures.change is None and before is not None:
                figures = TensorStats(
                    figures.l2, figures.absmax, figures.nonfinite, change_against(store, t, before, where)
                )
            if figures is not None:
                out[key] = figures
    if changes is not None:
        changes.save()
    return out
