"""Stored-object encoding: the bytes of one file in the object directory (pure, no I/O).

Every stored object is a 16-byte header followed by an encoding-specific body:

    0  4  magic  b"CKSO"
    4  1  object format version (1)
    5  1  kind      1 = chunk, 2 = commit manifest
    6  1  encoding  0 = raw, 1 = zstd            (docs/format.md lists every encoding)
    7  1  reserved, 0
    8  8  raw length, unsigned little-endian: the length of the decoded bytes

The object's *name* never depends on the encoding (it is the hash of the decoded bytes), so an
object can be re-encoded in place and dedup keeps working. Decoding is bounded: the raw length in
the header must equal what the caller expects (from the manifest) before anything is allocated, a
zstd frame must declare exactly that content size, and trailing bytes after the body are refused.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

import zstandard

from .errors import IntegrityError

MAGIC = b"CKSO"
OBJECT_VERSION = 1
HEADER = struct.Struct("<4sBBBBQ")
HEADER_SIZE = HEADER.size
# A decoder never needs a window larger than this; a frame asking for more is hostile.
MAX_WINDOW = 1 << 27


class Kind(IntEnum):
    CHUNK = 1
    COMMIT = 2


class Encoding(IntEnum):
    RAW = 0
    ZSTD = 1


@dataclass(frozen=True)
class ObjectHeader:
    kind: Kind
    encoding: Encoding
    raw_len: int


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


def encode(raw: bytes | memoryview, kind: Kind, level: int) -> bytes:
    """Encode raw bytes, choosing zstd unless it would not make the object smaller."""
    compressed = zstandard.ZstdCompressor(level=level, write_content_size=True).compress(raw)
    if len(compressed) < len(raw):
        return HEADER.pack(MAGIC, OBJECT_VERSION, kind, Encoding.ZSTD, 0, len(raw)) + compressed
    return HEADER.pack(MAGIC, OBJECT_VERSION, kind, Encoding.RAW, 0, len(raw)) + bytes(raw)


def decode(data: bytes | memoryview, kind: Kind, max_len: int, expected_len: int | None = None) -> bytes:
    """Decode a stored object of the given kind, refusing more than ``max_len`` decoded bytes.

    ``expected_len`` (from the manifest) must match the header exactly when given. Raises
    IntegrityError for every malformed input; hash verification is the caller's job (it knows the
    name).
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
    return _decode_zstd(body, header.raw_len)


def _decode_zstd(body: memoryview, raw_len: int) -> bytes:
    try:
        declared = zstandard.frame_content_size(body)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"malformed zstd frame: {exc}") from None
    if declared != raw_len:
        # Checked before decompressing: a bomb declaring a huge size never gets its allocation.
        raise IntegrityError(f"zstd frame declares {declared} bytes, header says {raw_len}")
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
        raise IntegrityError(f"zstd frame decoded to {len(out)} bytes, header says {raw_len}")
    return out
