"""Predictions of a float32 chunk from other float32 chunks (pure, no I/O): what a predicted delta
(codec encoding 4, docs/format.md section 4) stores the XOR against.

Between two consecutive AdamW steps every byte of the state changes, but the previous step's
state is almost a function of the current one (``g_t = (m_t - b1 m_{t-1}) / (1 - b1)``):

- ``v_{t-1} = (v_t - (1 - b2) g_t^2) / b2``: ``ADAM_SECOND_MOMENT`` over (v, m, p) = (v_t, m_t,
  m_{t-1}), ``c0 * round32(v + c1 m^2 + c2 m p + c3 p^2)`` (the square of the gradient
  expanded, so the fit is linear);
- ``w_{t-1} = (w_t + lr m^_t / (sqrt(v^_t) + eps)) / (1 - lr wd)``: ``ADAM_WEIGHT`` over
  (w_t, m_t, v_t), ``c0 * round32(w + c1 m / (sqrt(v) + c2))`` (bias corrections folded into
  c1 and c2).

``round32`` is the float32 rounding the forward step did between its add and its multiply.

The coefficients are stored in the object, so a reader needs no optimizer settings; the writer
fits them (``fit``). A reader must compute the prediction bit for bit as the writer did, on any
platform and numpy version, so ``predict`` uses only correctly rounded IEEE-754 operations
(+ - * / sqrt) on float64, one numpy ufunc per operation (no fused multiply-add, no libm), in a
fixed order. Nothing it computes can be subnormal (where flush-to-zero modes would differ): float32
subnormal inputs are zeroed by masking their bits, coefficients are 0 or within 2^-64..2^64
(``check_coefficients``), which keeps every nonzero intermediate above 2^-400; a result below the
float32 normal range becomes +0 before rounding to float32, and NaN or infinity (NaN payloads
differ between x86 and ARM) becomes +0. ``predict_numpy`` is that reference; where numba is
installed, an encoder (and a long read) computes the same operations, in the same order, in one
compiled pass per element (predict_kernels.py: ~37 numpy passes a block otherwise).
"""

from __future__ import annotations

import functools
import math
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np

MIN_COEFFICIENT = 2.0**-64
MAX_COEFFICIENT = 2.0**64
_F32_MIN_NORMAL = 2.0**-126
_EXPONENT = np.uint32(0x7F800000)
_BLOCK = 1 << 14  # elements predicted at a time: 128 KiB float64 temporaries stay in cache (3x faster than 2 MiB ones)
# Elements of a fit's sample, spread over the chunk in runs (SAMPLE_RUN; a fit costs a least-squares solve on them).
FIT_SAMPLE = 1 << 15


class Predictor(IntEnum):
    ADAM_SECOND_MOMENT = 1  # bases (v_t, m_t, m_{t-1}), 4 coefficients
    ADAM_WEIGHT = 2  # bases (w_t, m_t, v_t), 3 coefficients


@dataclass(frozen=True)
class Shape:
    bases: int
    coefficients: int


SHAPES = {Predictor.ADAM_SECOND_MOMENT: Shape(3, 4), Predictor.ADAM_WEIGHT: Shape(3, 3)}


def check_coefficients(coefficients: Sequence[float]) -> None:
    """Raise ValueError unless every coefficient is 0 or finite within 2^-64..2^64 in magnitude."""
    for c in coefficients:
        if c != 0.0 and not MIN_COEFFICIENT <= abs(c) <= MAX_COEFFICIENT:  # NaN fails both
            raise ValueError(f"predictor coefficient {c!r} is outside 0 or 2^-64..2^64")


def inputs(data: bytes | memoryview | np.ndarray) -> np.ndarray:
    """A little-endian float32 chunk as float64, subnormals zeroed by their bits (not by a
    comparison, which a denormals-are-zero mode would change)."""
    bits = np.frombuffer(data, dtype="<u4")
    bits = np.where((bits & _EXPONENT) == 0, np.uint32(0), bits)
    return bits.view("<f4").astype(np.float64)


