"""The body of a predicted delta (encoding 4): a chunk of float32 words stored as their XOR
against the prediction that predict.py computes from up to four base objects (pure, no I/O).

After the object header and the base ids (objects.py frames both, and ``delta_bases`` reads the
ids), the body holds the predictor's number, its coefficients (float64 each) and the residual as
a byte-plane set (planes.py); docs/format.md, section 4. Why: between two optimizer steps every
byte changes, but the previous step's weights and second moment are almost a function of the
current state (predict.py), so the residual is mostly zeros.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckstore.codecs.deltas import BASE_ID_SIZE, BaseFetcher
from ckstore.codecs.planes import (
    decode_grouped,
    decode_plane,
    grouped_parts,
    plane_compressor,
    plane_piece,
    plane_set,
    plane_table,
)
from ckstore.errors import IntegrityError

if TYPE_CHECKING:
    import numpy as np  # imported where used: commands that decode no chunk start without numpy

_COEFFICIENT = struct.Struct("<d")
PREDICTED_WIDTH = 4  # float32 elements only


@dataclass(frozen=True)
class PredictionInputs:
    """What a predicted delta as stored predicts from: its bases, predictor and coefficients."""

    base_ids: tuple[str, ...]
    predictor: int
    coefficients: tuple[float, ...]

    def same_prediction(self, base_ids: tuple[str, ...], predictor: int, coefficients: tuple[float, ...]) -> bool:
        """Whether these are exactly the prediction's inputs (coefficients bit for bit: -0.0 is
        not 0.0 to the prediction's arithmetic)."""
        pack = struct.Struct(f"<{len(coefficients)}d").pack
        return (
            self.base_ids == tuple(base_ids)
            and self.predictor == predictor
            and len(self.coefficients) == len(coefficients)
            and pack(*self.coefficients) == pack(*coefficients)
        )


@dataclass(frozen=True)
class PredictedParts(PredictionInputs):
    """A predicted delta as stored: what its decoding predicts from, and its residual decoded.
    Decoding it is ``residual XOR predict(predictor, coefficients, the bases' bytes)``, nothing
    else (``decode``)."""

    residual: np.ndarray  # uint8, the raw length


