"""How much a tensor changed: relative L2 distance, computed chunk by chunk (diff, show)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from ckstore.format.dtypes import NUMPY_TYPES
from ckstore.format.manifest import TensorEntry
from ckstore.repository.store import ObjectStore

# Numeric types numpy can widen to float64 (floats and integers; BF16 is widened by hand).
_VIEWS = {code: np.dtype(t) for code, t in NUMPY_TYPES.items() if np.dtype(t).kind in "fiu"}


def _as_float64(data: bytes, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return (np.frombuffer(data, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return np.frombuffer(data, dtype=_VIEWS[dtype]).astype(np.float64)


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
    if a.dtype != b.dtype or a.shape != b.shape or (a.dtype not in _VIEWS and a.dtype != "BF16"):
        return None
    item = 2 if a.dtype == "BF16" else _VIEWS[a.dtype].itemsize
    diff_sq = base_sq = 0.0
    for block_a, block_b in _aligned_pairs(store, a, b, item):
        va, vb = _as_float64(block_a, a.dtype), _as_float64(block_b, b.dtype)
        diff_sq += float(np.sum((vb - va) ** 2))
        base_sq += float(np.sum(va**2))
    if base_sq == 0.0:
        return 0.0 if diff_sq == 0.0 else math.inf
    return math.sqrt(diff_sq / base_sq)