def to_float32_bits(r: np.ndarray) -> np.ndarray:
    """float64 results as float32 bit patterns (uint32): below the normal range +0, else rounded to
    nearest even, and NaN or a result that rounds to infinity +0."""
    with np.errstate(all="ignore"):
        r = np.where(np.abs(r) < _F32_MIN_NORMAL, 0.0, r)  # NaN compares false: handled below
        bits = r.astype("<f4").view("<u4")
    return np.where((bits & _EXPONENT) == _EXPONENT, np.uint32(0), bits)


def _round32(r: np.ndarray) -> np.ndarray:
    """``to_float32_bits`` as float64 values: the forward step's float32 rounding, undone in order."""
    return to_float32_bits(r).view("<f4").astype(np.float64)


def _second_moment(c: Sequence[float], b: Sequence[np.ndarray]) -> np.ndarray:
    # Forward (float32): v_t = round(round(v_{t-1} * b2) + (1 - b2) g^2). Undone one rounding at a
    # time: the float32 product is recovered exactly far more often than in one float64 step.
    v, m, p = b
    sq = np.multiply(c[1], np.multiply(m, m))
    sq = np.add(sq, np.multiply(c[2], np.multiply(m, p)))
    sq = np.add(sq, np.multiply(c[3], np.multiply(p, p)))
    return np.multiply(c[0], _round32(np.add(v, sq)))


def _weight(c: Sequence[float], b: Sequence[np.ndarray]) -> np.ndarray:
    # Forward (float32): w_t = round(round(w_{t-1} * (1 - lr wd)) - step m / (sqrt(v) + eps)).
    w, m, v = b
    step = np.multiply(c[1], np.divide(m, np.add(np.sqrt(v), c[2])))
    return np.multiply(c[0], _round32(np.add(w, step)))


_FORMULAS: dict[Predictor, Callable[[Sequence[float], Sequence[np.ndarray]], np.ndarray]] = {
    Predictor.ADAM_SECOND_MOMENT: _second_moment,
    Predictor.ADAM_WEIGHT: _weight,
}


def predict(predictor: Predictor, coefficients: Sequence[float], bases: Sequence[bytes | memoryview]) -> np.ndarray:
    """The prediction as float32 bit patterns (uint32), from the bases' raw little-endian float32
    bytes (all of one length, a multiple of 4): compiled (predict_kernels.py) where this process
    has loaded the kernels (``load_compiled``), else by ``predict_numpy``; the same bits either way."""
    c = _checked(predictor, coefficients, bases)
    views = [memoryview(b).cast("B") for b in bases]
    if any(len(v) != len(views[0]) for v in views):
        raise ValueError("a prediction's bases must all be of one length")
    n = len(views[0]) // 4
    kernels = _compiled(n)
    if kernels is None:
        return predict_numpy(predictor, c, views)
    out = np.empty(n, dtype=np.uint32)
    words = [np.frombuffer(v[: 4 * n], dtype=np.uint32) for v in views]
    args = [a for w in words for a in (w, w.view(np.float32))]
    kernel = kernels.second_moment if predictor == Predictor.ADAM_SECOND_MOMENT else kernels.weight
    kernel(np.array(c, dtype=np.float64), *args, out.view(np.float32))
    return out


def predict_numpy(
    predictor: Predictor, coefficients: Sequence[float], bases: Sequence[bytes | memoryview]
) -> np.ndarray:
    """``predict`` with numpy (the reference the kernels are tested against, and what a process
    uses before it loads them)."""
    c = _checked(predictor, coefficients, bases)
    views = [memoryview(b).cast("B") for b in bases]
    n = len(views[0]) // 4
    out = np.empty(n, dtype=np.uint32)
    # In blocks: the float64 temporaries of a whole 256 MiB chunk would take gigabytes, and
    # small ones stay in cache.
    for start in range(0, n, _BLOCK):
        end = min(n, start + _BLOCK)
        with np.errstate(all="ignore"):
            r = _FORMULAS[predictor](c, [inputs(v[4 * start : 4 * end]) for v in views])
        out[start:end] = to_float32_bits(r)
    return out


