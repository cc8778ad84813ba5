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

Why byte planes: a float's sign/exponent byte is highly repetitive across a tensor while its low
mantissa bytes are close to random; interleaved, zstd finds little, split into planes it
compresses the repetitive planes well and stores the random ones raw. Why deltas: between two
epochs most weights move by a few ulps, so XOR (or the integer difference) against the previous
epoch's chunk zeroes the high planes almost entirely. Why predicted deltas: between two optimizer
steps every byte changes, but the previous step's weights and second moment are almost a function
of the current state (predict.py); XOR against that prediction is mostly zeros.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

import zstandard

from ckstore.codecs import context
from ckstore.errors import IntegrityError

if TYPE_CHECKING:
    import numpy as np  # imported where used: commands that decode no chunk start without numpy

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
MAX_BASES = 4  # bases a predicted delta may name
# Enough of any object to name all its bases: gc, fsck and fetch follow bases by reading this much.
BASES_PREFIX_SIZE = HEADER_SIZE + 1 + MAX_BASES * BASE_ID_SIZE
_COEFFICIENT = struct.Struct("<d")
PREDICTED_WIDTH = 4  # float32 elements only
# Chunks at most this long are encoded with every candidate; longer ones are ranked on a sample.
EXHAUSTIVE_MAX = 1 << 18
_SAMPLE_WINDOWS = 8
_SAMPLE_WINDOW = 1 << 14
# A plane of a context-sorted delta is stored sorted only when that saves at least this many
# bytes per element: each sorted plane costs the same counting sort to decode (~4 ns an element)
# whatever it saves, and a small plane (fp32's top byte) saves little. Measured on the fp32 and
# bf16 fine-tunes (60 steps, epoch 2 given 3, 60 chunks): 0.02 sorts 10% and 16% of the planes for
# 1.58% and 2.41% fewer bytes than a plain delta; a size ratio of 0.96 instead sorted 19% and 42%
# for 1.62% and 2.93%; sorting every plane gives 2.04% and 3.47% (docs/benchmarks.md, issue 24).
SORT_GAIN = 0.02

BaseFetcher = Callable[[str, int], "bytes | memoryview"]  # (base id hex, raw length) -> verified raw bytes


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


class PlaneMode(IntEnum):
    RAW = 0
    ZSTD = 1
    SORTED = 2  # flag, context-sorted deltas only: the plane is stored in context order


class DeltaOp(IntEnum):
    XOR = 1
    # Zigzag of the element-wise difference: d = (raw - base) modulo 2^(8 * width) read as a signed
    # little-endian integer, stored as (d << 1) ^ (d >> (8 * width - 1)). Zigzag keeps a small
    # negative difference small (-1 -> 1, not 0xFF..FF), so the high planes stay zero: measured
    # 0.55 of raw against 0.62 for the plain difference and 0.58 for XOR on a dense fp32 layer.
    SUB = 2


# Encodings a repository of each format version may contain (version 1 knew only raw and zstd;
# version 3 changed link files, not objects; version 4 added the predicted delta, 5 changed packs,
# 6 added the context-sorted delta).
_PLAIN = frozenset(Encoding) - {Encoding.PREDICTED, Encoding.CONTEXT}
_PREDICTED = _PLAIN | {Encoding.PREDICTED}
ENCODINGS_BY_REPO_VERSION = {1: frozenset({Encoding.RAW, Encoding.ZSTD}), 2: _PLAIN, 3: _PLAIN, 4: _PREDICTED,
                             5: _PREDICTED, 6: frozenset(Encoding)}
# Encodings only compaction and repack write (slower to encode; the training loop never waits).
OFF_LOOP = frozenset({Encoding.CONTEXT})
_DELTAS = (Encoding.DELTA, Encoding.CONTEXT)  # one base id and an operation, then a plane set
_INT_DTYPES = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<u8"}
_SIGNED_DTYPES = {1: "<i1", 2: "<i2", 4: "<i4", 8: "<i8"}


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


