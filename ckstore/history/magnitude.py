"""How much a tensor changed: relative L2 distance, computed chunk by chunk (diff, show), and a
commit's per-tensor statistics: as recorded in its manifest, else computed from its chunks."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from ckstore.format.manifest import Commit, TensorEntry
from ckstore.format.tensor_stats import (
    NUMERIC_DTYPES, StatsAccumulator, TensorStats, as_float64, chunk_stats, item_size,
)
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


def relative_l2(store: ObjectStore, a: TensorEntry, b: TensorEntry) -> float | None:
    """||b − a|| / ||a|| computed chunk by chunk; None where it is not defined for the dtype."""
    if a.dtype != b.dtype or a.shape != b.shape or a.dtype not in NUMERIC_DTYPES:
        return None
    item = item_size(a.dtype)
    diff_sq = base_sq = 0.0
    for block_a, block_b in _aligned_pairs(store, a, b, item):
        va, vb = as_float64(block_a, a.dtype), as_float64(block_b, b.dtype)
        diff_sq += float(np.sum((vb - va) ** 2))
        base_sq += float(np.sum(va**2))
    if base_sq == 0.0:
        return 0.0 if diff_sq == 0.0 else math.inf
    return math.sqrt(diff_sq / base_sq)


def _elements(store: ObjectStore, t: TensorEntry, item: int) -> Iterator[bytes]:
    """A tensor's bytes in element-aligned blocks, one chunk at a time."""
    rest = b""
    for c in t.chunks:
        data = rest + store.get_chunk(c.id, c.size)
        cut = len(data) - len(data) % item
        rest = data[cut:]
        if cut:
            yield data[:cut]


def computed_stats(store: ObjectStore, t: TensorEntry, previous: TensorEntry | None) -> TensorStats | None:
    """What a commit would have recorded about ``t`` (None for a non-numeric dtype), read from its
    chunks: for commits made before statistics were recorded."""
    if t.dtype not in NUMERIC_DTYPES:
        return None
    total = StatsAccumulator()
    for block in _elements(store, t, item_size(t.dtype)):
        total.add(chunk_stats(block, t.dtype))
    figures = total.result()
    return TensorStats(figures.l2, figures.absmax, figures.nonfinite, change_against(store, t, previous))


def change_against(store: ObjectStore, t: TensorEntry, previous: TensorEntry | None) -> float | None:
    """||t − previous|| / ||previous||, None where undefined (format.md 5.1)."""
    if previous is None or previous.dtype != t.dtype or previous.shape != t.shape:
        return None
    if [c.id for c in previous.chunks] == [c.id for c in t.chunks]:
        return 0.0
    change = relative_l2(store, previous, t)
    return change if change is not None and math.isfinite(change) else None


def commit_stats(store: ObjectStore, commit: Commit, parent: Commit | None) -> dict[tuple[str, str], TensorStats]:
    """Every numeric tensor's statistics by (path, name): the recorded ones, computing what a
    manifest lacks (no stats, or a change it did not record although there is a parent)."""
    previous = {(f.path, t.name): t for f in parent.files for t in f.tensors} if parent else {}
    out: dict[tuple[str, str], TensorStats] = {}
    for f in commit.files:
        for t in f.tensors:
            key = (f.path, t.name)
            before = previous.get(key)
            figures = t.stats
            if figures is None:
                figures = computed_stats(store, t, before)
            elif figures.change is None and before is not None:
                figures = TensorStats(figures.l2, figures.absmax, figures.nonfinite, change_against(store, t, before))
            if figures is not None:
                out[key] = figures
    return out