def _checked(predictor: Predictor, coefficients: Sequence[float], bases: Sequence[object]) -> list[float]:
    shape = SHAPES[predictor]
    if len(bases) != shape.bases or len(coefficients) != shape.coefficients:
        raise ValueError(f"predictor {predictor.name} takes {shape.bases} bases and {shape.coefficients} coefficients")
    check_coefficients(coefficients)
    return [float(x) for x in coefficients]


# ---- the compiled kernels (predict_kernels.py) ---------------------------------------------------

_KERNELS: list[Any] = []  # [module or None], set once loaded
_KERNELS_LOCK = threading.Lock()
# Elements a process predicts with numpy before it loads the kernels of its own accord: numba's
# first use costs about 1.2 s of CPU (codecs/context.py), numpy ~17 ns an element more than the
# kernels, so a read of a few predicted chunks stays free of numba and a long one switches.
NUMPY_PREDICT_ELEMENTS = 16_000_000
_NUMPY_PREDICTED = [0]  # a lost update between threads only delays the switch


def load_compiled() -> bool:
    """Load the kernels now (an encoder: compaction predicts every DCP step's chunks); False
    where numba is missing or the machine is big-endian (the kernels read little-endian words
    in place)."""
    if not _KERNELS:
        with _KERNELS_LOCK:
            if not _KERNELS:
                kernels: Any = None
                if sys.byteorder == "little":
                    try:
                        from ckstore.codecs import predict_kernels as kernels
                    except ImportError:
                        kernels = None
                if kernels is not None:
                    # numba's set-up is paid now: byte-grouped planes (every predicted residual
                    # checked, the bases read) are joined in one compiled pass too, not numpy's
                    # strided writes (0.45 thread-s a DCP benchmark step).
                    from ckstore.codecs.context import load_kernels

                    load_kernels()
                _KERNELS.append(kernels)
    return _KERNELS[0] is not None


def loaded_compiled() -> Any:
    """The kernels if this process has loaded them (``load_compiled``), else None."""
    return _KERNELS[0] if _KERNELS else None


def _compiled(elements: int) -> Any:
    """The kernels to predict ``elements`` elements with, or None for numpy (see NUMPY_PREDICT_ELEMENTS)."""
    if _KERNELS:
        return _KERNELS[0]
    from ckstore.codecs.context import loaded_kernels

    if _NUMPY_PREDICTED[0] < NUMPY_PREDICT_ELEMENTS and loaded_kernels() is None:  # else numba's set-up is paid
        _NUMPY_PREDICTED[0] += elements
        return None
    load_compiled()
    return _KERNELS[0]


def _rounded(coefficients: np.ndarray) -> tuple[float, ...] | None:
    """Coefficients a reader accepts: tiny ones become 0; None when one is out of range."""
    out = tuple(0.0 if abs(c) < MIN_COEFFICIENT else float(c) for c in coefficients)
    try:
        check_coefficients(out)
    except ValueError:
        return None
    return out


# A fit's sample is taken as runs of this many adjacent elements spread over the chunk, not as
# single elements: gathering 2^15 single elements touched every cache line of a 1 MiB chunk (a
# stride of 8 elements) four times a fit, runs of 256 touch an eighth of them (the sample of four
# chunks 2.4 -> 0.9 ms where they are no longer cached). The DCP benchmark's step stored 5.8 KB
# less (of 1140 MB) with the coefficients fitted on runs.
SAMPLE_RUN = 256


