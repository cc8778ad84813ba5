"""Plane sets (docs/format.md, section 4): a chunk's elements cut into byte planes, each stored raw
or as one zstd frame (pure, no I/O). The body of a byte-grouped chunk (encoding 2) and the residual
part of every delta (deltas.py) and predicted delta; objects.py frames them.

Why byte planes: a float's sign/exponent byte is highly repetitive across a tensor while its low
mantissa bytes are close to random; interleaved, zstd finds little, split into planes it
compresses the repetitive planes well and stores the random ones raw. Decoding is bounded: every
zstd frame must declare exactly the size its place in the body implies, and trailing bytes are
refused.
"""

from __future__ import annotations

import struct
import threading
from enum import IntEnum
from typing import TYPE_CHECKING

import zstandard

from ckstore.codecs import context
from ckstore.errors import IntegrityError

if TYPE_CHECKING:
    import numpy as np  # imported where used: commands that decode no chunk start without numpy

MAX_WINDOW = 1 << 27
MAX_WIDTH = 8
PLANE = struct.Struct("<BI")  # plane mode, stored length


class PlaneMode(IntEnum):
    RAW = 0
    ZSTD = 1
    SORTED = 2  # flag, context-sorted deltas only: the plane is stored in context order


_LOCAL = threading.local()  # zstd contexts are costly to create and not thread-safe: one per thread


def compressor(level: int) -> zstandard.ZstdCompressor:
    cache: dict[int, zstandard.ZstdCompressor] = _LOCAL.__dict__.setdefault("compressors", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cache[level]


# Byte planes are compressed by entropy coding far more than by matches: at zstd's fast strategy
# (level 1 and below) a 2^8-entry match table instead of 2^14 stays in the L1 cache. Measured on
# real MiniLM epoch 3 -> 4 planes (1 MiB chunks): fp32 whole 1.28 -> 2.06 GB/s, XOR deltas 1.24
# -> 1.72 GB/s; bf16 whole 0.79 -> 1.31, deltas 0.99 -> 1.20; every stored size 0.1-1% smaller.
PLANE_HASH_LOG = 8
PLANE_TUNED_MAX_LEVEL = 1


def plane_compressor(level: int) -> zstandard.ZstdCompressor:
    """``compressor`` for byte planes: the fast levels with a small match table (see above)."""
    if level > PLANE_TUNED_MAX_LEVEL:
        return compressor(level)
    cache: dict[int, zstandard.ZstdCompressor] = _LOCAL.__dict__.setdefault("plane_compressors", {})
    if level not in cache:
        params = zstandard.ZstdCompressionParameters.from_level(level, hash_log=PLANE_HASH_LOG, write_content_size=1)
        cache[level] = zstandard.ZstdCompressor(compression_params=params)
    return cache[level]


def decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_LOCAL, "decompressor"):
        _LOCAL.decompressor = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW)
    return _LOCAL.decompressor


# Work arrays up to this size are kept per thread and reused; larger ones are allocated each time.
SCRATCH_MAX = 16 << 20


def scratch(n: int) -> np.ndarray:
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


# An encoded body as the pieces it is made of, joined once into the object (no copy per layer).
Parts = list[bytes | memoryview]


def split_planes(raw: bytes | memoryview | np.ndarray, width: int) -> np.ndarray:
    """Shape (width, n): plane i holds byte i (little-endian order) of every element."""
    import numpy as np

    # A strided transpose copy: measured (numpy 2.4, x86_64, 1 MiB chunks of optimizer state)
    # 3.1 GB/s against 0.85 GB/s for shifting whole little-endian integers a plane at a time, for
    # 2- and 4-byte elements alike; the split was about half of a grouped encoding's CPU.
    return np.frombuffer(raw, dtype=np.uint8).reshape(-1, width).T.copy()


def grouped_parts(raw: bytes | memoryview | np.ndarray, width: int, level: int) -> tuple[int, Parts]:
    """A plane set (format.md section 4) of ``raw``: its stored length and its pieces."""
    zstd = plane_compressor(level)
    pieces = [plane_piece(plane, zstd) for plane in split_planes(raw, width)]
    return plane_set(width, pieces)


def plane_piece(plane: np.ndarray, zstd: zstandard.ZstdCompressor) -> tuple[int, bytes | memoryview]:
    """One plane as its mode and stored bytes."""
    packed = zstd.compress(plane.data)  # rows of a C-ordered array: contiguous buffers
    # Low mantissa planes are close to random (zstd sees that quickly): storing them raw
    # saves the frame overhead and makes decoding them a copy.
    if len(packed) < plane.nbytes:
        return PlaneMode.ZSTD, packed
    return PlaneMode.RAW, plane.data


def plane_set(width: int, pieces: list[tuple[int, bytes | memoryview]]) -> tuple[int, Parts]:
    parts: Parts = [bytes([width]), *(PLANE.pack(mode, len(piece)) for mode, piece in pieces), *(p for _, p in pieces)]
    return sum(len(x) for x in parts), parts


