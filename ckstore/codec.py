"""Stored-object encoding: the bytes of one file in the object directory (pure, no I/O).

Every stored object is a 16-byte header followed by an encoding-specific body:

    0  4  magic  b"CKSO"
    4  1  object format version (1)
    5  1  kind      1 = chunk, 2 = commit manifest
    6  1  encoding  0 = raw, 1 = zstd, 2 = byte-grouped, 3 = delta   (docs/format.md, section 4)
    7  1  reserved, 0
    8  8  raw length, unsigned little-endian: the length of the decoded bytes

The object's *name* never depends on the encoding (it is the hash of the decoded bytes), so an
object can be re-encoded in place and dedup keeps working. Decoding is bounded: the raw length in
the header must equal what the caller expects (from the manifest) before anything is allocated,
every zstd frame must declare exactly the size its place in the body implies, and trailing bytes
are refused. A delta names its base object; the caller supplies a callback that returns the
base's verified raw bytes, so this module never does I/O and the caller bounds the chain.

Why byte planes: a float's sign/exponent byte is highly repetitive across a tensor while its low
mantissa bytes are close to random; interleaved, zstd finds little, split into planes it
compresses the repetitive planes well and stores the random ones raw. Why deltas: between two
epochs most weights move by a few ulps, so XOR (or the integer difference) against the previous
epoch's chunk zeroes the high planes almost entirely.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import zstandard

from .errors import IntegrityError

MAGIC = b"CKSO"
OBJECT_VERSION = 1
HEADER = struct.Struct("<4sBBBBQ")
HEADER_SIZE = HEADER.size
# A decoder never needs a window larger than this; a frame asking for more is hostile.
MAX_WINDOW = 1 << 27
MAX_WIDTH = 8
BASE_ID_SIZE = 32
_PLANE = struct.Struct("<BI")  # plane mode, stored length
_DELTA = struct.Struct(f"<{BASE_ID_SIZE}sB")  # base id (binary), delta operation
# Chunks at most this long are encoded with every candidate; longer ones are ranked on a sample.
EXHAUSTIVE_MAX = 1 << 18
_SAMPLE_WINDOWS = 8
_SAMPLE_WINDOW = 1 << 14

BaseFetcher = Callable[[str, int], bytes]  # (base id hex, raw length) -> verified raw bytes


class Kind(IntEnum):
    CHUNK = 1
    COMMIT = 2


class Encoding(IntEnum):
    RAW = 0
    ZSTD = 1
    GROUPED = 2
    DELTA = 3


class PlaneMode(IntEnum):
    RAW = 0
    ZSTD = 1


class DeltaOp(IntEnum):
    XOR = 1
    # Zigzag of the element-wise difference: d = (raw - base) modulo 2^(8 * width) read as a signed
    # little-endian integer, stored as (d << 1) ^ (d >> (8 * width - 1)). Zigzag keeps a small
    # negative difference small (-1 -> 1, not 0xFF..FF), so the high planes stay zero: measured
    # 0.55 of raw against 0.62 for the plain difference and 0.58 for XOR on a dense fp32 layer.
    SUB = 2


# Encodings a repository of each format version may contain (version 1 knew only raw and zstd).
ENCODINGS_BY_REPO_VERSION = {1: frozenset({Encoding.RAW, Encoding.ZSTD}), 2: frozenset(Encoding)}
_INT_DTYPES = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}
_SIGNED_DTYPES = {1: np.dtype("<i1"), 2: np.dtype("<i2"), 4: np.dtype("<i4"), 8: np.dtype("<i8")}


@dataclass(frozen=True)
class ObjectHeader:
    kind: Kind
    encoding: Encoding
    raw_len: int


def _pack_header(kind: Kind, encoding: Encoding, raw_len: int) -> bytes:
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


def delta_base(data: bytes | memoryview) -> str | None:
    """The base object id a stored object depends on (None unless it is a delta).

    Needs only the first ``HEADER_SIZE + BASE_ID_SIZE`` bytes, so gc and fsck can follow bases
    without decoding anything.
    """
    header = parse_header(data)
    if header.encoding != Encoding.DELTA:
        return None
    if len(data) < HEADER_SIZE + BASE_ID_SIZE:
        raise IntegrityError("delta object is too short to name its base")
    return bytes(data[HEADER_SIZE:HEADER_SIZE + BASE_ID_SIZE]).hex()


# ---- encoding ---------------------------------------------------------------------------------


def encode(raw: bytes | memoryview, kind: Kind, level: int) -> bytes:
    """Encode raw bytes as zstd, or raw when zstd would not make the object smaller."""
    compressed = zstandard.ZstdCompressor(level=level, write_content_size=True).compress(raw)
    if len(compressed) < len(raw):
        return _pack_header(kind, Encoding.ZSTD, len(raw)) + compressed
    return _pack_header(kind, Encoding.RAW, len(raw)) + bytes(raw)


def _planes(raw: bytes | memoryview | np.ndarray, width: int) -> np.ndarray:
    """Shape (width, n): plane i holds byte i (little-endian order) of every element."""
    return np.frombuffer(raw, dtype=np.uint8).reshape(-1, width).T.copy()


def _grouped_body(raw: bytes | memoryview | np.ndarray, width: int, level: int) -> bytes:
    planes = _planes(raw, width)
    compressor = zstandard.ZstdCompressor(level=level, write_content_size=True)
    table, stored = [], []
    for plane in planes:
        data = plane.tobytes()
        packed = compressor.compress(data)
        # Low mantissa planes are close to random: storing them raw saves the frame overhead
        # and makes decoding them a copy.
        if len(packed) < len(data):
            table.append(_PLANE.pack(PlaneMode.ZSTD, len(packed)))
            stored.append(packed)
        else:
            table.append(_PLANE.pack(PlaneMode.RAW, len(data)))
            stored.append(data)
    return bytes([width]) + b"".join(table) + b"".join(stored)


def delta_residual(raw: bytes | memoryview, base: bytes | memoryview, width: int, op: DeltaOp) -> np.ndarray:
    """What a delta stores: raw XOR base, or raw - base element-wise (as bytes)."""
    if op == DeltaOp.XOR:
        return np.bitwise_xor(np.frombuffer(raw, np.uint8), np.frombuffer(base, np.uint8))
    dt = _INT_DTYPES[width]
    diff = np.subtract(np.frombuffer(raw, dt), np.frombuffer(base, dt)).view(_SIGNED_DTYPES[width])
    return ((diff << 1) ^ (diff >> (8 * width - 1))).view(np.uint8)


def _undo_residual(residual: np.ndarray, base: bytes, width: int, op: DeltaOp) -> bytes:
    if op == DeltaOp.XOR:
        return np.bitwise_xor(residual, np.frombuffer(base, np.uint8)).tobytes()
    dt = _INT_DTYPES[width]
    zigzag = residual.view(dt)
    diff = (zigzag >> 1) ^ np.negative(zigzag & 1)  # unsigned arithmetic wraps, as intended
    return np.add(diff, np.frombuffer(base, dt)).tobytes()


def _sample(raw: bytes | memoryview, width: int) -> bytes:
    """Evenly spread windows of a long chunk, aligned to the element width (for ranking)."""
    n = len(raw)
    step = n // _SAMPLE_WINDOWS
    window = _SAMPLE_WINDOW - _SAMPLE_WINDOW % width
    view = memoryview(raw)
    return b"".join(view[(i * step) - (i * step) % width:][:window] for i in range(_SAMPLE_WINDOWS))


@dataclass(frozen=True)
class Candidate:
    encoding: Encoding
    op: DeltaOp | None = None


def candidates(length: int, width: int, has_base: bool, allowed: frozenset[Encoding]) -> list[Candidate]:
    """Encodings worth trying for a chunk of ``length`` bytes of elements ``width`` bytes wide."""
    out = [Candidate(Encoding.ZSTD)] if Encoding.ZSTD in allowed else []
    aligned = width >= 1 and length % width == 0
    if aligned and width > 1 and Encoding.GROUPED in allowed:
        out.append(Candidate(Encoding.GROUPED))
    if aligned and has_base and Encoding.DELTA in allowed:
        out.append(Candidate(Encoding.DELTA, DeltaOp.XOR))
        if width in _INT_DTYPES:
            out.append(Candidate(Encoding.DELTA, DeltaOp.SUB))
    return out


def _body(raw: bytes | memoryview, c: Candidate, width: int, level: int, base: bytes | memoryview | None) -> bytes:
    if c.encoding == Encoding.ZSTD:
        return zstandard.ZstdCompressor(level=level, write_content_size=True).compress(raw)
    if c.encoding == Encoding.GROUPED:
        return _grouped_body(raw, width, level)
    assert base is not None and c.op is not None
    return _grouped_body(delta_residual(raw, base, width, c.op), width, level)


def encode_chunk(
    raw: bytes | memoryview, level: int, width: int = 1, base_id: str | None = None,
    base: bytes | memoryview | None = None, allowed: frozenset[Encoding] = frozenset(Encoding),
    exhaustive: bool = False, ops: tuple[DeltaOp, ...] = (DeltaOp.XOR, DeltaOp.SUB),
) -> bytes:
    """Encode a chunk with the smallest of the allowed encodings; never more than raw + header.

    ``width`` is the element width of the tensor's dtype (1 for headers and plain files).
    ``base`` is the raw bytes of ``base_id`` (the same chunk in the parent commit), offered as a
    delta base when it has the same length. Long chunks are ranked by encoding a sample of
    evenly spread windows (``exhaustive`` encodes every candidate in full instead);
    scripts/bench.py measures how close the two choices are.
    """
    if not 1 <= width <= MAX_WIDTH:
        raise ValueError(f"element width {width} out of range")
    usable = base is not None and base_id is not None and len(base) == len(raw) and len(raw) > 0
    found = [c for c in candidates(len(raw), width, usable, allowed) if c.op is None or c.op in ops]
    if not found:
        return _pack_header(Kind.CHUNK, Encoding.RAW, len(raw)) + bytes(raw)
    if len(found) > 1 and not exhaustive and len(raw) > EXHAUSTIVE_MAX:
        sample = _sample(raw, width)
        base_sample = _sample(base, width) if usable else None
        assert base_sample is None or len(base_sample) == len(sample)
        found = [min(found, key=lambda c: len(_body(sample, c, width, level, base_sample)))]
    best: tuple[int, bytes, Candidate] | None = None
    for c in found:
        body = _body(raw, c, width, level, base)
        if best is None or len(body) < best[0]:
            best = (len(body), body, c)
    assert best is not None
    _, body, chosen = best
    prefix = b""
    if chosen.encoding == Encoding.DELTA:
        assert base_id is not None and chosen.op is not None
        prefix = _DELTA.pack(bytes.fromhex(base_id), chosen.op)
    if len(prefix) + len(body) >= len(raw):
        return _pack_header(Kind.CHUNK, Encoding.RAW, len(raw)) + bytes(raw)
    return _pack_header(Kind.CHUNK, chosen.encoding, len(raw)) + prefix + body


# ---- decoding ---------------------------------------------------------------------------------


def decode(
    data: bytes | memoryview, kind: Kind, max_len: int, expected_len: int | None = None,
    fetch_base: BaseFetcher | None = None,
) -> bytes:
    """Decode a stored object of the given kind, refusing more than ``max_len`` decoded bytes.

    ``expected_len`` (from the manifest) must match the header exactly when given. A delta's base
    comes from ``fetch_base`` (verified raw bytes; the caller bounds the chain depth). Raises
    IntegrityError for every malformed input; hash verification is the caller's job (it knows
    the name).
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
        return bytes(body)
    if header.encoding == Encoding.ZSTD:
        return _decode_zstd(body, header.raw_len)
    if kind != Kind.CHUNK:
        raise IntegrityError(f"a {kind.name.lower()} cannot use the {header.encoding.name.lower()} encoding")
    if header.encoding == Encoding.GROUPED:
        return _decode_grouped(body, header.raw_len).tobytes()
    return _decode_delta(body, header.raw_len, fetch_base)


