"""Object encoding: round trips, raw fallback, and every malformed object refused (bounded)."""

from __future__ import annotations

import os
import struct
import tracemalloc

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from ckstore.codecs.objects import HEADER, HEADER_SIZE, MAGIC, Encoding, Kind, decode, encode, parse_header
from ckstore.errors import IntegrityError

LIMIT = 1 << 28


def obj(
    body: bytes,
    raw_len: int,
    encoding: Encoding = Encoding.ZSTD,
    kind: Kind = Kind.CHUNK,
    magic: bytes = MAGIC,
    version: int = 1,
    reserved: int = 0,
) -> bytes:
    return HEADER.pack(magic, version, kind, encoding, reserved, raw_len) + body


def frame_with_declared_size(raw: bytes, declared: int) -> bytes:
    """A real zstd frame of ``raw`` whose header lies: it declares ``declared`` bytes of content."""
    frame = bytearray(zstandard.ZstdCompressor(write_content_size=True).compress(raw))
    params = zstandard.get_frame_parameters(bytes(frame))
    assert params.content_size == len(raw) and 1 << 16 <= len(raw) < 1 << 32  # a 4-byte FCS field
    single_segment = (frame[4] >> 5) & 1
    pos = 5 + (0 if single_segment else 1)
    frame[pos : pos + 4] = struct.pack("<I", declared)
    return bytes(frame)


def assert_refused_within(data: bytes, expected_len: int, limit_bytes: int = 4 << 20) -> None:
    """Decoding ``data`` must raise IntegrityError having allocated less than ``limit_bytes``."""
    tracemalloc.start()
    try:
        with pytest.raises(IntegrityError):
            decode(data, Kind.CHUNK, LIMIT, expected_len=expected_len)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < limit_bytes


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=5000), st.sampled_from([Kind.CHUNK, Kind.COMMIT]))
def test_round_trip_and_size_bound(raw: bytes, kind: Kind) -> None:
    data = encode(raw, kind, 3)
    assert len(data) <= len(raw) + HEADER_SIZE
    assert decode(data, kind, LIMIT, expected_len=len(raw)) == raw
    assert decode(data, kind, LIMIT) == raw


def test_compressible_is_zstd_incompressible_is_raw() -> None:
    zeros = bytes(100_000)
    assert parse_header(encode(zeros, Kind.CHUNK, 3)).encoding == Encoding.ZSTD
    assert len(encode(zeros, Kind.CHUNK, 3)) < 1000
    noise = os.urandom(100_000)
    data = encode(noise, Kind.CHUNK, 3)
    assert parse_header(data).encoding == Encoding.RAW
    assert len(data) == len(noise) + HEADER_SIZE
    assert decode(data, Kind.CHUNK, LIMIT, len(noise)) == noise


def test_wrong_kind_refused() -> None:
    data = encode(b"hello" * 100, Kind.CHUNK, 3)
    with pytest.raises(IntegrityError, match="chunk, expected a commit"):
        decode(data, Kind.COMMIT, LIMIT)


def test_wrong_expected_length_refused() -> None:
    data = encode(b"hello" * 100, Kind.CHUNK, 3)
    with pytest.raises(IntegrityError, match="manifest says 499"):
        decode(data, Kind.CHUNK, LIMIT, expected_len=499)


def test_header_length_over_limit_refused() -> None:
    with pytest.raises(IntegrityError, match="more than the limit"):
        decode(obj(b"", 1 << 40, Encoding.RAW), Kind.CHUNK, LIMIT)


def test_bomb_declaring_huge_size_refused_without_allocating() -> None:
    # The frame claims ~4 GiB while the object header (and manifest) say 64 KiB.
    frame = frame_with_declared_size(bytes(1 << 16), 0xFFFF_FFF0)
    assert_refused_within(obj(frame, 1 << 16), 1 << 16)
    # The object header may lie too: it must still agree with the manifest before anything else.
    assert_refused_within(obj(frame, 0xFFFF_FFF0), 1 << 16)


def test_frame_underdeclaring_its_content_refused_without_allocating() -> None:
    # A 16 MiB frame of zeros that declares 64 KiB: decoding must stop at the declared size.
    frame = frame_with_declared_size(bytes(1 << 24), 1 << 16)
    assert_refused_within(obj(frame, 1 << 16), 1 << 16)


def test_frame_without_content_size_refused() -> None:
    raw = b"abc" * 1000
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(raw)
    with pytest.raises(IntegrityError):
        decode(obj(frame, len(raw)), Kind.CHUNK, LIMIT, len(raw))


def test_trailing_data_refused() -> None:
    raw = b"abc" * 1000
    data = encode(raw, Kind.CHUNK, 3)
    with pytest.raises(IntegrityError, match="trailing"):
        decode(data + b"\0", Kind.CHUNK, LIMIT, len(raw))
    with pytest.raises(IntegrityError, match="trailing"):
        decode(data + data[HEADER_SIZE:], Kind.CHUNK, LIMIT, len(raw))  # a second whole frame
    noise = os.urandom(100)
    with pytest.raises(IntegrityError):
        decode(encode(noise, Kind.CHUNK, 3) + b"x", Kind.CHUNK, LIMIT, len(noise))


@pytest.mark.parametrize("cut", [1, 3, 10])
def test_truncated_frame_refused(cut: int) -> None:
    raw = os.urandom(2000) * 20
    data = encode(raw, Kind.CHUNK, 3)
    assert parse_header(data).encoding == Encoding.ZSTD
    with pytest.raises(IntegrityError):
        decode(data[:-cut], Kind.CHUNK, LIMIT, len(raw))


def test_truncated_raw_body_and_header_refused() -> None:
    noise = os.urandom(100)
    data = encode(noise, Kind.CHUNK, 3)
    with pytest.raises(IntegrityError):
        decode(data[:-1], Kind.CHUNK, LIMIT, len(noise))
    for n in (0, 1, HEADER_SIZE - 1):
        with pytest.raises(IntegrityError, match="shorter than"):
            decode(data[:n], Kind.CHUNK, LIMIT)


@pytest.mark.parametrize(
    "field, kwargs, message",
    [
        ("magic", {"magic": b"CKSX"}, "magic"),
        ("version", {"version": 2}, "version"),
        ("reserved", {"reserved": 1}, "reserved"),
        ("kind", {"kind": 9}, "kind"),  # type: ignore[dict-item]
        ("encoding", {"encoding": 7}, "encoding"),  # type: ignore[dict-item]
    ],
)
def test_bad_header_fields_refused(field: str, kwargs: dict, message: str) -> None:
    with pytest.raises(IntegrityError, match=message):
        decode(obj(b"abc", 3, **{"encoding": Encoding.RAW, **kwargs}), Kind.CHUNK, LIMIT)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=1, max_size=300), st.data())
def test_mutated_objects_raise_only_integrity_error(raw: bytes, data: st.DataObject) -> None:
    encoded = bytearray(encode(raw * 3, Kind.CHUNK, 3))
    i = data.draw(st.integers(0, len(encoded) - 1))
    encoded[i] = data.draw(st.integers(0, 255))
    try:
        out = decode(bytes(encoded), Kind.CHUNK, LIMIT, expected_len=len(raw) * 3)
    except IntegrityError:
        return
    assert len(out) == len(raw) * 3  # a change the codec cannot see is caught by the hash check
