"""Compiled predictions (predict.py, docs/format.md section 4): one pass over a chunk's elements.

numpy evaluates a prediction as ~37 whole-array operations per block of elements (each rounding
and masking step is a pass of its own, with temporaries), 4.4 ms per MiB; here each element is
converted, predicted and rounded in registers. The format requires the prediction bit for bit
on every platform, so these loops compute exactly what predict.py's numpy reference computes:
the same IEEE-754 binary64 operations in the same order, each rounded on its own. That holds
because numba compiles without fast-math by default (no reassociation, no reciprocal
approximation) and LLVM contracts a multiply and an add into a fused multiply-add only when
told to (fast-math's ``contract``, or C's -ffp-contract), and ``error_model="numpy"`` lets a
division by zero give an infinity or NaN as numpy's does (Python's model would raise).
tests/codecs/test_predict_kernels.py checks it against the reference on hostile inputs, and that the
machine code holds no fused multiply-add.

Like context_kernels.py: imported only where numba is installed, cached on disk, GIL released
(compaction predicts on several threads).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numba
import numpy as np

from ckstore.errors import CkstoreWarning
from ckstore.runtime.kernel_cache import configure_numba

# Before the decorators: numba reads its cache folder when a function is decorated, and the cache
# is read with pickle, so it lives only in a folder nobody else can write (runtime/kernel_cache.py).
_CACHE = configure_numba(__file__)
_CACHED = _CACHE.folder is not None
if _CACHE.news:
    warnings.warn(CkstoreWarning(f"compiled kernels are not cached on disk: {_CACHE.reason}"), stacklevel=2)

_F32_MIN_NORMAL = 2.0**-126
_EXPONENT = np.uint32(0x7F800000)
_OPTIONS = {"cache": _CACHED, "nogil": True, "boundscheck": False, "error_model": "numpy", "fastmath": False}


@numba.njit(inline="always", **_OPTIONS)
def _input(bits: Any, value: Any) -> float:
    """Step 1: a float32 element (its bits and its value) as binary64, +0 when its exponent bits are all zero."""
    return 0.0 if (bits & _EXPONENT) == 0 else np.float64(value)


@numba.njit(inline="always", **_OPTIONS)
def _to32(x: float) -> Any:
    """Step 3: a binary64 result as float32; +0 below the normal range, for NaN and for what
    rounds to infinity."""
    if abs(x) < _F32_MIN_NORMAL:  # NaN compares false: it is caught after rounding
        return np.float32(0.0)
    f = np.float32(x)
    if math.isinf(f) or math.isnan(f):
        return np.float32(0.0)
    return f


@numba.njit(inline="always", **_OPTIONS)
def _second_moment(c0: float, c1: float, c2: float, c3: float, v: float, m: float, p: float) -> float:
    sq = c1 * (m * m)
    sq = sq + c2 * (m * p)
    sq = sq + c3 * (p * p)
    return c0 * np.float64(_to32(v + sq))


@numba.njit(inline="always", **_OPTIONS)
def _weight(c0: float, c1: float, c2: float, w: float, m: float, v: float) -> float:
    step = c1 * (m / (math.sqrt(v) + c2))
    return c0 * np.float64(_to32(w + step))


@numba.njit(**_OPTIONS)
def second_moment(c: Any, vb: Any, vf: Any, mb: Any, mf: Any, pb: Any, pf: Any, out: Any) -> None:
    """Predictor 1 into ``out`` (float32); each base as its bits (uint32) and its values (float32),
    two views of the same little-endian memory."""
    c0, c1, c2, c3 = c[0], c[1], c[2], c[3]
    for k in range(out.size):
        out[k] = _to32(_second_moment(c0, c1, c2, c3, _input(vb[k], vf[k]), _input(mb[k], mf[k]), _input(pb[k], pf[k])))


@numba.njit(**_OPTIONS)
def weight(c: Any, wb: Any, wf: Any, mb: Any, mf: Any, vb: Any, vf: Any, out: Any) -> None:
    """Predictor 2 into ``out`` (float32), bases as for ``second_moment``."""
    c0, c1, c2 = c[0], c[1], c[2]
    for k in range(out.size):
        out[k] = _to32(_weight(c0, c1, c2, _input(wb[k], wf[k]), _input(mb[k], mf[k]), _input(vb[k], vf[k])))


@numba.njit(**_OPTIONS)
def second_moment_converted(c: Any, v: Any, m: Any, p: Any, out: Any) -> None:
    """Predictor 1 into ``out`` (float32) from bases converted already (predict.inputs: a fit's sample)."""
    c0, c1, c2, c3 = c[0], c[1], c[2], c[3]
    for k in range(out.size):
        out[k] = _to32(_second_moment(c0, c1, c2, c3, v[k], m[k], p[k]))


@numba.njit(**_OPTIONS)
def weight_converted(c: Any, w: Any, m: Any, v: Any, out: Any) -> None:
    """Predictor 2 into ``out`` (float32) from bases converted already."""
    c0, c1, c2 = c[0], c[1], c[2]
    for k in range(out.size):
        out[k] = _to32(_weight(c0, c1, c2, w[k], m[k], v[k]))


@numba.njit(**_OPTIONS)
def sample(wb: Any, wf: Any, index: Any, bits: Any, values: Any) -> None:
    """A fit's sample of one chunk (its words as bits, uint32, and values, float32: two views of
    the same memory) at ``index``: the words into ``bits`` (uint32) and step 1 of each
    (predict.inputs: binary64, +0 for a zero exponent) into ``values`` (float64), in one pass."""
    for k in range(index.size):
        i = index[k]
        bits[k] = wb[i]
        values[k] = _input(wb[i], wf[i])


@numba.njit(**_OPTIONS)
def residual_planes(raw: Any, guess: Any, planes: Any) -> None:
    """A predicted delta's residual (``raw`` XOR ``guess``, uint32 words) split into its four
    byte planes (``planes``: 4 x n uint8, byte i of every element in row i), in one pass."""
    for k in range(raw.size):
        r = raw[k] ^ guess[k]
        planes[0, k] = r & np.uint32(0xFF)
        planes[1, k] = (r >> np.uint32(8)) & np.uint32(0xFF)
        planes[2, k] = (r >> np.uint32(16)) & np.uint32(0xFF)
        planes[3, k] = r >> np.uint32(24)


@numba.njit(**_OPTIONS)
def residual_matches(p0: Any, p1: Any, p2: Any, p3: Any, guess: Any, raw: Any) -> bool:
    """Whether the residual stored as byte planes ``p0``..``p3`` (byte i of every element in
    ``p<i>``), joined and XORed with ``guess``, is ``raw`` (uint32 words): a predicted delta's
    decode compared with the chunk in one pass, nothing written (``residual_planes`` undone).
    Differences are ORed together rather than returned at the first one: a loop without an exit
    is vectorized, and a mismatch is the rare case."""
    differ = np.uint32(0)
    for k in range(raw.size):
        r = (
            np.uint32(p0[k])
            | (np.uint32(p1[k]) << np.uint32(8))
            | (np.uint32(p2[k]) << np.uint32(16))
            | (np.uint32(p3[k]) << np.uint32(24))
        )
        differ |= (r ^ guess[k]) ^ raw[k]
    return differ == 0