def decode_buffer(into: np.ndarray | None, raw_len: int) -> np.ndarray:
    """``into`` (checked) or a new uint8 array of ``raw_len`` bytes, to decode a chunk into."""
    import numpy as np

    if into is not None and (into.dtype != np.uint8 or into.size != raw_len):
        raise ValueError(f"decode buffer of {into.size} {into.dtype} elements for {raw_len} bytes")
    return np.empty(raw_len, dtype=np.uint8) if into is None else into


def plane_table(body: memoryview, raw_len: int, sorted_ok: bool = False) -> tuple[int, list[tuple[int, memoryview]]]:
    """A plane set's element width and its planes' (mode, stored bytes), checked against the body;
    ``sorted_ok``: a context-sorted delta's (modes may carry the SORTED flag)."""
    if len(body) < 1:
        raise IntegrityError("byte-grouped body is empty")
    width = body[0]
    if not 1 <= width <= MAX_WIDTH:
        raise IntegrityError(f"byte-grouped body has element width {width}")
    if raw_len % width:
        raise IntegrityError(f"{raw_len} bytes are not whole elements of width {width}")
    table_end = 1 + width * PLANE.size
    if len(body) < table_end:
        raise IntegrityError("byte-grouped body is shorter than its plane table")
    entries = [PLANE.unpack_from(body, 1 + i * PLANE.size) for i in range(width)]
    if table_end + sum(n for _, n in entries) != len(body):
        raise IntegrityError("byte-grouped plane lengths do not add up to the body length")
    frames = []
    offset = table_end
    for i, (mode, stored) in enumerate(entries):
        if mode & ~(PlaneMode.SORTED if sorted_ok else 0) not in (PlaneMode.RAW, PlaneMode.ZSTD):
            raise IntegrityError(f"unknown plane mode {mode} (plane {i})")
        frames.append((mode, body[offset : offset + stored]))
        offset += stored
    return width, frames


def decode_plane(i: int, mode: int, frame: memoryview, n: int) -> bytes | memoryview:
    """Plane ``i`` of a plane set (``mode`` without flags), decoded to its ``n`` bytes."""
    if mode == PlaneMode.RAW:
        if len(frame) != n:
            raise IntegrityError(f"raw plane {i} is {len(frame)} bytes, expected {n}")
        return frame
    return decode_zstd(frame, n)


def decode_grouped(body: memoryview, raw_len: int, into: np.ndarray | None = None) -> np.ndarray:
    """Bytes of a byte-grouped body, as a uint8 array of ``raw_len`` elements (``into`` when given)."""
    import numpy as np

    width, entries = plane_table(body, raw_len)
    n = raw_len // width
    kernels = context.loaded_kernels()
    if kernels is not None and width in context.JOIN_WIDTHS:  # planes joined in one compiled pass
        planes = scratch(raw_len).reshape(width, n)
        for i, (mode, frame) in enumerate(entries):
            planes[i] = np.frombuffer(decode_plane(i, mode, frame, n), dtype=np.uint8)
        out = decode_buffer(into, raw_len)
        context.join(kernels, planes, None, 0, out)
        return out
    out = decode_buffer(into, raw_len)
    plane_list = [
        np.frombuffer(decode_plane(i, mode, frame, n), dtype=np.uint8) for i, (mode, frame) in enumerate(entries)
    ]
    if width in _WHOLE and out.ctypes.data % width == 0:
        # 2- and 4-byte elements as whole little-endian integers, shifted and OR-ed in place
        # plane by plane (numpy widens each byte plane inside the ufunc): per MiB 0.08 ms
        # (bf16) and 0.16 ms (fp32) against 0.26 ms for strided column writes (numpy 2,
        # x86_64). An output that is not aligned to its elements takes the columns.
        whole = out.view(_WHOLE[width])
        np.copyto(whole, plane_list[-1], casting="unsafe")
        for plane in plane_list[-2::-1]:
            np.left_shift(whole, 8, out=whole)
            np.bitwise_or(whole, plane, out=whole)
        return out
    # Interleaved by strided column writes: about 5x faster than whole integers when each
    # plane is first cast into an array of its own, and decoding was most of a clone's CPU.
    columns = out.reshape(n, width)
    for i, plane in enumerate(plane_list):
        columns[:, i] = plane
    return out


_WHOLE = {2: "<u2", 4: "<u4"}  # element widths decode_grouped joins as whole integers


def decode_zstd(body: memoryview, raw_len: int) -> bytes:
    try:
        declared = zstandard.frame_content_size(body)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"malformed zstd frame: {exc}") from None
    if declared != raw_len:
        # Checked before decompressing: a bomb declaring a huge size never gets its allocation.
        raise IntegrityError(f"zstd frame declares {declared} bytes, expected {raw_len}")
    try:
        # One frame, exactly: a truncated frame or trailing bytes raise (allow_extra_data).
        out = decompressor().decompress(body, max_output_size=raw_len, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        reason = "zstd frame is truncated" if "full frame" in str(exc) else f"corrupt zstd data: {exc}"
        if "unused data" in str(exc):
            reason = f"trailing bytes after the zstd frame ({exc})"
        raise IntegrityError(reason) from None
    if len(out) != raw_len:
        raise IntegrityError(f"zstd frame decoded to {len(out)} bytes, expected {raw_len}")
    return out
