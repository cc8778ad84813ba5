"""Stored-object encoding: the bytes of one file in the object directory (pure, no I/O).

Every stored object is a 16-byte header followed by an encoding-specific body:

    0  4  magic  b"CKSO"
    4  1  object format version (1)
    5  1  kind      1 = chunk, 2 = commit manifest
    6  1  encoding  0 = raw, 1 = zstd, 2 = byte-grouped, 3 = delta, 4 = predicted delta,
                    5 = context-sorted delta (docs/format.md, section 4)
    7  1  reserved, 0
    8  8  raw length, unsigned little-endian: the length of the decoded bytes

The object's *name* never depends on the encoding (it is the hash of the decoded bytes), so an
object can be re-encoded in place and dedup keeps working. Decoding is bounded: the raw length in
the header must equal what the caller expects (from the manifest) before anything is allocated,
every zstd frame must declare exactly the size its place in the body implies, and trailing bytes
are refused. A delta names its base object (a predicted delta several); the caller supplies a
callback that returns a base's verified raw bytes, so this module never does I/O and the caller
bounds the chain.

This module frames objects, chooses a chunk's encoding and dispatches decoding; the bodies are
in planes.py (byte planes: why they compress), deltas.py (plain and context-sorted deltas) and
predicted.py (predicted deltas, whose arithmetic is predict.py's).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

from ckstore.codecs import context, predicted
from ckstore.codecs.deltas import (
    BASE_ID_SIZE,
    DELTA,
    INT_DTYPES,
    BaseFetcher,
    DeltaOp,
    context_parts,
    decode_delta,
    delta_residual,
)
from ckstore.codecs.planes import (
    MAX_WIDTH,
    PLANE,
    Parts,
    PlaneMode,
    compressor,
    decode_grouped,
    decode_zstd,
    grouped_parts,
)
from ckstore.codecs.predicted import PredictedParts, PredictionInputs
from ckstore.errors import IntegrityError

if TYPE_CHECKING:
    import numpy as np  # imported where used: commands that decode no chunk start without numpy

MAGIC = b"CKSO"
OBJECT_VERSION = 1
HEADER = struct.Struct("<4sBBBBQ")
HEADER_SIZE = HEADER.size
# A decoder never needs a window larger than this; a frame asking for more is hostile.
MAX_BASES = 4  # bases a predicted delta may name
# Enough of any object to name all its bases: gc, fsck and fetch follow bases by reading this much.
BASES_PREFIX_SIZE = HEADER_SIZE + 1 + MAX_BASES * BASE_ID_SIZE
# Chunks at most this long are encoded with every candidate; longer ones are ranked on a sample.
EXHAUSTIVE_MAX = 1 << 18
_SAMPLE_WINDOWS = 8
_SAMPLE_WINDOW = 1 << 14


class Kind(IntEnum):
    CHUNK = 1
    COMMIT = 2


class Encoding(IntEnum):
    RAW = 0
    ZSTD = 1
    GROUPED = 2
    DELTA = 3
    PREDICTED = 4
    CONTEXT = 5  # context.py


# Encodings a repository of each format version may contain (version 1 knew only raw and zstd;
# version 3 changed link files, not objects; version 4 added the predicted delta, 5 changed packs,
# 6 added the context-sorted delta).
_PLAIN = frozenset(Encoding) - {Encoding.PREDICTED, Encoding.CONTEXT}
_PREDICTED = _PLAIN | {Encoding.PREDICTED}
ENCODINGS_BY_REPO_VERSION = {
    1: frozenset({Encoding.RAW, Encoding.ZSTD}),
    2: _PLAIN,
    3: _PLAIN,
    4: _PREDICTED,
    5: _PREDICTED,
    6: frozenset(Encoding),
}
# Encodings only compaction and repack write (slower to encode; the training loop never waits).
OFF_LOOP = frozenset({Encoding.CONTEXT})
_DELTAS = (Encoding.DELTA, Encoding.CONTEXT)  # one base id and an operation, then a plane set


@dataclass(frozen=True)
class ObjectHeader:
    kind: Kind
    encoding: Encoding
    raw_len: int


def pack_header(kind: Kind, encoding: Encoding, raw_len: int) -> bytes:
    return HEADER.pack(MAGIC, OBJECT_VERSION, kind, encoding, 0, raw_len)


def parse_header(data: bytes | memoryview) -> ObjectHeader:
    """Read and check the fixed header; raises IntegrityError on anything unexpected."""
    if len(data) < HEADER_SIZE:
        raise IntegrityError(f"object is {len(data)} bytes, shorter than its {HEADER_SIZE}-byte header")
    magic, version, kind, encoding, reserved, raw_len = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise IntegrityError("object does not start with the ckstore magic bytes")
    if version != OBJECT_VERSION:
        raise IntegrityError(f"unknown object version {version}")
    if kind not in Kind._value2member_map_:
        raise IntegrityError(f"unknown object kind {kind}")
    if encoding not in Encoding._value2member_map_:
        raise IntegrityError(f"unknown object encoding {encoding}")
    if reserved != 0:
        raise IntegrityError("reserved header byte is not zero")
    return ObjectHeader(Kind(kind), Encoding(encoding), raw_len)


def delta_bases(data: bytes | memoryview) -> tuple[str, ...]:
    """The base object ids a stored object depends on (empty unless it is a delta), in order.

    Needs only the first ``BASES_PREFIX_SIZE`` bytes, so gc and fsck can follow bases without
    decoding anything.
    """
    header = parse_header(data)
    if header.encoding in _DELTAS:
        if len(data) < HEADER_SIZE + BASE_ID_SIZE:
            raise IntegrityError("delta object is too short to name its base")
        return (bytes(data[HEADER_SIZE : HEADER_SIZE + BASE_ID_SIZE]).hex(),)
    if header.encoding != Encoding.PREDICTED:
        return ()
    count = data[HEADER_SIZE] if len(data) > HEADER_SIZE else 0
    if not 1 <= count <= MAX_BASES:
        raise IntegrityError(f"predicted delta names {count} bases (1 to {MAX_BASES} allowed)")
    start = HEADER_SIZE + 1
    if len(data) < start + count * BASE_ID_SIZE:
        raise IntegrityError("predicted delta is too short to name its bases")
    return tuple(bytes(data[start + i * BASE_ID_SIZE : start + (i + 1) * BASE_ID_SIZE]).hex() for i in range(count))


# ---- encoding ---------------------------------------------------------------------------------


def _raw_object(kind: Kind, raw: bytes | memoryview) -> bytes:
    return b"".join((pack_header(kind, Encoding.RAW, len(raw)), raw))  # one copy of raw, not two


def encode(raw: bytes | memoryview, kind: Kind, level: int) -> bytes:
    """Encode raw bytes as zstd, or raw when zstd would not make the object smaller."""
    compressed = compressor(level).compress(raw)
    if len(compressed) < len(raw):
        return pack_header(kind, Encoding.ZSTD, len(raw)) + compressed
    return _raw_object(kind, raw)


# The fast (commit-time) encoding compresses a sample before the whole chunk. At the fast level,
# fp32 weights and an Adam first moment that is not zero do not compress (0.98-1.0 of their
# size) and zstd spends as long failing on them as succeeding (1.2-1.5 ms/MiB), while the chunks
# that do compress are mostly zeros or small exponents throughout. Measured on the real MiniLM
# fp32 epoch (model + AdamW, 1 MiB chunks): 0.556 -> 0.276 CPU ms/MiB, stored 0.8326 -> 0.8326.
SAMPLE_BYTES = 1 << 16
SAMPLE_MIN_SAVING = 0.02  # a sample that saves less than this: the chunk is stored raw


def encode_sampled(raw: bytes | memoryview, kind: Kind, level: int) -> bytes:
    """``encode``, but a chunk whose first ``SAMPLE_BYTES`` do not compress is stored raw without
    compressing the rest (both decode alike: only the stored size can differ)."""
    if len(raw) >= 4 * SAMPLE_BYTES:
        sample = compressor(level).compress(memoryview(raw)[:SAMPLE_BYTES])
        if len(sample) >= (1 - SAMPLE_MIN_SAVING) * SAMPLE_BYTES:
            return _raw_object(kind, raw)
    return encode(raw, kind, level)


def _sample(raw: bytes | memoryview, width: int) -> bytes:
    """Evenly spread windows of a long chunk, aligned to the element width (for ranking)."""
    n = len(raw)
    step = n // _SAMPLE_WINDOWS
    window = _SAMPLE_WINDOW - _SAMPLE_WINDOW % width
    view = memoryview(raw)
    return b"".join(view[(i * step) - (i * step) % width :][:window] for i in range(_SAMPLE_WINDOWS))


@dataclass(frozen=True)
class Candidate:
    encoding: Encoding
    op: DeltaOp | None = None


def candidates(
    length: int,
    width: int,
    has_base: bool,
    allowed: frozenset[Encoding],
    prune: bool = False,
) -> list[Candidate]:
    """Encodings worth trying for a chunk of ``length`` bytes of elements ``width`` bytes wide.

    ``prune`` drops, for multi-byte elements, the candidates that measurement showed never win
    by anything that matters (scripts/bench.py, "choosing the encoding"): plain zstd when byte
    grouping applies (it beat grouping on 1 of 171 model chunks of the fp32 run, by 78 bytes),
    and the XOR delta when the zigzag difference applies (it never beat both the difference and
    storing the chunk whole on the fp32, frozen or bf16 runs).
    """
    out = [Candidate(Encoding.ZSTD)] if Encoding.ZSTD in allowed else []
    aligned = width >= 1 and length % width == 0
    if aligned and width > 1 and Encoding.GROUPED in allowed:
        out.append(Candidate(Encoding.GROUPED))
        if prune:
            out = [c for c in out if c.encoding != Encoding.ZSTD]
    if aligned and has_base and Encoding.DELTA in allowed:
        if not (prune and width > 1 and width in INT_DTYPES):
            out.append(Candidate(Encoding.DELTA, DeltaOp.XOR))
        if width in INT_DTYPES:
            out.append(Candidate(Encoding.DELTA, DeltaOp.SUB))
    if aligned and has_base and Encoding.CONTEXT in allowed and width in context.WIDTHS:
        # The same residuals, each plane sorted by its context (context.py); the XOR residual is
        # pruned for the same reason as above.
        out += [
            Candidate(Encoding.CONTEXT, op) for op in (DeltaOp.XOR, DeltaOp.SUB) if not (prune and op == DeltaOp.XOR)
        ]
    return out


def _body(
    raw: bytes | memoryview,
    c: Candidate,
    width: int,
    level: int,
    base: bytes | memoryview | None,
) -> tuple[int, Parts]:
    if c.encoding == Encoding.ZSTD:
        packed = compressor(level).compress(raw)
        return len(packed), [packed]
    if c.encoding == Encoding.GROUPED:
        return grouped_parts(raw, width, level)
    assert base is not None and c.op is not None
    residual = delta_residual(raw, base, width, c.op)
    if c.encoding == Encoding.CONTEXT:
        return context_parts(residual, base, width, level)[:2]
    return grouped_parts(residual, width, level)


def encode_chunk(
    raw: bytes | memoryview,
    level: int,
    width: int = 1,
    base_id: str | None = None,
    base: bytes | memoryview | None = None,
    allowed: frozenset[Encoding] = frozenset(Encoding) - OFF_LOOP,
    exhaustive: bool = False,
    ops: tuple[DeltaOp, ...] = (DeltaOp.XOR, DeltaOp.SUB),
) -> bytes:
    """Encode a chunk with the smallest of the allowed encodings; never more than raw + header.

    ``width`` is the element width of the tensor's dtype (1 for headers and plain files).
    ``base`` is the raw bytes of ``base_id`` (the same chunk in the parent commit), offered as a
    delta base when it has the same length. Candidates that measurement showed cannot win are
    skipped (``candidates(prune=True)``) and long chunks are ranked by encoding a sample of
    evenly spread windows; ``exhaustive`` encodes every candidate in full instead, and
    scripts/bench.py measures how close the two choices are.
    """
    if not 1 <= width <= MAX_WIDTH:
        raise ValueError(f"element width {width} out of range")
    usable = base is not None and base_id is not None and len(base) == len(raw) and len(raw) > 0
    found = [
        c for c in candidates(len(raw), width, usable, allowed, prune=not exhaustive) if c.op is None or c.op in ops
    ]
    if not found:
        return _raw_object(Kind.CHUNK, raw)
    if len(found) > 1 and not exhaustive and len(raw) > EXHAUSTIVE_MAX:
        sample = _sample(raw, width)
        base_sample = _sample(base, width) if usable and base is not None else None
        assert base_sample is None or len(base_sample) == len(sample)
        found = [min(found, key=lambda c: _body(sample, c, width, level, base_sample)[0])]
    best: tuple[int, Parts, Candidate] | None = None
    for c in found:
        size, parts = _body(raw, c, width, level, base)
        if best is None or size < best[0]:
            best = (size, parts, c)
    assert best is not None
    size, parts, chosen = best
    if chosen.encoding == Encoding.CONTEXT and not any(
        PLANE.unpack(parts[1 + i])[0] & PlaneMode.SORTED for i in range(width)
    ):
        chosen = Candidate(Encoding.DELTA, chosen.op)  # no plane sorted: the same bytes as a plain delta
    prefix = b""
    if chosen.encoding in _DELTAS:
        assert base_id is not None and chosen.op is not None
        prefix = DELTA.pack(bytes.fromhex(base_id), chosen.op)
    if len(prefix) + size >= len(raw):
        return _raw_object(Kind.CHUNK, raw)
    return b"".join([pack_header(Kind.CHUNK, chosen.encoding, len(raw)), prefix, *parts])


def encode_delta(
    raw: bytes | memoryview,
    level: int,
    width: int,
    base_id: str,
    base: bytes | memoryview,
    than: int,
    allowed: frozenset[Encoding] = frozenset({Encoding.DELTA}),
    sample_test: bool = True,
) -> bytes | None:
    """The best delta encoding of ``raw`` against ``base`` (a plain delta, or a context-sorted one
    when ``allowed``) if it stores in fewer than ``than`` bytes (the chunk's current encoding),
    else None.

    Deltas that cannot pay are common (AdamW's first moment changes too much between epochs:
    269 of 439 optimizer chunks of the fp32 run), so a long chunk is first tried on the sample
    used for ranking: when the delta there is not at least 3% smaller than the chunk grouped
    whole, or not smaller (by the sample's ratio) than ``than``, the full encode is skipped.
    ``sample_test=False`` skips that test (a caller that knows a delta paid at this place last
    time against the chunk's whole encoding: the test would pass, at a quarter of a full encode).
    """
    if len(base) != len(raw) or not raw:
        return None
    kinds = allowed & set(_DELTAS)
    found = candidates(len(raw), width, True, kinds, prune=True)
    if not found:
        return None
    long = len(raw) > EXHAUSTIVE_MAX
    test = long and sample_test
    if test or len(found) > 1:
        sample, base_sample = (_sample(raw, width), _sample(base, width)) if long else (raw, base)
        sized = [(_body(sample, c, width, level, base_sample)[0], c) for c in found]
        size, best = min(sized, key=lambda x: x[0])
        if test:
            whole = grouped_parts(sample, width, level)[0] if width > 1 else len(compressor(level).compress(sample))
            # ``than`` may be another delta's size (a predicted delta, about half a plain one's in
            # the DCP benchmark): a sample that does not beat it by ratio leaves it standing.
            if size >= 0.97 * min(whole, len(sample)) or size * len(raw) >= than * len(sample):
                return None
        found = [best]
    data = encode_chunk(
        raw,
        level,
        width,
        base_id,
        base,
        allowed=frozenset(c.encoding for c in found),
        ops=tuple(c.op for c in found if c.op is not None),
    )
    return data if len(data) < than and parse_header(data).encoding in kinds else None


def encode_predicted(
    raw: bytes | memoryview,
    level: int,
    base_ids: tuple[str, ...],
    bases: list[bytes],
    predictor: int,
    coefficients: tuple[float, ...],
    than: int,
    guess: np.ndarray | None = None,
) -> bytes | None:
    """``raw`` (float32 elements) as the XOR against the prediction ``predictor`` computes from
    ``bases`` with ``coefficients`` (predict.py), if that stores in fewer than ``than`` bytes.
    ``guess``: that prediction, when the caller computed it already (to check the object with:
    ``PredictedParts``)."""
    body = predicted.encode(raw, level, PredictionInputs(base_ids, predictor, coefficients), bases, guess)
    if body is None or HEADER_SIZE + body[0] >= than:
        return None
    return b"".join([pack_header(Kind.CHUNK, Encoding.PREDICTED, len(raw)), *body[1]])


# ---- decoding ---------------------------------------------------------------------------------


def decode_view(
    data: bytes | memoryview,
    kind: Kind,
    max_len: int,
    expected_len: int | None = None,
    fetch_base: BaseFetcher | None = None,
    out: np.ndarray | None = None,
) -> bytes | memoryview:
    """Decode a stored object of the given kind, refusing more than ``max_len`` decoded bytes.

    ``expected_len`` (from the manifest) must match the header exactly when given. A delta's base
    comes from ``fetch_base`` (verified raw bytes; the caller bounds the chain depth). Raises
    IntegrityError for every malformed input; hash verification is the caller's job (it knows
    the name). A byte-grouped or delta chunk comes back as a view of the array it was decoded
    into, not copied into bytes: a caller that only hashes or writes it saves a copy of every
    chunk (about as much CPU as interleaving the planes). Such a chunk is decoded into ``out``
    when given (a uint8 array of the raw length the caller reuses: a delta chain's bases), else
    into a new array. A raw chunk, when ``out`` is given, comes back as a view of ``data``.
    """
    header = parse_header(data)
    if header.kind != kind:
        raise IntegrityError(f"object is a {header.kind.name.lower()}, expected a {kind.name.lower()}")
    if expected_len is not None and header.raw_len != expected_len:
        raise IntegrityError(f"object holds {header.raw_len} bytes, the manifest says {expected_len}")
    if header.raw_len > max_len:
        raise IntegrityError(f"object declares {header.raw_len} bytes, more than the limit {max_len}")
    body = memoryview(data)[HEADER_SIZE:]
    if header.encoding == Encoding.RAW:
        if len(body) != header.raw_len:
            raise IntegrityError(f"raw object body is {len(body)} bytes, header says {header.raw_len}")
        # A caller that offers ``out`` writes or copies the result on (checkout, load_state):
        # the body itself, not a copy of it in bytes first (a third of load_state's copies).
        return body if out is not None else bytes(body)
    if header.encoding == Encoding.ZSTD:
        return decode_zstd(body, header.raw_len)
    if kind != Kind.CHUNK:
        raise IntegrityError(f"a {kind.name.lower()} cannot use the {header.encoding.name.lower()} encoding")
    if header.encoding == Encoding.GROUPED:
        return decode_grouped(body, header.raw_len, out).data
    if header.encoding == Encoding.PREDICTED:
        return predicted.decode(predicted_parts(data, header.raw_len, out), header.raw_len, fetch_base)
    return decode_delta(body, header.raw_len, fetch_base, out, header.encoding == Encoding.CONTEXT)


def decode(
    data: bytes | memoryview,
    kind: Kind,
    max_len: int,
    expected_len: int | None = None,
    fetch_base: BaseFetcher | None = None,
) -> bytes:
    """``decode_view`` as bytes (one more copy of a byte-grouped or delta chunk)."""
    out = decode_view(data, kind, max_len, expected_len, fetch_base)
    return out if isinstance(out, bytes) else out.tobytes()


def _predicted_inputs(data: bytes | memoryview, raw_len: int) -> tuple[PredictionInputs, memoryview]:
    """Check a predicted delta object's header and parse its inputs (predicted.py); they and its
    residual's plane set. IntegrityError when malformed."""
    header = parse_header(data)
    if header.kind != Kind.CHUNK or header.encoding != Encoding.PREDICTED or header.raw_len != raw_len:
        raise IntegrityError("not a predicted delta chunk of the expected length")
    return predicted.read_inputs(memoryview(data)[HEADER_SIZE:], delta_bases(data))


def predicted_parts(data: bytes | memoryview, raw_len: int, out: np.ndarray | None = None) -> PredictedParts:
    """Parse and check a predicted delta object (encoding 4) of ``raw_len`` bytes, and decode its
    residual (into ``out`` when given); IntegrityError when malformed."""
    return predicted.parts(*_predicted_inputs(data, raw_len), raw_len, out)


def predicted_decodes_to(data: bytes | memoryview, raw: bytes, guess: np.ndarray) -> tuple[PredictionInputs, bool]:
    """``predicted_parts`` of ``data`` (every check of its header, inputs and residual planes
    that decoding makes), and whether its residual XOR ``guess`` (uint32 words) is ``raw``: what
    the object decodes to when ``guess`` is the prediction of the returned inputs, which the
    caller compares (compaction's check of a new object, encoding.py)."""
    inputs, residual = _predicted_inputs(data, len(raw))
    return inputs, predicted.decodes_to(inputs, residual, raw, guess)