def _decode_delta(body: memoryview, raw_len: int, fetch_base: BaseFetcher | None) -> bytes:
    if len(body) < _DELTA.size:
        raise IntegrityError("delta body is too short")
    base_raw, op = _DELTA.unpack_from(body)
    if op not in DeltaOp._value2member_map_:
        raise IntegrityError(f"unknown delta operation {op}")
    if fetch_base is None:
        raise IntegrityError("delta object read without access to its base")
    residual = _decode_grouped(body[_DELTA.size:], raw_len)
    width = body[_DELTA.size] if len(body) > _DELTA.size else 0
    if op == DeltaOp.SUB and width not in _INT_DTYPES:
        raise IntegrityError(f"integer-difference delta with element width {width}")
    base = fetch_base(base_raw.hex(), raw_len)
    if len(base) != raw_len:
        raise IntegrityError(f"delta base decoded to {len(base)} bytes, expected {raw_len}")
    return _undo_residual(residual, base, width, DeltaOp(op))


def _decode_grouped(body: memoryview, raw_len: int) -> np.ndarray:
    """Bytes of a byte-grouped body, as a uint8 array of ``raw_len`` elements."""
    if len(body) < 1:
        raise IntegrityError("byte-grouped body is empty")
    width = body[0]
    if not 1 <= width <= MAX_WIDTH:
        raise IntegrityError(f"byte-grouped body has element width {width}")
    if raw_len % width:
        raise IntegrityError(f"{raw_len} bytes are not whole elements of width {width}")
    table_end = 1 + width * _PLANE.size
    if len(body) < table_end:
        raise IntegrityError("byte-grouped body is shorter than its plane table")
    entries = [_PLANE.unpack_from(body, 1 + i * _PLANE.size) for i in range(width)]
    if table_end + sum(n for _, n in entries) != len(body):
        raise IntegrityError("byte-grouped plane lengths do not add up to the body length")
    n = raw_len // width
    out = np.empty((n, width), dtype=np.uint8)
    offset = table_end
    for i, (mode, stored) in enumerate(entries):
        frame = body[offset:offset + stored]
        offset += stored
        if mode == PlaneMode.RAW:
            if stored != n:
                raise IntegrityError(f"raw plane {i} is {stored} bytes, expected {n}")
            plane = frame
        elif mode == PlaneMode.ZSTD:
            plane = memoryview(_decode_zstd(frame, n))
        else:
            raise IntegrityError(f"unknown plane mode {mode}")
        out[:, i] = np.frombuffer(plane, dtype=np.uint8)
    return out.reshape(-1)


def _decode_zstd(body: memoryview, raw_len: int) -> bytes:
    try:
        declared = zstandard.frame_content_size(body)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"malformed zstd frame: {exc}") from None
    if declared != raw_len:
        # Checked before decompressing: a bomb declaring a huge size never gets its allocation.
        raise IntegrityError(f"zstd frame declares {declared} bytes, expected {raw_len}")
    decompressor = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW).decompressobj()
    try:
        out = decompressor.decompress(body)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"corrupt zstd data: {exc}") from None
    if not decompressor.eof:
        raise IntegrityError("zstd frame is truncated")
    if decompressor.unused_data:
        raise IntegrityError(f"{len(decompressor.unused_data)} trailing bytes after the zstd frame")
    if len(out) != raw_len:
        raise IntegrityError(f"zstd frame decoded to {len(out)} bytes, expected {raw_len}")
    return out
