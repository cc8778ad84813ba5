"""Predictions of a float32 chunk from other float32 chunks (pure, no I/O): what a predicted delta
(codec encoding 4, docs/format.md section 4) stores the XOR against.

Between two consecutive AdamW steps every byte of the state changes, but the previous step's
state is almost a function of the current one (``g_t = (m_t - b1 m_{t-1}) / (1 - b1)``):

- ``v_{t-1} = (v_t - (1 - b2) g_t^2) / b2``: ``ADAM_SECOND_MOMENT`` over (v_t, m_t, m_{t-1}),
  ``c0 v + c1 m^2 + c2 m p + c3 p^2`` (the square of the gradient expanded, so the fit is linear);
- ``w_{t-1} = (w_t + lr m^_t / (sqrt(v^_t) + eps)) / (1 - lr wd)``: ``ADAM_WEIGHT`` over
  (w_t, m_t, v_t), ``c0 w + c1 m / (sqrt(v) + c2)`` (bias corrections folded into c1 and c2).

The coefficients are stored in the object, so a reader needs no optimizer settings; the writer
fits them (``fit``). A reader must compute the prediction bit for bit as the writer did, on any
platform and numpy version, so ``predict`` uses only correctly rounded IEEE-754 operations
(+ - * / sqrt) on float64, one numpy ufunc per operation (no fused multiply-add, no libm), in a
fixed order. Nothing it computes can be subnormal (where flush-to-zero modes would differ): float32
subnormal inputs are zeroed by masking their bits, coefficients are 0 or within 2^-64..2^64
(``check_coefficients``), which keeps every nonzero intermediate above 2^-400; a result below the
float32 normal range becomes +0 before rounding to float32, and NaN or infinity (NaN payloads
differ between x86 and ARM) becomes +0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

MIN_COEFFICIENT = 2.0 ** -64
MAX_COEFFICIENT = 2.0 ** 64
_F32_MIN_NORMAL = 2.0 ** -126
_EXPONENT = np.uint32(0x7F800000)
# Elements of a fit's sample, spread over the chunk (a fit costs a least-squares solve on them).
FIT_SAMPLE = 1 << 15
# eps * sqrt(1 - b2^t) for PyTorch's default eps and b2 at a few steps t (and 0): ADAM_WEIGHT's c2
# is tried at each and the one predicting the most elements exactly wins.
_EPS_CANDIDATES = (0.0, *(1e-8 * math.sqrt(1 - 0.999 ** t) for t in (1, 2, 4, 8, 16, 64, 256, 1024)), 1e-8)


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


def inputs(data: bytes | memoryview) -> np.ndarray:
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
    Predictor.ADAM_SECOND_MOMENT: _second_moment, Predictor.ADAM_WEIGHT: _weight,
}


def predict(predictor: Predictor, coefficients: Sequence[float], bases: Sequence[bytes | memoryview]) -> np.ndarray:
    """The prediction as float32 bit patterns (uint32), from the bases' raw little-endian float32
    bytes (all of one length, a multiple of 4)."""
    shape = SHAPES[predictor]
    if len(bases) != shape.bases or len(coefficients) != shape.coefficients:
        raise ValueError(f"predictor {predictor.name} takes {shape.bases} bases and {shape.coefficients} coefficients")
    check_coefficients(coefficients)
    with np.errstate(all="ignore"):
        r = _FORMULAS[predictor]([float(c) for c in coefficients], [inputs(b) for b in bases])
    return to_float32_bits(r)


def _rounded(coefficients: np.ndarray) -> tuple[float, ...] | None:
    """Coefficients a reader accepts: tiny ones become 0; None when one is out of range."""
    out = tuple(0.0 if abs(c) < MIN_COEFFICIENT else float(c) for c in coefficients)
    try:
        check_coefficients(out)
    except ValueError:
        return None
    return out


def _sample_index(n: int) -> np.ndarray:
    return np.linspace(0, n - 1, num=min(n, FIT_SAMPLE), dtype=np.int64)


def _least_squares(features: list[np.ndarray], target: np.ndarray, scale_by: np.ndarray) -> np.ndarray | None:
    """Coefficients minimising the error relative to ``scale_by`` (the predicted chunk: every
    magnitude counts, as bit-exact prediction needs), over the rows where everything is finite
    and ``scale_by`` nonzero."""
    a = np.stack(features, axis=1)
    ok = np.isfinite(a).all(axis=1) & np.isfinite(target) & np.isfinite(scale_by) & (scale_by != 0)
    if ok.sum() < 2 * len(features):
        return None
    weight = 1.0 / np.abs(scale_by[ok])
    a, t = a[ok] * weight[:, None], target[ok] * weight
    scale = np.sqrt((a * a).mean(axis=0))
    scale[scale == 0] = 1.0
    solution, *_ = np.linalg.lstsq(a / scale, t, rcond=None)
    result: np.ndarray = solution / scale
    return result if np.isfinite(result).all() else None


def _exact(predictor: Predictor, coefficients: tuple[float, ...], bases: list[np.ndarray], target_bits: np.ndarray) -> int:
    with np.errstate(all="ignore"):
        bits = to_float32_bits(_FORMULAS[predictor](coefficients, bases))
    return int((bits == target_bits).sum())


def _snapped(k0: float) -> list[float]:
    """The outer factor as fitted, and as the reciprocal of the nearest float32 (the forward step
    multiplied by a float32 factor: snapping removes the fit's noise)."""
    out = [k0]
    with np.errstate(all="ignore"):
        snapped = float(1.0 / np.float64(np.float32(1.0 / k0)))
    if math.isfinite(snapped) and snapped != k0:
        out.append(snapped)
    return out


def fit(predictor: Predictor, target: bytes | memoryview, bases: Sequence[bytes | memoryview]) -> tuple[float, ...] | None:
    """Coefficients for predicting ``target`` from ``bases`` (raw float32 chunks of one length),
    fitted on a sample (least squares, then the candidate predicting the most sample elements
    exactly); None when no fit is possible (the caller then keeps a plain delta)."""
    n = len(target) // 4
    if n == 0 or len(bases) != SHAPES[predictor].bases:
        return None
    index = _sample_index(n)
    target_bits = np.frombuffer(target, dtype="<u4")[index]
    b = [inputs(x)[index] for x in bases]
    y = inputs(target)[index]
    tried: list[tuple[float, ...]] = []
    with np.errstate(all="ignore"):
        if predictor == Predictor.ADAM_SECOND_MOMENT:
            v, m, p = b
            shapes = [([m * m, m * p, p * p], v, ())]
        else:
            w, m, v = b
            shapes = [([m / (np.sqrt(v) + eps)], w, (eps,)) for eps in _EPS_CANDIDATES]
        for inner, first, tail in shapes:
            found = _least_squares([first, *inner], y, y)
            if found is None or found[0] == 0:
                continue
            for c0 in _snapped(float(found[0])):
                # Refit the inner terms for this outer factor: y / c0 - first = sum of inner terms.
                rest = _least_squares(inner, y / c0 - first, y)
                rest = rest if rest is not None else found[1:] / c0
                tried.append((c0, *(float(x) for x in rest), *tail))
    best: tuple[int, tuple[float, ...]] | None = None
    for candidate in tried:
        coefficients = _rounded(np.array(candidate))
        if coefficients is None:
            continue
        score = _exact(predictor, coefficients, b, target_bits)
        if best is None or score > best[0]:
            best = (score, coefficients)
    return None if best is None else best[1]
