"""Compiled counting sorts of the context-sorted delta (context.py explains the encoding).

Imported by an encoder of that encoding, and by a decoder once it has un-sorted enough with numpy
to pay for numba's set-up (context.py), and only where numba is installed. Once imported, every
delta (encoding 3 and 5) of 2-, 4- and 8-byte elements is also joined with them (``join2`` ...). The kernels
are cached on disk (``cache=True``: later processes load the machine code instead of compiling
it), in a folder only this user can write (runtime/kernel_cache.py), and release the GIL
(checkout decodes chunks on several threads at once).

Separate simple loops (keys, histogram, placement) measured twice as fast as one fused pass over
the elements decoding every plane (3.6 against 6.7 ms per fp32 MiB, load ~5): the simple loops
vectorise, and only the placement carries a dependency from one element to the next.
"""

from __future__ import annotations

import warnings
from typing import Any

import numba
import numpy as np

from ckstore.codecs.context_keys import HIGHER_CAP, KEYS
from ckstore.errors import CkstoreWarning
from ckstore.runtime.kernel_cache import configure_numba

# Before the decorators: numba reads its cache folder when a function is decorated, and the cache
# is read with pickle, so it lives only in a folder nobody else can write (runtime/kernel_cache.py).
_CACHE = configure_numba(__file__)
_CACHED = _CACHE.folder is not None
if _CACHE.news:
    warnings.warn(CkstoreWarning(f"compiled kernels are not cached on disk: {_CACHE.reason}"), stacklevel=2)


@numba.njit(cache=_CACHED, nogil=True, boundscheck=False)
def exponent_keys(words: Any, keys: Any) -> None:
    """``keys[k]`` = 4 x the 8 bits below the sign bit of base element ``k`` (``words``: the base
    as unsigned little-endian integers of its element width); the top plane's key, and the major
    part of every other plane's (docs/format.md, section 4). Whole words, not bytes: vectorised,
    5x faster."""
    shift = words.itemsize * 8 - 9
    for k in range(keys.size):
        keys[k] = np.uint16((words[k] >> shift) & 0xFF) << 2


@numba.njit(cache=_CACHED, nogil=True, boundscheck=False)
def _plane_keys(exponents: Any, words: Any, width: int, plane: int, keys: Any) -> Any:
    """The keys of ``plane``: the exponent key (``exponents``) for the top plane, else, in
    ``keys``, the exponent key plus the residual byte of the plane above capped at 3 (``words``:
    the residual as unsigned little-endian integers of its element width). Its own loop over
    whole words: it vectorises (0.05 ms a 256 Ki-element plane against 0.5-0.6 ms when the byte
    was read on its own and the count done in the same loop)."""
    if plane == width - 1:
        return exponents
    shift = 8 * (plane + 1)
    for k in range(keys.size):
        keys[k] = exponents[k] | min(np.uint16((words[k] >> shift) & 0xFF), np.uint16(HIGHER_CAP))
    return keys


@numba.njit(cache=_CACHED, nogil=True, boundscheck=False)
def _starts(keys: Any) -> Any:
    """Where each key's run starts in the sorted plane (the exclusive running sum of the keys'
    histogram). Neighbouring elements often share a key, and each count waits for the previous
    increment of the same counter: four histograms, element k counted in histogram k % 4, break
    that chain (0.5 against 0.8 ns an element on the benchmark's planes)."""
    counts = np.zeros((4, KEYS), np.int64)
    whole = keys.size - keys.size % 4
    for k in range(0, whole, 4):
        counts[0, keys[k]] += 1
        counts[1, keys[k + 1]] += 1
        counts[2, keys[k + 2]] += 1
        counts[3, keys[k + 3]] += 1
    for k in range(whole, keys.size):
        counts[0, keys[k]] += 1
    starts = np.empty(KEYS, np.int64)
    total = 0
    for key in range(KEYS):
        starts[key] = total
        total += counts[0, key] + counts[1, key] + counts[2, key] + counts[3, key]
    return starts


@numba.njit(cache=_CACHED, nogil=True, boundscheck=False)
def sort_plane(residual: Any, words: Any, exponents: Any, width: int, plane: int, keys: Any, out: Any) -> None:
    """Byte ``plane`` of every element of ``residual`` (interleaved; ``words``: the same bytes as
    integers of the element width) into ``out`` in ascending key order, equal keys in element
    order (a stable counting sort); ``keys``: work array."""
    keys = _plane_keys(exponents, words, width, plane, keys)
    starts = _starts(keys)
    for k in range(keys.size):
        key = keys[k]
        out[starts[key]] = residual[k * width + plane]
        starts[key] += 1


