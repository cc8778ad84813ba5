"""Delta chunk encodings (docs/format.md, section 4; pure, no I/O): a chunk stored as its residual
against a base chunk (the same place in another epoch), XOR or the zigzag integer difference, in a
plane set (planes.py). Encoding 3 stores the planes in element order; encoding 5, the
context-sorted delta, may store each plane sorted by a context a decoder knows before it decodes
the plane (context.py). Why deltas: between two epochs most weights move by a few ulps, so the
residual's high planes are almost entirely zero.

Decoding: every plane is decoded (so a malformed body fails) before the base is fetched. Once the
compiled kernels are loaded (context.py), the planes are joined with the base in one pass;
without them numpy interleaves the planes and undoes the residual.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from enum import IntEnum
from typing import TYPE_CHECKING

from ckstore.codecs import context
from ckstore.codecs.planes import (
    Parts,
    PlaneMode,
    compressor,
    decode_buffer,
    decode_grouped,
    decode_plane,
    plane_piece,
    plane_set,
    plane_table,
    scratch,
    split_planes,
)
from ckstore.errors import IntegrityError

if TYPE_CHECKING:
    import numpy as np

BaseFetcher = Callable[[str, int], "bytes | memoryview"]  # (base id hex, raw length) -> verified raw bytes

BASE_ID_SIZE = 32
DELTA = struct.Struct(f"<{BASE_ID_SIZE}sB")  # base id (binary), delta operation
INT_DTYPES = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<u8"}
_SIGNED_DTYPES = {1: "<i1", 2: "<i2", 4: "<i4", 8: "<i8"}

# A plane of a context-sorted delta is stored sorted only when that saves at least this many
# bytes per element: each sorted plane costs the same counting sort to decode (~4 ns an element)
# whatever it saves, and a small plane (fp32's top byte) saves little. Measured on the fp32 and
# bf16 fine-tunes (60 steps, epoch 2 given 3, 60 chunks): 0.02 sorts 10% and 16% of the planes for
# 1.58% and 2.41% fewer bytes than a plain delta; a size ratio of 0.96 instead sorted 19% and 42%
# for 1.62% and 2.93%; sorting every plane gives 2.04% and 3.47% (docs/benchmarks.md).
# 2-byte elements (bf16) need 0.04: their gain is in the low plane, and a checkout three deltas back
# decoded at 95-106 MB/s per core with 0.02 against 107-127 with 0.04 (same repository, load 6-7),
# for 0.5% more stored bytes (196.6 -> 197.6 MB): every plane costs the same sort per element, and
# a bf16 chunk has twice the elements of an fp32 one. fp32's planes barely move between the two.
SORT_GAIN = {2: 0.04, 4: 0.02, 8: 0.02}  # by element width (context.WIDTHS)


class DeltaOp(IntEnum):
    XOR = 1
    # Zigzag of the element-wise difference: d = (raw - base) modulo 2^(8 * width) read as a signed
    # little-endian integer, stored as (d << 1) ^ (d >> (8 * width - 1)). Zigzag keeps a small
    # negative difference small (-1 -> 1, not 0xFF..FF), so the high planes stay zero: measured
    # 0.55 of raw against 0.62 for the plain difference and 0.58 for XOR on a dense fp32 layer.
    SUB = 2


def context_parts(residual: np.ndarray, base: bytes | memoryview, width: int, level: int) -> tuple[int, Parts, bool]:
    """The plane set of a context-sorted delta: each plane stored sorted by its context where
    that saves at least ``SORT_GAIN[width]`` bytes an element (the sort costs decode time); its stored
    length, pieces, and whether any plane is sorted."""
    zstd = compressor(level)  # not plane_compressor: a sorted plane's runs are matches a small table misses
    sorted_plane = context.sorted_plane(residual, base, width)
    pieces = []
    for i, plane in enumerate(split_planes(residual, width)):
        mode, piece = plane_piece(plane, zstd)
        by_context, sorted_piece = plane_piece(sorted_plane(i), zstd)
        if len(piece) - len(sorted_piece) >= SORT_GAIN[width] * plane.size:
            mode, piece = by_context | PlaneMode.SORTED, sorted_piece
        pieces.append((mode, piece))
    return (*plane_set(width, pieces), any(mode & PlaneMode.SORTED for mode, _ in pieces))


def delta_residual(raw: bytes | memoryview, base: bytes | memoryview, width: int, op: DeltaOp) -> np.ndarray:
    """What a delta stores: raw XOR base, or raw - base element-wise (as bytes)."""
    import numpy as np

    if op == DeltaOp.XOR:
        return np.bitwise_xor(np.frombuffer(raw, np.uint8), np.frombuffer(base, np.uint8))
    dt = INT_DTYPES[width]
    diff = np.subtract(np.frombuffer(raw, dt), np.frombuffer(base, dt)).view(_SIGNED_DTYPES[width])
    sign = diff >> (8 * width - 1)  # in place from here: each temporary of a 1 MiB chunk costs
    np.left_shift(diff, 1, out=diff)
    np.bitwise_xor(diff, sign, out=diff)
    return diff.view(np.uint8)


def undo_residual(residual: np.ndarray, base: bytes | memoryview, width: int, op: DeltaOp) -> memoryview:
    import numpy as np

    if op == DeltaOp.XOR:
        np.bitwise_xor(residual, np.frombuffer(base, np.uint8), out=residual)
        return residual.data
    dt = INT_DTYPES[width]
    zigzag = residual.view(dt)  # the array decode_grouped filled: updated in place
    odd = scratch(residual.size).view(dt)
    np.bitwise_and(zigzag, 1, out=odd)
    np.negative(odd, out=odd)  # unsigned arithmetic wraps, as intended
    np.right_shift(zigzag, 1, out=zigzag)
    np.bitwise_xor(zigzag, odd, out=zigzag)
    np.add(zigzag, np.frombuffer(base, dt), out=zigzag)
    return zigzag.view(np.uint8).data


def decode_delta(
    body: memoryview,
    raw_len: int,
    fetch_base: BaseFetcher | None,
    out: np.ndarray | None,
    sorted_planes: bool = False,
) -> memoryview:
    """A delta (encoding 3) or, with ``sorted_planes``, a context-sorted delta (encoding 5). Every
    plane is decoded (so a malformed body fails) before the base is fetched."""
    import numpy as np

    if len(body) < DELTA.size:
        raise IntegrityError("delta body is too short")
    base_raw, op = DELTA.unpack_from(body)
    if op not in DeltaOp._value2member_map_:
        raise IntegrityError(f"unknown delta operation {op}")
    if fetch_base is None:
        raise IntegrityError("delta object read without access to its base")
    width, entries = plane_table(body[DELTA.size :], raw_len, sorted_ok=sorted_planes)
    if sorted_planes and width not in context.WIDTHS:
        raise IntegrityError(f"context-sorted delta with element width {width}")
    if op == DeltaOp.SUB and width not in INT_DTYPES:
        raise IntegrityError(f"integer-difference delta with element width {width}")
    n = raw_len // width
    by_context = [i for i, (mode, _) in enumerate(entries) if mode & PlaneMode.SORTED]
    kernels = context.decode_kernels(len(by_context) * n) if by_context else context.loaded_kernels()
    residual = decode_buffer(out, raw_len)
    if kernels is not None and width in context.JOIN_WIDTHS:
        # Planes, not interleaved: the kernels un-sort into planes and join them with the base.
        planes = residual.reshape(width, n)
        for i, (mode, frame) in enumerate(entries):
            planes[i] = np.frombuffer(decode_plane(i, mode & ~PlaneMode.SORTED, frame, n), np.uint8)
        base = _delta_base(fetch_base, base_raw, raw_len)
        words = context.base_words(base, width)
        joined = scratch(raw_len).reshape(width, n)  # the chain below is decoded: the thread's scratch is free
        for i in range(width):
            if i not in by_context:
                joined[i] = planes[i]
        context.unsort_into(kernels, {i: planes[i] for i in by_context}, words, joined)
        context.join(kernels, joined, words, op, residual)  # DeltaOp values are the kernels' op codes
        return residual.data
    if not by_context:
        residual = decode_grouped(body[DELTA.size :], raw_len, residual)
        return undo_residual(residual, _delta_base(fetch_base, base_raw, raw_len), width, DeltaOp(op))
    columns, stored = residual.reshape(n, width), {}
    for i, (mode, frame) in enumerate(entries):
        plane = np.frombuffer(decode_plane(i, mode & ~PlaneMode.SORTED, frame, n), np.uint8)
        if mode & PlaneMode.SORTED:
            stored[i] = plane
        else:
            columns[:, i] = plane
    base = _delta_base(fetch_base, base_raw, raw_len)
    if stored:
        context.unsort_planes(stored, base, width, residual, numpy_only=True)  # decode_kernels said numpy
    return undo_residual(residual, base, width, DeltaOp(op))


def _delta_base(fetch_base: BaseFetcher, base_raw: bytes, raw_len: int) -> bytes | memoryview:
    base = fetch_base(base_raw.hex(), raw_len)
    if len(base) != raw_len:
        raise IntegrityError(f"delta base decoded to {len(base)} bytes, expected {raw_len}")
    return base
