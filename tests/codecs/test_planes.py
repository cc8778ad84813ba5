"""Chunk encodings: round trips for every encoding and element width, and hostile bodies."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from ckstore.codecs.objects import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    Encoding,
    Kind,
    decode,
    delta_bases,
    encode_chunk,
    parse_header,
)
from ckstore.errors import IntegrityError

WIDTHS = [1, 2, 4, 8]
BASE_ID = "ab" * 32


def _header(encoding: Encoding, raw_len: int) -> bytes:
    return HEADER.pack(MAGIC, 1, Kind.CHUNK, encoding, 0, raw_len)


def _roundtrip(data: bytes, base: bytes | None = None, **kw: object) -> bytes:
    def fetch(oid: str, n: int) -> bytes:
        assert oid == BASE_ID and base is not None and n == len(base)
        return base

    return decode(data, Kind.CHUNK, 1 << 28, expected_len=None, fetch_base=fetch)


def _floats(n: int, seed: int, width: int) -> bytes:
    rng = np.random.default_rng(seed)
    dtype = {1: np.int8, 2: np.float16, 4: np.float32, 8: np.float64}[width]
    return (rng.standard_normal(n) * 0.02).astype(dtype).tobytes()


@settings(max_examples=60, deadline=None)
@given(
    width=st.sampled_from(WIDTHS),
    n=st.integers(0, 3000),
    seed=st.integers(0, 2**32 - 1),
    noise=st.floats(0, 1e-2),
    encoding=st.sampled_from(list(Encoding)),
    exhaustive=st.booleans(),
)
def test_round_trip_every_encoding_and_width(
    width: int, n: int, seed: int, noise: float, encoding: Encoding, exhaustive: bool
) -> None:
    raw = _floats(n, seed, width)
    base_arr = np.frombuffer(raw, dtype=np.uint8).copy()
    flips = np.random.default_rng(seed + 1).random(len(base_arr)) < noise
    base_arr[flips] ^= 0x5A
    base = base_arr.tobytes()
    allowed = frozenset({encoding})
    data = encode_chunk(raw, 3, width, BASE_ID, base, allowed=allowed, exhaustive=exhaustive)
    assert len(data) <= len(raw) + HEADER_SIZE  # never more than raw plus the header
    # A context-sorted delta none of whose planes pays for sorting is written as the plain delta
    # it then equals (docs/format.md, section 4).
    written = {encoding, Encoding.RAW} | ({Encoding.DELTA} if encoding == Encoding.CONTEXT else set())
    assert parse_header(data).encoding in written
    assert _roundtrip(data, base) == raw


@settings(max_examples=40, deadline=None)
@given(raw=st.binary(max_size=5000), width=st.sampled_from(WIDTHS), level=st.integers(1, 9))
def test_arbitrary_bytes_with_base_round_trip(raw: bytes, width: int, level: int) -> None:
    base = bytes(reversed(raw))
    data = encode_chunk(raw, level, width, BASE_ID, base, exhaustive=True)
    assert len(data) <= len(raw) + HEADER_SIZE
    assert _roundtrip(data, base) == raw


def test_large_chunk_uses_sampled_choice_and_delta_wins() -> None:
    width = 4
    base = _floats(200_000, 1, width)
    arr = np.frombuffer(base, np.float32).copy()
    arr += np.float32(1e-6)
    raw = arr.tobytes()
    data = encode_chunk(raw, 3, width, BASE_ID, base)
    assert parse_header(data).encoding == Encoding.DELTA
    assert delta_bases(data) == (BASE_ID,)
    assert len(data) < len(encode_chunk(raw, 3, width)) * 0.9
    assert _roundtrip(data, base) == raw


def test_grouped_beats_plain_zstd_on_floats() -> None:
    raw = _floats(100_000, 3, 4)
    grouped = encode_chunk(raw, 3, 4, allowed=frozenset({Encoding.GROUPED}))
    plain = encode_chunk(raw, 3, 4, allowed=frozenset({Encoding.ZSTD}))
    assert parse_header(grouped).encoding == Encoding.GROUPED
    assert len(grouped) < len(plain)


def test_version_one_encodings_only_when_asked() -> None:
    raw = _floats(50_000, 4, 4)
    data = encode_chunk(raw, 3, 4, BASE_ID, raw[::-1], allowed=frozenset({Encoding.RAW, Encoding.ZSTD}))
    assert parse_header(data).encoding in (Encoding.RAW, Encoding.ZSTD)


def test_delta_without_fetcher_is_integrity_error() -> None:
    raw = _floats(1000, 5, 4)
    data = encode_chunk(raw, 3, 4, BASE_ID, raw, allowed=frozenset({Encoding.DELTA}))
    with pytest.raises(IntegrityError):
        decode(data, Kind.CHUNK, 1 << 28)


def _grouped(raw_len: int, width: int, planes: list[tuple[int, bytes]]) -> bytes:
    table = b"".join(struct.pack("<BI", mode, len(p)) for mode, p in planes)
    return _header(Encoding.GROUPED, raw_len) + bytes([width]) + table + b"".join(p for _, p in planes)


MALFORMED = {
    "empty body": _header(Encoding.GROUPED, 8),
    "width 0": _header(Encoding.GROUPED, 8) + b"\x00",
    "width 9": _header(Encoding.GROUPED, 9) + b"\x09",
    "not whole elements": _grouped(7, 2, [(0, b"abcd"), (0, b"abc")]),
    "short table": _header(Encoding.GROUPED, 8) + b"\x02\x00\x04",
    "raw plane wrong size": _grouped(8, 2, [(0, b"abc"), (0, b"abcde")]),
    "unknown plane mode": _grouped(8, 2, [(7, b"abcd"), (0, b"abcd")]),
    "lengths exceed body": _grouped(8, 2, [(0, b"abcd"), (0, b"abcd")])[:-1],
    "trailing bytes": _grouped(8, 2, [(0, b"abcd"), (0, b"abcd")]) + b"x",
    "corrupt frame": _grouped(8, 2, [(1, b"\x28\xb5\x2f\xfd garbage"), (0, b"abcd")]),
    "delta too short": _header(Encoding.DELTA, 8) + b"\x01" * 10,
    "delta bad op": _header(Encoding.DELTA, 8)
    + bytes.fromhex(BASE_ID)
    + b"\x09"
    + _grouped(8, 2, [(0, b"abcd"), (0, b"abcd")])[HEADER_SIZE:],
    "sub with width 3": _header(Encoding.DELTA, 6)
    + bytes.fromhex(BASE_ID)
    + b"\x02"
    + _grouped(6, 3, [(0, b"ab"), (0, b"ab"), (0, b"ab")])[HEADER_SIZE:],
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_bodies_are_integrity_errors(name: str) -> None:
    with pytest.raises(IntegrityError):
        decode(MALFORMED[name], Kind.CHUNK, 1 << 28, fetch_base=lambda oid, n: b"\0" * n)


def test_decompression_bomb_in_a_plane_is_refused_before_allocation() -> None:
    # A 40-byte plane frame that would expand to 16 MiB where the plane holds 4 bytes.
    frame = zstandard.ZstdCompressor(write_content_size=True).compress(b"\0" * (1 << 24))
    assert len(frame) < 2000
    with pytest.raises(IntegrityError, match="declares"):
        decode(_grouped(8, 2, [(1, frame), (0, b"abcd")]), Kind.CHUNK, 1 << 28)
    # A frame that does not declare its size is refused too (no unbounded streaming decode).
    plain = zstandard.ZstdCompressor(write_content_size=False).compress(b"abcd")
    with pytest.raises(IntegrityError):
        decode(_grouped(8, 2, [(1, plain), (0, b"abcd")]), Kind.CHUNK, 1 << 28)


def test_declared_length_beyond_limit_refused() -> None:
    data = _grouped(1 << 40, 2, [(0, b"ab"), (0, b"ab")])
    with pytest.raises(IntegrityError, match="limit"):
        decode(data, Kind.CHUNK, 1 << 28)


def test_commit_objects_cannot_use_chunk_encodings() -> None:
    data = bytearray(_grouped(8, 2, [(0, b"abcd"), (0, b"abcd")]))
    data[5] = Kind.COMMIT
    with pytest.raises(IntegrityError):
        decode(bytes(data), Kind.COMMIT, 1 << 28)


def test_base_of_wrong_length_is_integrity_error() -> None:
    raw = _floats(1000, 6, 4)
    base = bytes([raw[0] ^ 1]) + raw[1:]
    data = encode_chunk(raw, 3, 4, BASE_ID, base, allowed=frozenset({Encoding.DELTA}))
    assert parse_header(data).encoding == Encoding.DELTA
    with pytest.raises(IntegrityError):
        decode(data, Kind.CHUNK, 1 << 28, fetch_base=lambda oid, n: b"\0" * (n - 4))


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(WIDTHS), st.integers(0, 3000), st.integers(0, 7), st.data())
def test_byte_grouped_decodes_into_any_buffer_alignment(
    width: int, elements: int, offset: int, data: st.DataObject
) -> None:
    """Planes join into the caller's buffer (a checkout's file at a tensor's offset), aligned to
    its elements or not, to the same bytes."""
    from ckstore.codecs.planes import decode_grouped, grouped_parts

    raw = data.draw(st.binary(min_size=width * elements, max_size=width * elements))
    _, parts = grouped_parts(raw, width, 1)
    body = memoryview(b"".join(parts))
    buffer = np.zeros(len(raw) + 8, np.uint8)
    into = buffer[offset : offset + len(raw)]
    decoded = decode_grouped(body, len(raw), into=into)
    assert decoded.tobytes() == raw and into.tobytes() == raw
    assert not buffer[:offset].any() and not buffer[offset + len(raw) :].any()