def encode(
    raw: bytes | memoryview, level: int, inputs: PredictionInputs, bases: list[bytes], guess: np.ndarray | None
) -> tuple[int, list[bytes | memoryview]] | None:
    """The body of ``raw`` (float32 elements) predicted from ``bases`` (the bytes of
    ``inputs.base_ids``): its size and its pieces; None when ``raw`` and ``bases`` cannot make
    one. ``guess``: the prediction, when the caller computed it already."""
    import numpy as np

    from ckstore.codecs import predict

    base_ids, predictor, coefficients = inputs.base_ids, inputs.predictor, inputs.coefficients
    if not raw or len(raw) % PREDICTED_WIDTH or any(len(b) != len(raw) for b in bases) or len(bases) != len(base_ids):
        return None
    if guess is None:
        guess = predict.predict(predict.Predictor(predictor), coefficients, bases)
    kernels = predict.loaded_compiled()
    if kernels is not None:  # the XOR and the split into planes in one compiled pass
        planes = np.empty((PREDICTED_WIDTH, len(raw) // PREDICTED_WIDTH), dtype=np.uint8)
        kernels.residual_planes(np.frombuffer(raw, dtype="<u4"), guess, planes)
        zstd = plane_compressor(level)
        size, parts = plane_set(PREDICTED_WIDTH, [plane_piece(plane, zstd) for plane in planes])
    else:
        residual = np.bitwise_xor(np.frombuffer(raw, dtype="<u4"), guess).view(np.uint8)
        size, parts = grouped_parts(residual, PREDICTED_WIDTH, level)
    prefix = b"".join(
        [
            bytes([len(base_ids)]),
            *(bytes.fromhex(b) for b in base_ids),
            bytes([predictor]),
            *(_COEFFICIENT.pack(c) for c in coefficients),
        ]
    )
    return len(prefix) + size, [prefix, *parts]


def read_inputs(body: memoryview, base_ids: tuple[str, ...]) -> tuple[PredictionInputs, memoryview]:
    """Parse and check the predictor and coefficients of ``body`` (everything after the header),
    whose ``base_ids`` its header named; they and the residual's plane set. IntegrityError when
    malformed."""
    from ckstore.codecs import predict

    at = 1 + len(base_ids) * BASE_ID_SIZE
    if len(body) < at + 1:
        raise IntegrityError("predicted delta body is too short")
    number = body[at]
    if number not in predict.Predictor._value2member_map_:
        raise IntegrityError(f"unknown predictor {number}")
    predictor = predict.Predictor(number)
    shape = predict.SHAPES[predictor]
    if len(base_ids) != shape.bases:
        raise IntegrityError(f"predictor {number} takes {shape.bases} bases, the object names {len(base_ids)}")
    at += 1
    if len(body) < at + shape.coefficients * _COEFFICIENT.size:
        raise IntegrityError("predicted delta body is too short for its coefficients")
    coefficients = tuple(
        _COEFFICIENT.unpack_from(body, at + i * _COEFFICIENT.size)[0] for i in range(shape.coefficients)
    )
    try:
        predict.check_coefficients(coefficients)
    except ValueError as exc:
        raise IntegrityError(str(exc)) from None
    return PredictionInputs(tuple(base_ids), predictor, coefficients), body[
        at + shape.coefficients * _COEFFICIENT.size :
    ]


def _not_float32(raw_len: int, residual: memoryview) -> IntegrityError | None:
    if raw_len % PREDICTED_WIDTH or residual[0] != PREDICTED_WIDTH:
        return IntegrityError("predicted delta residual is not of float32 elements")
    return None


def parts(
    inputs: PredictionInputs, residual: memoryview, raw_len: int, out: np.ndarray | None = None
) -> PredictedParts:
    """``inputs`` and the ``residual`` plane set (``read_inputs``) decoded, into ``out`` when
    given; IntegrityError when malformed."""
    decoded = decode_grouped(residual, raw_len, out)
    error = _not_float32(raw_len, residual)
    if error is not None:
        raise error
    return PredictedParts(inputs.base_ids, inputs.predictor, inputs.coefficients, decoded)


def decodes_to(inputs: PredictionInputs, residual: memoryview, raw: bytes, guess: np.ndarray) -> bool:
    """Whether the ``residual`` plane set XOR ``guess`` (uint32 words) is ``raw``, after every
    check of the planes that decoding makes.

    Where the prediction kernels are loaded, the decoded planes are joined, XORed and compared
    with ``raw`` in one compiled pass (predict_kernels.residual_matches), not joined into a new
    array first and then XORed and compared in two numpy passes (0.35 against 0.29 ms a 1 MiB
    chunk of the DCP benchmark, decompressing the planes included)."""
    import numpy as np

    from ckstore.codecs import predict

    kernels = predict.loaded_compiled()
    if kernels is None:
        decoded = np.bitwise_xor(parts(inputs, residual, len(raw)).residual.view("<u4"), guess)
        return bool(np.array_equal(decoded, np.frombuffer(raw, dtype="<u4")))
    width, entries = plane_table(residual, len(raw))  # the plane set's own checks, as decode_grouped's
    n = len(raw) // width
    planes = [np.frombuffer(decode_plane(i, mode, frame, n), dtype=np.uint8) for i, (mode, frame) in enumerate(entries)]
    error = _not_float32(len(raw), residual)
    if error is not None:
        raise error
    words = np.frombuffer(raw, dtype="<u4")
    return guess.shape == words.shape and bool(kernels.residual_matches(*planes, guess, words))


def decode(found: PredictedParts, raw_len: int, fetch_base: BaseFetcher | None) -> memoryview:
    """The chunk ``found`` (``parts``) decodes to, its bases from ``fetch_base``: in place, in
    its residual's array."""
    import numpy as np

    from ckstore.codecs import predict

    if fetch_base is None:
        raise IntegrityError("delta object read without access to its base")
    bases = []
    for base_id in found.base_ids:
        base = fetch_base(base_id, raw_len)
        if len(base) != raw_len:
            raise IntegrityError(f"delta base decoded to {len(base)} bytes, expected {raw_len}")
        bases.append(base)
    guess = predict.predict(predict.Predictor(found.predictor), found.coefficients, bases)
    residual = found.residual
    np.bitwise_xor(residual.view("<u4"), guess, out=residual.view("<u4"))
    return residual.data