@functools.lru_cache(maxsize=8)
def _sample_index(n: int) -> np.ndarray:
    """The sampled elements of a chunk of ``n``, in order (read-only: shared by every chunk of
    that length; ``linspace`` took 0.4 ms a chunk)."""
    if n <= FIT_SAMPLE:
        index = np.arange(n, dtype=np.int64)
    else:
        starts = np.linspace(0, n - SAMPLE_RUN, num=FIT_SAMPLE // SAMPLE_RUN, dtype=np.int64)
        index = np.unique((starts[:, None] + np.arange(SAMPLE_RUN, dtype=np.int64)).reshape(-1))
    index.flags.writeable = False
    return index


def _least_squares(features: list[np.ndarray], target: np.ndarray, scale_by: np.ndarray) -> np.ndarray | None:
    """Coefficients minimising the error relative to ``scale_by`` (the predicted chunk: every
    magnitude counts, as bit-exact prediction needs), over the rows where everything is finite
    and ``scale_by`` nonzero.

    No BLAS: numpy's OpenBLAS threads a product or a solve over a sample this tall, and its
    threads then spin waiting for the next one; the fits of a DCP step cost twice the process
    CPU that way (8 unhinted fits 0.69 against 0.38 CPU s single-threaded). Dot products are
    einsum's (no BLAS), and the few columns are solved by Gram-Schmidt below."""
    ok = np.isfinite(target) & np.isfinite(scale_by) & (scale_by != 0)
    for f in features:
        ok &= np.isfinite(f)
    if ok.sum() < 2 * len(features):
        return None
    weight = 1.0 / np.abs(scale_by[ok])
    columns = [f[ok] * weight for f in features]
    t = target[ok] * weight
    scale = np.array([math.sqrt(_dot(c, c) / len(c)) for c in columns])
    scale[scale == 0] = 1.0
    columns = [c / s for c, s in zip(columns, scale)]
    if len(columns) <= 2:
        # The weight's features (w and the Adam step) are nearly orthogonal once scaled: normal
        # equations are exact enough and cost a fraction of an orthogonalization (the epsilon
        # search solves 80).
        gram = np.array([[_dot(a, b) for b in columns] for a in columns])
        try:
            solution = np.linalg.solve(gram, np.array([_dot(a, t) for a in columns]))
        except np.linalg.LinAlgError:
            return None
    else:
        solution = _gram_schmidt(columns, t)
    result: np.ndarray = solution / scale
    return result if np.isfinite(result).all() else None


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.einsum("i,i->", a, b))


def _gram_schmidt(columns: list[np.ndarray], t: np.ndarray) -> np.ndarray:
    """The least-squares solution of ``columns`` x = ``t`` by modified Gram-Schmidt on the
    columns and ``t`` together, which is backward stable for least squares (Bjorck 1967) as the
    SVD that ``lstsq`` computed was: the second moment's features (v, m^2, m p, p^2) are nearly
    collinear, so normal equations would square their condition number. A column that is
    (numerically) a combination of the ones before it gets coefficient 0, where ``lstsq`` gave
    the minimum-norm solution: both predict alike."""
    k, n = len(columns), len(t)
    q = [c.copy() for c in columns]
    t = t.copy()
    r, z = np.zeros((k, k)), np.zeros(k)
    kept: list[int] = []
    tiny = n * np.finfo(np.float64).eps * max(math.sqrt(_dot(c, c)) for c in columns)
    for j in range(k):
        for i in kept:  # modified: against the columns as already orthogonalized
            r[i, j] = _dot(q[i], q[j])
            q[j] -= r[i, j] * q[i]
        norm = math.sqrt(_dot(q[j], q[j]))
        if not norm > tiny:
            continue
        r[j, j] = norm
        q[j] /= norm
        z[j] = _dot(q[j], t)
        t -= z[j] * q[j]
        kept.append(j)
    x = np.zeros(k)
    for j in reversed(kept):
        x[j] = (z[j] - sum(r[j, i] * x[i] for i in kept if i > j)) / r[j, j]
    return x