def delta_bases(data: bytes | memoryview) -> tuple[str, ...]:
    """The base object ids a stored object depends on (empty unless it is a delta), in order.

    Needs only the first ``BASES_PREFIX_SIZE`` bytes, so gc and fsck can follow bases without
    decoding anything.
    """
    header = parse_header(data)
    if header.encoding in _DELTAS:
        if len(data) < HEADER_SIZE + BASE_ID_SIZE:
            raise IntegrityError("delta object is too short to name its base")
        return (bytes(data[HEADER_SIZE:HEADER_SIZE + BASE_ID_SIZE]).hex(),)
    if header.encoding != Encoding.PREDICTED:
        return ()
    count = data[HEADER_SIZE] if len(data) > HEADER_SIZE else 0
    if not 1 <= count <= MAX_BASES:
        raise IntegrityError(f"predicted delta names {count} bases (1 to {MAX_BASES} allowed)")
    start = HEADER_SIZE + 1
    if len(data) < start + count * BASE_ID_SIZE:
        raise IntegrityError("predicted delta is too short to name its bases")
    return tuple(bytes(data[start + i * BASE_ID_SIZE:start + (i + 1) * BASE_ID_SIZE]).hex() for i in range(count))


# ---- encoding ---------------------------------------------------------------------------------


_LOCAL = threading.local()  # zstd contexts are costly to create and not thread-safe: one per thread


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache: dict[int, zstandard.ZstdCompressor] = _LOCAL.__dict__.setdefault("compressors", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_LOCAL, "decompressor"):
        _LOCAL.decompressor = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW)
    return _LOCAL.decompressor  # type: ignore[no-any-return]


# Work arrays up to this size are kept per thread and reused; larger ones are allocated each time.
SCRATCH_MAX = 16 << 20


def _scratch(n: int) -> np.ndarray:
    """A thread's reusable work array of ``n`` bytes (contents undefined). Why: a fresh 1 MiB
    array costs 256 page faults when first written, measured at 3-5 us each on a loaded VM, more
    than the arithmetic done in it (decoding an fp32 delta made ~1,300 faults per MB)."""
    import numpy as np
    if n > SCRATCH_MAX:
        return np.empty(n, np.uint8)
    held = getattr(_LOCAL, "scratch", None)
    if held is None or held.size < n:
        held = _LOCAL.scratch = np.empty(max(n, 1 << 20), np.uint8)
    return held[:n]


def _raw_object(kind: Kind, raw: bytes | memoryview) -> bytes:
    return b"".join((_pack_header(kind, Encoding.RAW, len(raw)), raw))  # one copy of raw, not two


def encode(raw: bytes | memoryview, kind: Kind, level: int) -> bytes:
    """Encode raw bytes as zstd, or raw when zstd would not make the object smaller."""
    compressed = _compressor(level).compress(raw)
    if len(compressed) < len(raw):
        return _pack_header(kind, Encoding.ZSTD, len(raw)) + compressed
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
        sample = _compressor(level).compress(memoryview(raw)[:SAMPLE_BYTES])
        if len(sample) >= (1 - SAMPLE_MIN_SAVING) * SAMPLE_BYTES:
            return _raw_object(kind, raw)
    return encode(raw, kind, level)


# An encoded body as the pieces it is made of, joined once into the object (no copy per layer).
Parts = list[bytes | memoryview]


def _planes(raw: bytes | memoryview | np.ndarray, width: int) -> np.ndarray:
    """Shape (width, n): plane i holds byte i (little-endian order) of every element."""
    import numpy as np
    # A strided transpose copy: measured (numpy 2.4, x86_64, 1 MiB chunks of optimizer state)
    # 3.1 GB/s against 0.85 GB/s for shifting whole little-endian integers a plane at a time, for
    # 2- and 4-byte elements alike; the split was about half of a grouped encoding's CPU.
    return np.frombuffer(raw, dtype=np.uint8).reshape(-1, width).T.copy()


