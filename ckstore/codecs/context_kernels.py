"""Compiled counting sorts of the context-sorted delta (context.py explains the encoding).

Imported by an encoder of that encoding, and by a decoder once it has un-sorted enough with numpy
to pay for numba's set-up (context.py), and only where numba is installed. The kernels
are cached on disk (``cache=True``: later processes load the machine code instead of compiling
it) and release the GIL (checkout decodes chunks on several threads at once).

Separate simple loops (keys, histogram, placement) measured twice as fast as one fused pass over
the elements decoding every plane (3.6 against 6.7 ms per fp32 MiB, load ~5): the simple loops
vectorise, and only the placement carries a dependency from one element to the next.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from ckstore.codecs.context_keys import HIGHER_CAP, KEYS


@numba.njit(cache=True, nogil=True, boundscheck=False)
def exponent_keys(words: Any, keys: Any) -> None:
    """``keys[k]`` = 4 x the 8 bits below the sign bit of base element ``k`` (``words``: the base
    as unsigned little-endian integers of its element width); the top plane's key, and the major
    part of every other plane's (docs/format.md, section 4). Whole words, not bytes: vectorised,
    5x faster."""
    shift = words.itemsize * 8 - 9
    for k in range(keys.size):
        keys[k] = np.uint16((words[k] >> shift) & 0xFF) << 2


@numba.njit(cache=True, nogil=True, boundscheck=False)
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


@numba.njit(cache=True, nogil=True, boundscheck=False)
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


@numba.njit(cache=True, nogil=True, boundscheck=False)
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


@numba.njit(cache=True, nogil=True, boundscheck=False)
def unsort_plane(stored: Any, exponents: Any, width: int, plane: int, keys: Any, residual: Any, words: Any) -> None:
    """Inverse of ``sort_plane``: byte ``plane`` of each element of ``residual`` from ``stored``
    (the planes above it are in ``residual`` already; ``words``: the same bytes as integers)."""
    keys = _plane_keys(exponents, words, width, plane, keys)
    starts = _starts(keys)
    for k in range(keys.size):
        key = keys[k]
        residual[k * width + plane] = stored[starts[key]]
        starts[key] += 1