def _exact(
    predictor: Predictor, coefficients: tuple[float, ...], bases: list[np.ndarray], target_bits: np.ndarray
) -> int:
    """How many sample elements (bases converted by ``inputs``) ``coefficients`` predict exactly."""
    kernels = _KERNELS[0] if _KERNELS else None
    if kernels is None:
        with np.errstate(all="ignore"):
            bits = to_float32_bits(_FORMULAS[predictor](coefficients, bases))
    else:
        out = np.empty(len(target_bits), dtype=np.float32)
        kernel = (
            kernels.second_moment_converted if predictor == Predictor.ADAM_SECOND_MOMENT else kernels.weight_converted
        )
        kernel(np.array(coefficients, dtype=np.float64), *bases, out)
        bits = out.view(np.uint32)
    return int((bits == target_bits).sum())


def _decimal(c: float) -> float:
    """The shortest decimal within a millionth of ``c`` (relative), else ``c``: optimizer
    settings are short decimals (0.9, 0.999, 1e-3), and a fit only gets near them."""
    for digits in range(1, 9):
        rounded = float(f"{c:.{digits}g}")
        if abs(rounded - c) <= 1e-6 * abs(c):
            return rounded
    return c


def _snapped(k0: float) -> list[float]:
    """Candidates for an outer factor fitted as ``k0``: as fitted, and the reciprocal of the
    forward step's factor taken as the nearest float32 or the nearest short decimal (a fit's
    noise is larger than the last bits need)."""
    out = [k0]
    with np.errstate(all="ignore"):
        for snapped in (1.0 / np.float64(np.float32(1.0 / k0)), 1.0 / _decimal(1.0 / k0)):
            if math.isfinite(snapped) and snapped not in out:
                out.append(float(snapped))
    return out