def _grouped_parts(raw: bytes | memoryview | np.ndarray, width: int, level: int) -> tuple[int, Parts]:
    """A plane set (format.md section 4) of ``raw``: its stored length and its pieces."""
    compressor = _compressor(level)
    pieces = [_plane_piece(plane, compressor) for plane in _planes(raw, width)]
    return _plane_set(width, pieces)


def _plane_piece(plane: np.ndarray, compressor: zstandard.ZstdCompressor) -> tuple[int, bytes | memoryview]:
    """One plane as its mode and stored bytes."""
    packed = compressor.compress(plane)  # rows of a C-ordered array: contiguous buffers
    # Low mantissa planes are close to random (zstd sees that quickly): storing them raw
    # saves the frame overhead and makes decoding them a copy.
    if len(packed) < plane.nbytes:
        return PlaneMode.ZSTD, packed
    return PlaneMode.RAW, memoryview(plane)


def _plane_set(width: int, pieces: list[tuple[int, bytes | memoryview]]) -> tuple[int, Parts]:
    parts: Parts = [bytes([width]), *(_PLANE.pack(mode, len(piece)) for mode, piece in pieces), *(p for _, p in pieces)]
    return sum(len(x) for x in parts), parts


def _context_parts(residual: np.ndarray, base: bytes | memoryview, width: int, level: int) -> tuple[int, Parts, bool]:
    """The plane set of a context-sorted delta: each plane stored sorted by its context where
    that saves at least ``SORT_GAIN`` bytes an element (the sort costs decode time); its stored
    length, pieces, and whether any plane is sorted."""
    compressor = _compressor(level)
    sorted_plane = context.sorted_plane(residual, base, width)
    pieces = []
    for i, plane in enumerate(_planes(residual, width)):
        mode, piece = _plane_piece(plane, compressor)
        by_context, sorted_piece = _plane_piece(sorted_plane(i), compressor)
        if len(piece) - len(sorted_piece) >= SORT_GAIN * plane.size:
            mode, piece = by_context | PlaneMode.SORTED, sorted_piece
        pieces.append((mode, piece))
    return (*_plane_set(width, pieces), any(mode & PlaneMode.SORTED for mode, _ in pieces))


def delta_residual(raw: bytes | memoryview, base: bytes | memoryview, width: int, op: DeltaOp) -> np.ndarray:
    """What a delta stores: raw XOR base, or raw - base element-wise (as bytes)."""
    import numpy as np
    if op == DeltaOp.XOR:
        return np.bitwise_xor(np.frombuffer(raw, np.uint8), np.frombuffer(base, np.uint8))
    dt = _INT_DTYPES[width]
    diff = np.subtract(np.frombuffer(raw, dt), np.frombuffer(base, dt)).view(_SIGNED_DTYPES[width])
    sign = diff >> (8 * width - 1)  # in place from here: each temporary of a 1 MiB chunk costs
    np.left_shift(diff, 1, out=diff)
    np.bitwise_xor(diff, sign, out=diff)
    return diff.view(np.uint8)


def _undo_residual(residual: np.ndarray, base: bytes | memoryview, width: int, op: DeltaOp) -> memoryview:
    import numpy as np
    if op == DeltaOp.XOR:
        np.bitwise_xor(residual, np.frombuffer(base, np.uint8), out=residual)
        return memoryview(residual)
    dt = _INT_DTYPES[width]
    zigzag = residual.view(dt)  # the array _decode_grouped filled: updated in place
    odd = _scratch(residual.size).view(dt)
    np.bitwise_and(zigzag, 1, out=odd)
    np.negative(odd, out=odd)  # unsigned arithmetic wraps, as intended
    np.right_shift(zigzag, 1, out=zigzag)
    np.bitwise_xor(zigzag, odd, out=zigzag)
    np.add(zigzag, np.frombuffer(base, dt), out=zigzag)
    return memoryview(zigzag.view(np.uint8))


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