@numba.njit(cache=_CACHED, nogil=True, boundscheck=False)
def _place(stored: Any, keys: Any, plane: Any) -> None:
    """Inverse of ``sort_plane``'s placement: ``plane`` (contiguous) from ``stored`` (the same
    bytes in ascending key order, equal keys in element order)."""
    starts = _starts(keys)
    for k in range(plane.size):
        key = keys[k]
        plane[k] = stored[starts[key]]
        starts[key] += 1


@numba.njit(cache=_CACHED, nogil=True, boundscheck=False)
def unsort_top(stored: Any, exponents: Any, plane: Any) -> None:
    """Inverse of ``sort_plane`` for the top plane, whose key is the exponent key alone: ``plane``
    (that plane of every element, contiguous) from ``stored``."""
    _place(stored, exponents, plane)


@numba.njit(cache=_CACHED, nogil=True, boundscheck=False)
def unsort_below(stored: Any, exponents: Any, higher: Any, keys: Any, plane: Any) -> None:
    """Inverse of ``sort_plane`` for a plane under the top one: ``plane`` from ``stored``, keyed by
    the exponent key and the plane above (``higher``, decoded already, contiguous); ``keys``: work
    array. Contiguous planes, not strided bytes of interleaved elements: the keys' loop reads one
    byte an element and vectorises, and the placement writes consecutive bytes."""
    for k in range(keys.size):
        keys[k] = exponents[k] | min(higher[k], np.uint8(HIGHER_CAP))
    _place(stored, keys, plane)


# Joining the byte planes of a chunk into its elements and, for a delta, undoing its residual
# against the base (``op``: 0 none, 1 XOR, 2 zigzag difference added, modulo 2^(8 x width)) in
# one pass: numpy needs a strided write per plane to interleave them and three to five passes
# (and a temporary) to undo a zigzag difference; these loops vectorise. Measured on 1 MiB of
# random elements (load ~3): 0.08-0.14 ms (bf16) and 0.17-0.33 ms (fp32) a delta.
JOIN_NONE, JOIN_XOR, JOIN_SUB = 0, 1, 2


@numba.njit(cache=_CACHED, nogil=True, boundscheck=False)
def join2(planes: Any, base: Any, op: int, out: Any) -> None:
    """``out`` (uint16 elements) from ``planes`` (2 x n bytes, plane i = byte i) and ``base``."""
    p0, p1 = planes[0], planes[1]
    if op == JOIN_NONE:
        for k in range(out.size):
            out[k] = np.uint16(p0[k]) | (np.uint16(p1[k]) << np.uint16(8))
    elif op == JOIN_XOR:
        for k in range(out.size):
            out[k] = (np.uint16(p0[k]) | (np.uint16(p1[k]) << np.uint16(8))) ^ base[k]
    else:
        for k in range(out.size):
            r = np.int64(p0[k]) | (np.int64(p1[k]) << 8)
            out[k] = (((r >> 1) ^ -(r & 1)) + np.int64(base[k])) & 0xFFFF


@numba.njit(cache=_CACHED, nogil=True, boundscheck=False)
def join4(planes: Any, base: Any, op: int, out: Any) -> None:
    """``join2`` for uint32 elements (4 planes)."""
    p0, p1, p2, p3 = planes[0], planes[1], planes[2], planes[3]
    if op == JOIN_NONE:
        for k in range(out.size):
            out[k] = (
                np.uint32(p0[k])
                | (np.uint32(p1[k]) << np.uint32(8))
                | (np.uint32(p2[k]) << np.uint32(16))
                | (np.uint32(p3[k]) << np.uint32(24))
            )
    elif op == JOIN_XOR:
        for k in range(out.size):
            out[k] = (
                np.uint32(p0[k])
                | (np.uint32(p1[k]) << np.uint32(8))
                | (np.uint32(p2[k]) << np.uint32(16))
                | (np.uint32(p3[k]) << np.uint32(24))
            ) ^ base[k]
    else:
        for k in range(out.size):
            r = np.int64(p0[k]) | (np.int64(p1[k]) << 8) | (np.int64(p2[k]) << 16) | (np.int64(p3[k]) << 24)
            out[k] = (((r >> 1) ^ -(r & 1)) + np.int64(base[k])) & 0xFFFFFFFF


@numba.njit(cache=_CACHED, nogil=True, boundscheck=False)
def join8(planes: Any, base: Any, op: int, out: Any) -> None:
    """``join2`` for uint64 elements (8 planes; unsigned arithmetic wraps, as the format says)."""
    one = np.uint64(1)
    for k in range(out.size):
        r = np.uint64(0)
        for i in range(8):
            r |= np.uint64(planes[i, k]) << np.uint64(8 * i)
        if op == JOIN_NONE:
            out[k] = r
        elif op == JOIN_XOR:
            out[k] = r ^ base[k]
        else:
            out[k] = ((r >> one) ^ (np.uint64(0) - (r & one))) + base[k]
