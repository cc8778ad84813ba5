"""The context-sorted delta (chunk encoding 5, docs/format.md section 4): pure, no I/O.

A plain delta (encoding 3) codes each byte plane of the residual (XOR or zigzag difference
against the base) on its own, so zstd sees one mixture of every element's statistics. But how far
a value moved depends on what the value is: an optimizer step moves a weight by roughly the same
absolute amount whatever its magnitude, so in the bit pattern the difference is large for small
exponents and small for large ones, and a low residual byte is near zero where the byte above it
is zero and near random where it is not. Both facts are known to a decoder before it decodes a
plane: the base's exponent and the residual plane above (decoded first). So a plane may be
stored *sorted by that context*: elements of one context become neighbours, and zstd's entropy
tables and matches adapt to each context's distribution. A decoder computes the same keys from
what it already has and scatters the plane back. deltas.py decides per plane whether sorting
pays (deltas.py, ``SORT_GAIN``); this module only permutes.

The sort and the scatter are counting sorts (a histogram of the 1,024 keys, its running sum, one
pass placing each byte), compiled with numba (context_kernels.py): numpy has no counting sort, and
its stable argsort made checkout 3 epochs back fall to 37-53 MB/s per core, below the 100 target
(docs/benchmarks.md). Without numba, and in a process that has decoded little of this
encoding, the same permutation comes from numpy: one SIMD sort of key * 2^b + element index
(identical bytes, about 5x the kernels' CPU a plane). Why not numba always: its first use in a
process costs about 1.2 s of CPU (its import, its compiler's set-up, loading the cached
kernels), more than a read of a few old tensors costs in all. So a decoder starts with numpy and
switches to the kernels once it has un-sorted ``NUMPY_DECODE_ELEMENTS`` (a short read never pays
numba's set-up; a long one loses little to numpy first); an encoder (repack, a long job) uses
them from the start.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ckstore.codecs.context_keys import HIGHER_CAP, KEYS, WIDTHS
from ckstore.errors import IntegrityError

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "HIGHER_CAP",
    "JOIN_WIDTHS",
    "KEYS",
    "WIDTHS",
    "base_words",
    "decode_kernels",
    "join",
    "load_kernels",
    "loaded_kernels",
    "sort_key",
    "sorted_plane",
    "unsort_into",
    "unsort_planes",
]


def sort_key(base: np.ndarray, width: int, higher: np.ndarray | None) -> np.ndarray:
    """The context of each element of one plane (format.md): the 8 bits below the sign bit of
    the base element (a float's exponent, or its top 8 exponent bits), times 4, plus for every
    plane but the top one the residual byte of the plane above, capped at ``HIGHER_CAP``."""
    import numpy as np

    elements = base.reshape(-1, width)
    key = elements[:, width - 1].astype(np.uint16)
    np.left_shift(key, 1, out=key)
    np.bitwise_or(key, elements[:, width - 2] >> 7, out=key, casting="unsafe")
    np.bitwise_and(key, 0xFF, out=key)
    np.left_shift(key, 2, out=key)
    if higher is not None:
        np.bitwise_or(key, np.minimum(higher, HIGHER_CAP), out=key, casting="unsafe")
    return key


# ---- the compiled counting sorts ---------------------------------------------------------------

_KERNELS: list[Any] = []  # [module or None], set on first use
_KERNELS_LOCK = threading.Lock()


def _kernels() -> Any:
    """context_kernels, or None when numba is not installed (imported once, on first use)."""
    if not _KERNELS:
        with _KERNELS_LOCK:
            if not _KERNELS:
                kernels: ModuleType | None
                try:
                    from ckstore.codecs import context_kernels as kernels
                except ImportError:
                    kernels = None
                _KERNELS.append(kernels)
    return _KERNELS[0]


def load_kernels() -> Any:
    """Load the kernels now (a long job that decodes many planes: compaction), or None where
    numba is missing."""
    return _kernels()


def loaded_kernels() -> Any:
    """The kernels if this process has loaded them, else None: a plain delta joins its planes
    with them once they are loaded, but never loads numba itself (its set-up costs more than a
    short read)."""
    return _KERNELS[0] if _KERNELS else None


# Elements a process un-sorts with numpy before it loads the kernels. numba's first use costs
# 1.0-1.3 s of CPU (fresh process, load 7); numpy costs 17 ns an element against the kernels' 3
# (one thread, load 8-10), so break-even is ~80 M elements, but with that budget a fresh
# `ckstore checkout` of an fp32 commit three deltas back (271 MB, 104 M elements un-sorted) took
# 7.9-10.5 s of CPU against 5.8 for numba from the start (load 13: numpy's sorts on parallel
# threads of a loaded machine cost far more). 16 M bounds what a large read loses to ~0.3 s and
# keeps reads of a few tens of MB of an old commit free of numba. docs/benchmarks.md.
NUMPY_DECODE_ELEMENTS = 16_000_000
_NUMPY_DECODED = [0]  # elements un-sorted with numpy so far (a lost update between threads only delays the switch)


def decode_kernels(elements: int) -> Any:
    """The kernels to un-sort ``elements`` elements (all planes of a chunk), or None to use numpy: the kernels
    once loaded (by an encode, a test, or this rule) or once this process has un-sorted
    ``NUMPY_DECODE_ELEMENTS`` with numpy."""
    if _KERNELS:
        return _KERNELS[0]
    if _NUMPY_DECODED[0] < NUMPY_DECODE_ELEMENTS:
        _NUMPY_DECODED[0] += elements
        return None
    return _kernels()


def _order(keys: np.ndarray) -> np.ndarray:
    """Element indices in ascending key order, ties in element order: one sort of key * 2^b +
    index, whose values are unique, so any sort is stable. numpy sorts 32-bit integers with
    SIMD (x86-simd-sort): 2.4-2.8 ms a 256 Ki-element plane against 9.6 for its stable argsort."""
    import numpy as np

    n = keys.size
    bits = max(n - 1, 1).bit_length()
    dtype = np.uint32 if bits + (KEYS - 1).bit_length() <= 32 else np.uint64
    packed = keys.astype(dtype)
    np.left_shift(packed, bits, out=packed)
    np.bitwise_or(packed, np.arange(n, dtype=dtype), out=packed)
    packed.sort()
    np.bitwise_and(packed, (1 << bits) - 1, out=packed)
    return packed


def _numpy_order(residual: np.ndarray, base: np.ndarray, width: int, plane: int) -> np.ndarray:
    """The permutation of one plane without the kernels (``sort_key``, ``_order``)."""
    elements = residual.reshape(-1, width)
    higher = elements[:, plane + 1] if plane < width - 1 else None
    return _order(sort_key(base, width, higher))


_LOCAL = threading.local()
_KEEP_MAX = 4 << 20  # elements: a thread keeps at most 16 MiB of key arrays


def _exponents(kernels: Any, words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every element's exponent key (the top plane's key, the major part of the others') from
    the base's ``words`` (unsigned little-endian integers of the element width) and a work array
    for one plane's keys: the thread's own arrays, reused. Why: two fresh 512 KiB arrays a chunk
    cost 256 page faults, measured at 3-5 us each on a loaded VM, as much as the counting sorts."""
    import numpy as np

    n = words.size
    held = getattr(_LOCAL, "keys", None)
    if n > _KEEP_MAX:
        held = np.empty((2, n), np.uint16)  # a rare huge chunk: not kept
    elif held is None or held.shape[1] < n:
        held = _LOCAL.keys = np.empty((2, max(n, 1 << 18)), np.uint16)
    exponents, keys = held[0, :n], held[1, :n]
    kernels.exponent_keys(words, exponents)
    return exponents, keys


def base_words(base: bytes | memoryview, width: int) -> np.ndarray:
    """The base as read-only unsigned integers of the element width: one array type whether the
    base is bytes or a decode buffer, so numba compiles (and caches) each kernel once."""
    import numpy as np

    words = np.frombuffer(base, f"<u{width}")
    words.flags.writeable = False
    return words


# ---- encoding and decoding ---------------------------------------------------------------------


def sorted_plane(residual: np.ndarray, base: bytes | memoryview, width: int) -> Callable[[int], np.ndarray]:
    """A function of a plane number: that plane of the residual (byte i of every element),
    permuted into the order of its context (``sort_key``)."""
    import numpy as np

    if width not in WIDTHS:
        raise ValueError(f"no context-sorted delta for element width {width}")
    base_bytes = np.frombuffer(base, dtype=np.uint8)
    kernels = _kernels()
    if kernels is not None:
        exponents, keys = _exponents(kernels, base_words(base, width))

    def plane_of(plane: int) -> np.ndarray:
        if kernels is None:
            return residual.reshape(-1, width)[:, plane][_numpy_order(residual, base_bytes, width, plane)]
        out = np.empty(residual.size // width, np.uint8)
        kernels.sort_plane(residual, residual.view(f"<u{width}"), exponents, width, plane, keys, out)
        return out

    return plane_of


def unsort_planes(
    stored: dict[int, np.ndarray], base: bytes | memoryview, width: int, out: np.ndarray, numpy_only: bool = False
) -> np.ndarray:
    """Inverse of ``sorted_plane``: ``out`` (uint8, ``n * width``: the interleaved residual, every
    plane not in ``stored`` filled already) gets each plane of ``stored`` (plane -> its sorted
    bytes) put back in element order; returned. With the kernels (``decode_kernels``) unless
    ``numpy_only`` (a caller that asked ``decode_kernels`` already). A delta's decoder with the
    kernels un-sorts into planes instead (``unsort_into``: no interleaving before it joins them)."""
    import numpy as np

    if width not in WIDTHS:
        raise IntegrityError(f"context-sorted delta with element width {width}")
    base_bytes = np.frombuffer(base, dtype=np.uint8)
    if base_bytes.size != out.size or any(p.size != base_bytes.size // width for p in stored.values()):
        raise IntegrityError("context-sorted planes and the base differ in length")
    kernels = decode_kernels(len(stored) * (base_bytes.size // width)) if stored and not numpy_only else None
    elements = out.reshape(-1, width)
    if kernels is not None:
        planes = elements.T.copy()
        unsort_into(kernels, stored, base_words(base, width), planes)
        elements[:] = planes.T
        return out
    for plane in sorted(stored, reverse=True):  # each plane's key needs the plane above it
        elements[_numpy_order(out, base_bytes, width, plane), plane] = stored[plane]
    return out


def unsort_into(kernels: Any, stored: dict[int, np.ndarray], words: np.ndarray, planes: np.ndarray) -> None:
    """``unsort_planes`` with the kernels, on planes: ``planes`` (width x n bytes, row i = byte i
    of every element; the rows not in ``stored`` filled already) gets each plane of ``stored``
    scattered back into its row; ``words``: the base (``base_words``)."""
    width, n = planes.shape
    if width not in WIDTHS or words.size != n or any(p.size != n for p in stored.values()):
        raise IntegrityError("context-sorted planes and the base differ in length")
    if not stored:
        return
    exponents, keys = _exponents(kernels, words)
    for plane in sorted(stored, reverse=True):  # each plane's key needs the plane above it
        if plane == width - 1:
            kernels.unsort_top(stored[plane], exponents, planes[plane])
        else:
            kernels.unsort_below(stored[plane], exponents, planes[plane + 1], keys, planes[plane])


JOIN_WIDTHS = (2, 4, 8)  # element widths the kernels join planes for
_NO_BASE: dict[int, np.ndarray] = {}


def join(kernels: Any, planes: np.ndarray, words: np.ndarray | None, op: int, out: np.ndarray) -> None:
    """A chunk's elements into ``out`` (uint8, width * n) from its ``planes`` (width x n); for a
    delta (``op``: 1 XOR, 2 zigzag difference, as ``DeltaOp``) undone against its base's ``words``
    (``base_words``); ``op`` 0 and no words for a chunk stored whole."""
    width = planes.shape[0]
    if words is None:
        if width not in _NO_BASE:
            _NO_BASE[width] = base_words(b"", width)
        words = _NO_BASE[width]
    kernel = {2: kernels.join2, 4: kernels.join4, 8: kernels.join8}[width]
    kernel(planes, words, op, out.view(f"<u{width}"))