def candidates(
    length: int, width: int, has_base: bool, allowed: frozenset[Encoding], prune: bool = False,
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
        if not (prune and width > 1 and width in _INT_DTYPES):
            out.append(Candidate(Encoding.DELTA, DeltaOp.XOR))
        if width in _INT_DTYPES:
            out.append(Candidate(Encoding.DELTA, DeltaOp.SUB))
    if aligned and has_base and Encoding.CONTEXT in allowed and width in context.WIDTHS:
        # The same residuals, each plane sorted by its context (context.py); the XOR residual is
        # pruned for the same reason as above.
        out += [Candidate(Encoding.CONTEXT, op) for op in (DeltaOp.XOR, DeltaOp.SUB) if not (prune and op == DeltaOp.XOR)]
    return out


def _body(
    raw: bytes | memoryview, c: Candidate, width: int, level: int, base: bytes | memoryview | None,
) -> tuple[int, Parts]:
    if c.encoding == Encoding.ZSTD:
        packed = _compressor(level).compress(raw)
        return len(packed), [packed]
    if c.encoding == Encoding.GROUPED:
        return _grouped_parts(raw, width, level)
    assert base is not None and c.op is not None
    residual = delta_residual(raw, base, width, c.op)
    if c.encoding == Encoding.CONTEXT:
        return _context_parts(residual, base, width, level)[:2]
    return _grouped_parts(residual, width, level)


def encode_chunk(
    raw: bytes | memoryview, level: int, width: int = 1, base_id: str | None = None,
    base: bytes | memoryview | None = None, allowed: frozenset[Encoding] = frozenset(Encoding) - OFF_LOOP,
    exhaustive: bool = False, ops: tuple[DeltaOp, ...] = (DeltaOp.XOR, DeltaOp.SUB),
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
    found = [c for c in candidates(len(raw), width, usable, allowed, prune=not exhaustive) if c.op is None or c.op in ops]
    if not found:
        return _raw_object(Kind.CHUNK, raw)
    if len(found) > 1 and not exhaustive and len(raw) > EXHAUSTIVE_MAX:
        sample = _sample(raw, width)
        base_sample = _sample(base, width) if usable else None
        assert base_sample is None or len(base_sample) == len(sample)
        found = [min(found, key=lambda c: _body(sample, c, width, level, base_sample)[0])]
    best: tuple[int, Parts, Candidate] | None = None
    for c in found:
        size, parts = _body(raw, c, width, level, base)
        if best is None or size < best[0]:
            best = (size, parts, c)
    assert best is not None
    size, parts, chosen = best
    if chosen.encoding == Encoding.CONTEXT and not any(_PLANE.unpack(parts[1 + i])[0] & PlaneMode.SORTED for i in range(width)):
        chosen = Candidate(Encoding.DELTA, chosen.op)  # no plane sorted: the same bytes as a plain delta
    prefix = b""
    if chosen.encoding in _DELTAS:
        assert base_id is not None and chosen.op is not None
        prefix = _DELTA.pack(bytes.fromhex(base_id), chosen.op)
    if len(prefix) + size >= len(raw):
        return _raw_object(Kind.CHUNK, raw)
    return b"".join([_pack_header(Kind.CHUNK, chosen.encoding, len(raw)), prefix, *parts])


def encode_delta(
    raw: bytes | memoryview, level: int, width: int, base_id: str, base: bytes | memoryview, than: int,
    allowed: frozenset[Encoding] = frozenset({Encoding.DELTA}), sample_test: bool = True,
) -> bytes | None:
    """The best delta encoding of ``raw`` against ``base`` (a plain delta, or a context-sorted one
    when ``allowed``) if it stores in fewer than ``than`` bytes (the chunk's current encoding),
    else None.

    Deltas that cannot pay are common (AdamW's first moment changes too much between epochs:
    269 of 439 optimizer chunks of the fp32 run), so a long chunk is first tried on the sample
    used for ranking: when the delta there is not at least 3% smaller than the chunk grouped
    whole, the full encode is skipped. ``sample_test=False`` skips that test (a caller that knows
    a delta paid at this place last time: the test would pass, at a quarter of a full encode).
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
            whole = _grouped_parts(sample, width, level)[0] if width > 1 else len(_compressor(level).compress(sample))
            if size >= 0.97 * min(whole, len(sample)):
                return None
        found = [best]
    data = encode_chunk(raw, level, width, base_id, base, allowed=frozenset(c.encoding for c in found),
                        ops=tuple(c.op for c in found if c.op is not None))
    return data if len(data) < than and parse_header(data).encoding in kinds else None


def encode_predicted(
    raw: bytes | memoryview, level: int, base_ids: tuple[str, ...], bases: list[bytes], predictor: int,
    coefficients: tuple[float, ...], than: int,
) -> bytes | None:
    """``raw`` (float32 elements) as the XOR against the prediction ``predictor`` computes from
    ``bases`` with ``coefficients`` (predict.py), if that stores in fewer than ``than`` bytes."""
    import numpy as np

    from ckstore.codecs import predict
    if not raw or len(raw) % PREDICTED_WIDTH or any(len(b) != len(raw) for b in bases) or len(bases) != len(base_ids):
        return None
    guess = predict.predict(predict.Predictor(predictor), coefficients, bases)
    residual = np.bitwise_xor(np.frombuffer(raw, dtype="<u4"), guess).view(np.uint8)
    size, parts = _grouped_parts(residual, PREDICTED_WIDTH, level)
    prefix = b"".join([bytes([len(base_ids)]), *(bytes.fromhex(b) for b in base_ids), bytes([predictor]),
                       *(_COEFFICIENT.pack(c) for c in coefficients)])
    if HEADER_SIZE + len(prefix) + size >= than:
        return None
    return b"".join([_pack_header(Kind.CHUNK, Encoding.PREDICTED, len(raw)), prefix, *parts])


# ---- decoding ---------------------------------------------------------------------------------


def decode_view(
    data: bytes | memoryview, kind: Kind, max_len: int, expected_len: int | None = None,
    fetch_base: BaseFetcher | None = None, out: np.ndarray | None = None,
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
        return _decode_zstd(body, header.raw_len)
    if kind != Kind.CHUNK:
        raise IntegrityError(f"a {kind.name.lower()} cannot use the {header.encoding.name.lower()} encoding")
    if header.encoding == Encoding.GROUPED:
        return memoryview(_decode_grouped(body, header.raw_len, out))
    if header.encoding == Encoding.PREDICTED:
        return _decode_predicted(data, body, header.raw_len, fetch_base, out)
    return _decode_delta(body, header.raw_len, fetch_base, out, header.encoding == Encoding.CONTEXT)


def decode(
    data: bytes | memoryview, kind: Kind, max_len: int, expected_len: int | None = None,
    fetch_base: BaseFetcher | None = None,
) -> bytes:
    """``decode_view`` as bytes (one more copy of a byte-grouped or delta chunk)."""
    out = decode_view(data, kind, max_len, expected_len, fetch_base)
    return out if isinstance(out, bytes) else out.tobytes()


def _decode_predicted(
    data: bytes | memoryview, body: memoryview, raw_len: int, fetch_base: BaseFetcher | None, out: np.ndarray | None,
) -> memoryview:
    import numpy as np

    from ckstore.codecs import predict
    base_ids = delta_bases(data)
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
    coefficients = [_COEFFICIENT.unpack_from(body, at + i * _COEFFICIENT.size)[0] for i in range(shape.coefficients)]
    try:
        predict.check_coefficients(coefficients)
    except ValueError as exc:
        raise IntegrityError(str(exc)) from None
    residual = _decode_grouped(body[at + shape.coefficients * _COEFFICIENT.size:], raw_len, out)
    if raw_len % PREDICTED_WIDTH or body[at + shape.coefficients * _COEFFICIENT.size] != PREDICTED_WIDTH:
        raise IntegrityError("predicted delta residual is not of float32 elements")
    if fetch_base is None:
        raise IntegrityError("delta object read without access to its base")
    bases = []
    for base_id in base_ids:
        base = fetch_base(base_id, raw_len)
        if len(base) != raw_len:
            raise IntegrityError(f"delta base decoded to {len(base)} bytes, expected {raw_len}")
        bases.append(base)
    guess = predict.predict(predictor, coefficients, bases)
    np.bitwise_xor(residual.view("<u4"), guess, out=residual.view("<u4"))
    return memoryview(residual)


def _decode_delta(
    body: memoryview, raw_len: int, fetch_base: BaseFetcher | None, out: np.ndarray | None, sorted_planes: bool = False,
) -> memoryview:
    """A delta (encoding 3) or, with ``sorted_planes``, a context-sorted delta (encoding 5). Every
    plane is decoded (so a malformed body fails) before the base is fetched."""
    import numpy as np
    if len(body) < _DELTA.size:
        raise IntegrityError("delta body is too short")
    base_raw, op = _DELTA.unpack_from(body)
    if op not in DeltaOp._value2member_map_:
        raise IntegrityError(f"unknown delta operation {op}")
    if fetch_base is None:
        raise IntegrityError("delta object read without access to its base")
    width, entries = _plane_table(body[_DELTA.size:], raw_len, sorted_ok=sorted_planes)
    if sorted_planes and width not in context.WIDTHS:
        raise IntegrityError(f"context-sorted delta with element width {width}")
    if op == DeltaOp.SUB and width not in _INT_DTYPES:
        raise IntegrityError(f"integer-difference delta with element width {width}")
    n = raw_len // width
    by_context = [i for i, (mode, _) in enumerate(entries) if mode & PlaneMode.SORTED]
    kernels = context.decode_kernels(len(by_context) * n) if by_context else context.loaded_kernels()
    residual = _buffer(out, raw_len)
    if kernels is not None and width in context.JOIN_WIDTHS:
        # Planes, not interleaved: the kernels un-sort into planes and join them with the base.
        planes = residual.reshape(width, n)
        for i, (mode, frame) in enumerate(entries):
            planes[i] = np.frombuffer(_plane(i, mode & ~PlaneMode.SORTED, frame, n), np.uint8)
        base = _delta_base(fetch_base, base_raw, raw_len)
        words = context.base_words(base, width)
        joined = _scratch(raw_len).reshape(width, n)  # the chain below is decoded: the thread's scratch is free
        for i in range(width):
            if i not in by_context:
                joined[i] = planes[i]
        context.unsort_into(kernels, {i: planes[i] for i in by_context}, words, joined)
        context.join(kernels, joined, words, op, residual)  # DeltaOp values are the kernels' op codes
        return memoryview(residual)
    columns, stored = residual.reshape(n, width), {}
    for i, (mode, frame) in enumerate(entries):
        plane = np.frombuffer(_plane(i, mode & ~PlaneMode.SORTED, frame, n), np.uint8)
        if mode & PlaneMode.SORTED:
            stored[i] = plane
        else:
            columns[:, i] = plane
    base = _delta_base(fetch_base, base_raw, raw_len)
    if stored:
        context.unsort_planes(stored, base, width, residual, numpy_only=True)  # decode_kernels said numpy
    return _undo_residual(residual, base, width, DeltaOp(op))


def _delta_base(fetch_base: BaseFetcher, base_raw: bytes, raw_len: int) -> bytes | memoryview:
    base = fetch_base(base_raw.hex(), raw_len)
    if len(base) != raw_len:
        raise IntegrityError(f"delta base decoded to {len(base)} bytes, expected {raw_len}")
    return base


def _buffer(into: np.ndarray | None, raw_len: int) -> np.ndarray:
    """``into`` (checked) or a new uint8 array of ``raw_len`` bytes, to decode a chunk into."""
    import numpy as np
    if into is not None and (into.dtype != np.uint8 or into.size != raw_len):
        raise ValueError(f"decode buffer of {into.size} {into.dtype} elements for {raw_len} bytes")
    return np.empty(raw_len, dtype=np.uint8) if into is None else into


def _plane_table(body: memoryview, raw_len: int, sorted_ok: bool = False) -> tuple[int, list[tuple[int, memoryview]]]:
    """A plane set's element width and its planes' (mode, stored bytes), checked against the body;
    ``sorted_ok``: a context-sorted delta's (modes may carry the SORTED flag)."""
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
    frames = []
    offset = table_end
    for i, (mode, stored) in enumerate(entries):
        if mode & ~(PlaneMode.SORTED if sorted_ok else 0) not in (PlaneMode.RAW, PlaneMode.ZSTD):
            raise IntegrityError(f"unknown plane mode {mode} (plane {i})")
        frames.append((mode, body[offset:offset + stored]))
        offset += stored
    return width, frames


def _plane(i: int, mode: int, frame: memoryview, n: int) -> bytes | memoryview:
    """Plane ``i`` of a plane set (``mode`` without flags), decoded to its ``n`` bytes."""
    if mode == PlaneMode.RAW:
        if len(frame) != n:
            raise IntegrityError(f"raw plane {i} is {len(frame)} bytes, expected {n}")
        return frame
    return _decode_zstd(frame, n)


def _decode_grouped(body: memoryview, raw_len: int, into: np.ndarray | None = None) -> np.ndarray:
    """Bytes of a byte-grouped body, as a uint8 array of ``raw_len`` elements (``into`` when given)."""
    import numpy as np
    width, entries = _plane_table(body, raw_len)
    n = raw_len // width
    kernels = context.loaded_kernels()
    if kernels is not None and width in context.JOIN_WIDTHS:  # planes joined in one compiled pass
        planes = _scratch(raw_len).reshape(width, n)
        for i, (mode, frame) in enumerate(entries):
            planes[i] = np.frombuffer(_plane(i, mode, frame, n), dtype=np.uint8)
        out = _buffer(into, raw_len)
        context.join(kernels, planes, None, 0, out)
        return out
    # Interleave by strided column writes: measured (numpy 2, x86_64) about 5x faster than
    # shifting each plane into whole little-endian integers and OR-ing them, which costs a
    # widening cast and two passes a plane; decoding was most of a clone's and a push's CPU.
    out = _buffer(into, raw_len).reshape(n, width)
    for i, (mode, frame) in enumerate(entries):
        out[:, i] = np.frombuffer(_plane(i, mode, frame, n), dtype=np.uint8)
    return out.reshape(-1)


def _decode_zstd(body: memoryview, raw_len: int) -> bytes:
    try:
        declared = zstandard.frame_content_size(body)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"malformed zstd frame: {exc}") from None
    if declared != raw_len:
        # Checked before decompressing: a bomb declaring a huge size never gets its allocation.
        raise IntegrityError(f"zstd frame declares {declared} bytes, expected {raw_len}")
    try:
        # One frame, exactly: a truncated frame or trailing bytes raise (allow_extra_data).
        out = _decompressor().decompress(body, max_output_size=raw_len, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        reason = "zstd frame is truncated" if "full frame" in str(exc) else f"corrupt zstd data: {exc}"
        if "unused data" in str(exc):
            reason = f"trailing bytes after the zstd frame ({exc})"
        raise IntegrityError(reason) from None
    if len(out) != raw_len:
        raise IntegrityError(f"zstd frame decoded to {len(out)} bytes, expected {raw_len}")
    return out