def _gathered(kernels: Any, chunk: bytes | memoryview, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A chunk's words at ``index`` and the same converted by ``inputs`` (the compiled way)."""
    words = np.frombuffer(chunk, dtype="<u4")
    bits, values = np.empty(index.size, dtype=np.uint32), np.empty(index.size, dtype=np.float64)
    kernels.sample(words, words.view(np.float32), index, bits, values)
    return bits, values


class _Sample:
    """A fit's sample: the bases and the target at evenly spread elements, and the scoring."""

    def __init__(self, predictor: Predictor, target: bytes | memoryview, bases: Sequence[bytes | memoryview]) -> None:
        index = _sample_index(len(target) // 4)
        self.predictor = predictor
        kernels = _KERNELS[0] if _KERNELS else None
        if kernels is not None and all(len(x) == len(target) for x in bases):
            # Gathered and converted in one compiled pass a chunk (numpy's gather, mask, view
            # and cast: 0.7 of a DCP step's 1.5 thread-s of fits).
            self.bits, self.y = _gathered(kernels, target, index)
            self.bases = [_gathered(kernels, x, index)[1] for x in bases]
            return
        self.bits = np.frombuffer(target, dtype="<u4")[index]
        # The sampled elements converted, not the whole chunks (``inputs`` works element by
        # element): converting all four chunks was a third of a hinted fit's CPU.
        self.bases = [inputs(np.frombuffer(x, dtype="<u4")[index]) for x in bases]
        self.y = inputs(self.bits)

    def every(self, step: int) -> _Sample:
        """Every ``step``-th element of this sample."""
        out = _Sample.__new__(_Sample)
        out.predictor, out.bits, out.y = self.predictor, self.bits[::step], self.y[::step]
        out.bases = [np.ascontiguousarray(b[::step]) for b in self.bases]
        return out

    def score(self, candidate: Sequence[float]) -> tuple[int, tuple[float, ...]] | None:
        """(sample elements predicted exactly, the coefficients as a reader accepts them)."""
        coefficients = _rounded(np.array(candidate, dtype=np.float64))
        if coefficients is None:
            return None
        return _exact(self.predictor, coefficients, self.bases, self.bits), coefficients


def _best(scored: Iterable[tuple[int, tuple[float, ...]] | None]) -> tuple[int, tuple[float, ...]] | None:
    found = [s for s in scored if s is not None]
    return max(found, key=lambda s: s[0]) if found else None


def _fit_second_moment(
    sample: _Sample, hint: tuple[int, tuple[float, ...]] | None = None
) -> tuple[int, tuple[float, ...]] | None:
    """``hint``: another chunk's coefficients and their score on this sample, which fell short of
    ``fit_scored``'s slack."""
    # Checkpoints many steps apart: nothing comes out exact on an eighth of the sample, and a fit
    # on all of it is not paid for (a near miss could still beat a plain delta, rarely by much).
    small = _small(sample)
    probe = _fit_second_moment_on(small)
    if probe is None or probe[0] < _HOPELESS * len(small.bits):
        return None
    # A fit on the eighth doing no better there than the hint: a fit on all of it finds the same
    # step's coefficients again (28 of a DCP step's second-moment chunks, ~40 ms each).
    on_small = None if hint is None else small.score(hint[1])
    if hint is not None and on_small is not None and on_small[0] >= probe[0]:
        return hint
    return _best([hint, sample.score(probe[1]), _fit_second_moment_on(sample)])


def _fit_second_moment_on(sample: _Sample) -> tuple[int, tuple[float, ...]] | None:
    v, m, p = sample.bases
    inner = [m * m, m * p, p * p]
    found = _least_squares([v, *inner], sample.y, sample.y)
    if found is None or found[0] == 0:
        return None
    tried = []
    for c0 in _snapped(float(found[0])):
        # Refit the inner terms for this outer factor: y / c0 - v = the gradient term.
        rest = _least_squares(inner, sample.y / c0 - v, sample.y)
        rest = rest if rest is not None else found[1:] / c0
        tried += [sample.score((c0, *rest)), sample.score((c0, *(_decimal(float(c)) for c in rest)))]
    return _best(tried)


def _small(sample: _Sample) -> _Sample:
    """An eighth of the sample for searches and probes (all of a small one)."""
    return sample.every(8) if len(sample.bits) >= 8 * _SEARCH_MIN else sample


def _fit_weight(sample: _Sample) -> tuple[int, tuple[float, ...]] | None:
    """c0 and c1 by least squares for a given c2 (epsilon times a bias correction: tiny next to
    sqrt(v) for most elements, decisive for the rest, and a wrong one makes outliers that pull
    c0 and c1); c2 by search on an eighth of the sample (a geometric grid, then golden-section
    refinement around the best point, each point scored by exact predictions), then the best
    point fitted and scored on the whole sample."""
    small = _small(sample)

    def at(s: _Sample, eps: float) -> tuple[int, tuple[float, ...]] | None:
        w, m, v = s.bases
        q = m / (np.sqrt(v) + eps)
        found = _least_squares([w, q], s.y, s.y)
        if found is None or found[0] == 0:
            return None
        tried = []
        for c0 in _snapped(float(found[0])):
            c1 = _least_squares([q], s.y / c0 - w, s.y)
            tried.append(None if c1 is None else s.score((c0, float(c1[0]), eps)))
        return _best(tried)

    # Checkpoints many steps apart: the weights are no function of the next ones, and nothing
    # comes out exact. Three points tell, before the whole search is paid for.
    probe = _best(at(small, eps) for eps in _EPS_PROBE)
    if probe is None or probe[0] < _HOPELESS * len(small.bits):
        return None
    best = _best([probe, *(at(small, eps) for eps in _EPS_DEFAULTS)])
    if best is not None and best[0] < _GOOD_ENOUGH * len(small.bits):
        best = _best([best, *(at(small, eps) for eps in _EPS_COARSE)])
    if best is not None and best[1][2] != 0.0 and best[0] < _GOOD_ENOUGH * len(small.bits):
        lo, hi = math.log(best[1][2] / _EPS_STEP), math.log(best[1][2] * _EPS_STEP)
        for _ in range(_EPS_REFINE):
            a, b = hi - (hi - lo) / _GOLDEN, lo + (hi - lo) / _GOLDEN
            sa, sb = at(small, math.exp(a)), at(small, math.exp(b))
            best = _best([best, sa, sb])
            if (sa[0] if sa else -1) >= (sb[0] if sb else -1):
                hi = b
            else:
                lo = a
    return None if best is None else _best([at(sample, best[1][2]), sample.score(best[1])])


_EPS_STEP = 4.0
# PyTorch's default epsilon (1e-8) times its bias correction sqrt(1 - 0.999^t) at steps t = 1..16
# (tried first), then a coarse geometric grid for other settings and later steps.
_EPS_DEFAULTS = tuple(1e-8 * math.sqrt(1 - 0.999**t) for t in range(1, 17))
_EPS_COARSE = tuple(1e-6 * _EPS_STEP**-k for k in range(10))
_EPS_REFINE = 6
_SEARCH_MIN = 2048  # elements the epsilon search scores each point on, at least
_GOOD_ENOUGH = 0.97  # of the sample predicted exactly: no refinement of the grid's best
# PyTorch's defaults at every early step are probed, not only the first: where sqrt(v) is as
# small as epsilon (gradients of ~1e-9, as in the DCP benchmark), a step-1 epsilon at step 4
# predicts almost nothing exactly and the right one predicts 85%; probing only three points
# gave up on every weight chunk there.
_EPS_PROBE = (0.0, 1e-8, *_EPS_DEFAULTS)
_HOPELESS = 0.01  # of the sample predicted exactly at every probe: no predicted delta
_GOLDEN = (1 + math.sqrt(5)) / 2


def fit(
    predictor: Predictor,
    target: bytes | memoryview,
    bases: Sequence[bytes | memoryview],
    hint: Sequence[float] | None = None,
) -> tuple[float, ...] | None:
    """Coefficients for predicting ``target`` from ``bases`` (raw float32 chunks of one length),
    fitted on a sample (least squares, then the candidate predicting the most sample elements
    exactly); None when no fit is possible (the caller then keeps a plain delta).

    ``hint``: coefficients that fitted another chunk of the same step (one learning rate, one
    epsilon, one bias correction for all of them); taken as they are when they predict nearly
    all of this sample exactly, which spares the search (~50 ms a 1 MiB weight chunk)."""
    found = fit_scored(predictor, target, bases, None if hint is None else (tuple(hint), 1.0))
    return None if found is None else found[0]


# A hint predicting at most this much less of a chunk's sample exactly than it did of the chunk
# it was fitted on is taken: the search would find the same step's coefficients again.
_HINT_SLACK = 0.02


def fit_scored(
    predictor: Predictor,
    target: bytes | memoryview,
    bases: Sequence[bytes | memoryview],
    hint: tuple[tuple[float, ...], float] | None = None,
) -> tuple[tuple[float, ...], float] | None:
    """``fit``, with the fraction of the sample the coefficients predict exactly; ``hint``: another
    chunk's result of this function. A hint is taken when it predicts nearly all of this sample
    exactly, or nearly as much of it as of its own chunk's: where few elements come out exact at
    all (tiny gradients, where epsilon decides), the search found the same coefficients on every
    chunk of a step at ~250 ms each (a 1 MiB weight chunk; DCP benchmark)."""
    if len(target) < 4 or len(bases) != SHAPES[predictor].bases:
        return None
    sample = _Sample(predictor, target, bases)
    size = len(sample.bits)
    with np.errstate(all="ignore"):
        quick = None if hint is None else sample.score(hint[0])
        if (
            quick is not None
            and hint is not None
            and quick[0] >= min(_GOOD_ENOUGH, hint[1] - _HINT_SLACK) * size
            and quick[0] > 0
        ):
            return quick[1], quick[0] / size
        if predictor == Predictor.ADAM_SECOND_MOMENT:
            best = _fit_second_moment(sample, quick if quick is not None and quick[0] > 0 else None)
        else:
            best = _fit_weight(sample)
    return None if best is None else (best[1], best[0] / size)
