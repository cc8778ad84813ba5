"""Tests for ckstore.format.pack: round trips, the layout of docs/format.md, and hostile input.

The hostile packs and indexes are built here with this file's own encoder, written from the
byte layout in docs/format.md rather than with ckstore.format.pack's, so the checks also test that the
module and the spec agree.
"""

from __future__ import annotations

import os
import struct

import blake3
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckstore.codecs.objects import HEADER_SIZE, Kind, decode, encode
from ckstore.errors import IntegrityError
from ckstore.format import pack, pack_build
from ckstore.format.ids import chunk_id
from ckstore.repository.store import MAX_CHUNK_SIZE, MAX_COMMIT_SIZE


def stored_object(raw: bytes) -> tuple[str, bytes]:
    return chunk_id(raw), encode(raw, Kind.CHUNK, 3)


def make_objects(n: int, size: int = 200) -> list[tuple[str, bytes]]:
    return [stored_object(os.urandom(size + i)) for i in range(n)]


# ---- an independent encoder, from docs/format.md ----------------------------------------------


Row = tuple  # (id, offset, length) or, version 2, (id, offset, length, BLAKE3 of the stored bytes)


def spec_table(rows: list[Row], version: int) -> bytes:
    """40-byte entries (version 1) or 72-byte ones (version 2: a row without its digest gets
    zeros, for tables that must be refused before any digest is looked at)."""
    if version == 1:
        return b"".join(struct.pack("<32sII", *r[:3]) for r in rows)
    return b"".join(struct.pack("<32sII32s", *r[:3], r[3] if len(r) > 3 else b"\0" * 32) for r in rows)


def spec_pack(
    objects: list[bytes],
    rows: list[Row],
    *,
    count: int | None = None,
    version: int = 2,
    magic: bytes = b"CKPK",
    reserved: bytes = b"\0\0\0",
    checksum: bytes | None = None,
    header_version: int | None = None,
) -> bytes:
    table = spec_table(rows, version if version in (1, 2) else 2)
    digest = blake3.blake3(table).digest() if checksum is None else checksum
    trailer = struct.pack("<IB3s32s4s", len(rows) if count is None else count, version, reserved, digest, magic)
    head = b"CKPK" + bytes([version if header_version is None else header_version]) + b"\0\0\0"
    return head + b"".join(objects) + table + trailer


def spec_index(
    pack_id: bytes,
    size: int,
    rows: list[Row],
    *,
    count: int | None = None,
    version: int = 2,
    reserved: bytes = b"\0\0\0",
) -> bytes:
    body = struct.pack(
        "<4sB3s32sQI4s", b"CKPI", version, reserved, pack_id, size, len(rows) if count is None else count, b"\0\0\0\0"
    ) + spec_table(rows, version if version in (1, 2) else 2)
    return body + blake3.blake3(body).digest()


def layout(objects: list[tuple[str, bytes]], version: int = 2) -> list[Row]:
    """Rows for objects laid out back to back from offset 8, sorted by id."""
    rows, offset = [], 8
    for oid, data in objects:
        rows.append((bytes.fromhex(oid), offset, len(data)) + ((blake3.blake3(data).digest(),) if version == 2 else ()))
        offset += len(data)
    return sorted(rows)


def test_builder_output_matches_the_spec_layout() -> None:
    objects = make_objects(4)
    builder = pack_build.PackBuilder()
    streamed = [builder.header]
    for oid, data in objects:
        builder.add(oid, data)
        streamed.append(data)  # the caller sends each object right after adding it
    tail, index = builder.close()
    rows = layout(objects)
    expected = spec_pack([d for _, d in objects], rows)
    assert b"".join([*streamed, tail]) == expected
    assert index.pack_size == len(expected) and index.pack_id == builder.pack_id
    assert index.to_bytes() == spec_index(bytes.fromhex(builder.pack_id), len(expected), rows)
    # 72 bytes an object in the index, plus a fixed 88.
    assert len(index.to_bytes()) == 56 + 72 * 4 + 32
    with pytest.raises(ValueError, match="closed"):
        builder.add(*make_objects(1)[0])


def test_pack_names_are_chosen_before_the_bytes_and_never_repeat() -> None:
    """A pack's name is random (docs/format.md 15.1): the same objects packed twice make two
    packs with the same bytes under different names, and a given name is used as given."""
    objects = make_objects(2)
    first, second = (next(pack_build.pack_objects(objects)) for _ in range(2))
    assert first.data == second.data and first.name != second.name
    assert pack_build.PackBuilder(pack_id="ab" * 32).pack_id == "ab" * 32
    with pytest.raises(ValueError, match="invalid pack id"):
        pack_build.PackBuilder(pack_id="not hex")


def test_round_trip_and_one_ranged_read_per_object() -> None:
    objects = make_objects(6)
    (built,) = pack_build.pack_objects(objects)
    index = pack.parse_index(built.index_data, built.name)
    assert index == built.index == pack.parse_pack(built.data, built.name)
    for oid, data in objects:
        entry = index.find(oid)
        assert entry is not None and oid in index
        ranged = built.data[entry.offset : entry.offset + entry.length]  # what one GET returns
        pack.check_read(ranged, entry, built.name)
        assert bytes(pack.object_bytes(built.data, entry)) == data == ranged
        header_len = int.from_bytes(data[8:16], "little")
        assert chunk_id(decode(ranged, Kind.CHUNK, MAX_CHUNK_SIZE, header_len)) == oid
    assert index.find("0" * 64) is None
    assert [e.id for e in index.in_pack_order()] == [oid for oid, _ in objects]


def test_index_rebuilt_from_the_tail() -> None:
    objects = make_objects(5)
    (built,) = pack_build.pack_objects(objects)
    need = pack.tail_length(built.data[-pack.TRAILER.size :], len(built.data), built.name)
    assert need == pack.TRAILER.size + 72 * 5
    assert pack.index_from_tail(built.data[-need:], len(built.data), built.name) == built.index
    assert pack.index_from_tail(built.data[-pack.TAIL_GUESS :], len(built.data), built.name) == built.index
    with pytest.raises(ValueError):
        pack.index_from_tail(built.data[-(need - 1) :], len(built.data), built.name)


def test_packs_split_at_the_target_size() -> None:
    objects = make_objects(20, size=1000)
    packs = list(pack_build.pack_objects(objects, target_size=4000))
    assert len(packs) > 4
    assert all(len(p.data) <= 4000 for p in packs)
    got = [e.id for p in packs for e in p.index.in_pack_order()]
    assert got == [oid for oid, _ in objects]
    # No pack could have taken its successor's first object.
    for p, nxt in zip(packs, packs[1:]):
        first = nxt.index.in_pack_order()[0]
        assert len(p.data) + first.length + pack.ENTRY.size > 4000


def test_an_object_larger_than_the_target_gets_its_own_pack() -> None:
    small = make_objects(2, size=100)
    big = stored_object(os.urandom(5000))
    packs = list(pack_build.pack_objects([small[0], big, small[1]], target_size=1000))
    assert [len(p.index) for p in packs] == [1, 1, 1]
    assert packs[1].index.entries[0].id == big[0] and len(packs[1].data) > 1000


def test_pack_objects_stores_a_repeated_object_once() -> None:
    objects = make_objects(3)
    (built,) = pack_build.pack_objects(objects + objects[:2])
    assert len(built.index) == 3


def test_builder_refuses_misuse() -> None:
    builder = pack_build.PackBuilder(10_000)
    oid, data = stored_object(b"x" * 100)
    with pytest.raises(ValueError, match="empty pack"):
        builder.close()
    with pytest.raises(ValueError, match="invalid object id"):
        builder.add("ABC", data)
    builder.add(oid, data)
    with pytest.raises(ValueError, match="already in this pack"):
        builder.add(oid, data)
    with pytest.raises(IntegrityError, match="magic"):
        builder.add("1" * 64, b"not a stored object at all")
    with pytest.raises(ValueError):
        pack_build.PackBuilder(0)
    with pytest.raises(ValueError):
        pack_build.PackBuilder(pack.MAX_PACK_SIZE + 1)


def test_limits_agree_with_the_store() -> None:
    # The largest stored object is a manifest stored raw: codec never grows an object by more
    # than its header (docs/format.md section 4).
    assert pack.MAX_OBJECT_LENGTH == MAX_COMMIT_SIZE + HEADER_SIZE
    assert MAX_CHUNK_SIZE + HEADER_SIZE <= pack.MAX_OBJECT_LENGTH
    assert pack.DEFAULT_TARGET_SIZE == 32 << 20


def test_version_1_packs_and_indexes_stay_readable() -> None:
    """Packs pushed before digests were recorded: parsed as before, entries without a digest,
    and check_read says their objects still need decoding."""
    objects = make_objects(3)
    rows = layout(objects, version=1)
    data = spec_pack([d for _, d in objects], rows, version=1)
    name = blake3.blake3(data).hexdigest()
    index = pack.parse_index(spec_index(bytes.fromhex(name), len(data), rows, version=1), name)
    assert index == pack.parse_pack(data, name) and index.version == 1
    need = pack.tail_length(data[-pack.TRAILER.size :], len(data), name)
    assert need == pack.TRAILER.size + 40 * 3
    assert pack.index_from_tail(data[-need:], len(data), name) == index
    assert index.to_bytes() == spec_index(bytes.fromhex(name), len(data), rows, version=1)
    for e in index.entries:
        assert e.digest is None
        assert pack.check_read(data[e.offset : e.end], e, name) is False


def test_digests_catch_a_damaged_object_without_decoding_it() -> None:
    objects = make_objects(3)
    (built,) = pack_build.pack_objects(objects)
    assert built.index.version == 2
    for e in built.index.entries:
        good = built.data[e.offset : e.end]
        assert e.digest == blake3.blake3(good).digest()
        assert pack.check_read(good, e, built.name) is True
        bad = good[:-1] + bytes([good[-1] ^ 1])
        with pytest.raises(IntegrityError, match=f"object {e.id} is corrupt: .*pack {built.name}.*digest"):
            pack.check_read(bad, e, built.name)
    # A pack whose table records a wrong digest is refused.
    rows = [(i, o, n, b"\1" * 32) for i, o, n, _ in layout(objects)]
    data = spec_pack([d for _, d in objects], rows)
    with pytest.raises(IntegrityError, match="digest"):
        pack.parse_pack(data, blake3.blake3(data).hexdigest())


def test_check_read_names_a_truncated_pack() -> None:
    (built,) = pack_build.pack_objects(make_objects(2))
    entry = built.index.entries[0]
    with pytest.raises(IntegrityError, match=f"pack {built.name} is truncated"):
        pack.check_read(built.data[entry.offset : entry.end - 1], entry, built.name)
    with pytest.raises(IntegrityError):
        pack.object_bytes(built.data[: entry.end - 1], entry)


# ---- hostile packs and indexes ----------------------------------------------------------------


def _two(version: int = 2) -> tuple[list[tuple[str, bytes]], list[Row]]:
    objects = make_objects(2)
    return objects, layout(objects, version)


def _swap_rows(rows: list[tuple[bytes, int, int]]) -> list[tuple[bytes, int, int]]:
    return [rows[1], rows[0]]


@pytest.mark.parametrize(
    "case, message",
    [
        ("duplicate", "listed twice"),
        ("unsorted", "not sorted"),
        ("hole", "a hole"),
        ("overlap", "overlapping"),
        ("past_end", "past the object area"),
        ("unlisted_tail", "not listed"),
        ("short_length", "impossible length"),
        ("huge_length", "impossible length"),
    ],
)
@pytest.mark.parametrize("version", [1, 2])
def test_bad_tables_are_refused_in_packs_and_indexes(case: str, message: str, version: int) -> None:
    """Version 2 rows here carry zero digests: the structure must be refused before them."""
    objects, rows = _two(1)
    datas = [d for _, d in objects]
    (i0, o0, n0), (i1, o1, n1) = rows
    extra = b""
    if case == "duplicate":
        rows = [(i0, o0, n0), (i0, o1, n1)]
    elif case == "unsorted":
        rows = _swap_rows(rows)
    elif case == "hole":
        extra = b"\0" * 16
        first, second = sorted(rows, key=lambda r: r[1])
        rows = sorted([first, (second[0], second[1] + 16, second[2])])
        datas = [datas[0], extra, datas[1]]
    elif case == "overlap":
        first, second = sorted(rows, key=lambda r: r[1])
        rows = sorted([first, (second[0], second[1] - 1, second[2] + 1)])
    elif case == "past_end":
        first, second = sorted(rows, key=lambda r: r[1])
        rows = sorted([first, (second[0], second[1], second[2] + 100)])
    elif case == "unlisted_tail":
        datas = [*datas, b"\0" * 20]
    elif case == "short_length":
        rows = [(i0, o0, 15), (i1, o1, n1)]
    elif case == "huge_length":
        rows = [(i0, o0, pack.MAX_OBJECT_LENGTH + 1), (i1, o1, n1)]
    data = spec_pack(datas, rows, version=version)
    name = blake3.blake3(data).hexdigest()
    with pytest.raises(IntegrityError, match=message):
        pack.parse_pack(data, name)
    with pytest.raises(IntegrityError, match=message):
        pack.parse_index(spec_index(bytes.fromhex(name), len(data), rows, version=version), name)


def test_valid_spec_pack_is_accepted() -> None:
    objects, rows = _two()
    data = spec_pack([d for _, d in objects], rows)
    name = blake3.blake3(data).hexdigest()
    assert len(pack.parse_pack(data, name)) == 2
    assert len(pack.parse_index(spec_index(bytes.fromhex(name), len(data), rows), name)) == 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"magic": b"CKPX"}, "magic"),
        ({"version": 9, "header_version": 2}, "unknown version 9 in its trailer"),
        ({"header_version": 1}, "header says version 1, its trailer 2"),
        ({"reserved": b"\0\1\0"}, "reserved"),
        ({"checksum": b"\0" * 32}, "checksum"),
        ({"count": 0}, "out of range"),
        ({"count": pack.MAX_PACK_OBJECTS + 1}, "out of range"),
        ({"count": 3}, "cannot fit|checksum|tile|hole|overlap|impossible|sorted|twice|listed"),
        ({"count": 1000}, "cannot fit"),
    ],
)
def test_bad_trailers_are_refused(kwargs: dict, message: str) -> None:
    objects, rows = _two()
    data = spec_pack([d for _, d in objects], rows, **kwargs)
    with pytest.raises(IntegrityError, match=message):
        pack.parse_pack(data, "5" * 64)


def test_bad_pack_headers_and_names() -> None:
    objects, rows = _two()
    good = spec_pack([d for _, d in objects], rows)
    # The name is not checked against the bytes (packs are named at random), only reported.
    assert pack.parse_pack(good, "0" * 64).pack_id == "0" * 64
    for bad, message in (
        (b"XKPK" + good[4:], "magic"),
        (good[:4] + b"\x09" + good[5:], "version"),
        (good[:5] + b"\x01" + good[6:], "reserved"),
    ):
        with pytest.raises(IntegrityError, match=message):
            pack.parse_pack(bad, "0" * 64)
    broken = bytearray(good)
    broken[8:12] = b"XXXX"  # the first object's magic
    with pytest.raises(IntegrityError, match="does not start with the ckstore magic"):
        pack.parse_pack(bytes(broken), "0" * 64)
    with pytest.raises(IntegrityError, match="too small"):
        pack.parse_pack(good[:40], "0" * 64)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda b: b"CKPX" + b[4:], "magic"),
        (lambda b: b[:4] + b"\x09" + b[5:], "version"),
        (lambda b: b[:5] + b"\x01" + b[6:], "reserved"),
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "checksum"),
        (lambda b: b[:-1], "bytes"),
        (lambda b: b + b"\0", "bytes"),
        (lambda b: b[:20], "shorter"),
    ],
)
def test_bad_indexes_are_refused(mutate, message: str) -> None:
    (built,) = pack_build.pack_objects(make_objects(3))
    with pytest.raises(IntegrityError, match=message):
        pack.parse_index(mutate(built.index_data), built.name)


def test_index_counts_and_sizes_are_bounded() -> None:
    objects, rows = _two()
    pid = b"\1" * 32
    for kwargs, size, message in (
        ({"count": 0}, 1000, "out of range"),
        ({"count": pack.MAX_PACK_OBJECTS + 1}, 1000, "out of range"),
        ({"count": 5}, 1000, "implies"),
        ({}, pack.MAX_PACK_SIZE + 1, "exceeds the limit"),
        ({}, 30, "too small"),
        ({}, 10_000, "past the object area|not listed"),
    ):
        with pytest.raises(IntegrityError, match=message):
            pack.parse_index(spec_index(pid, size, rows, **kwargs))
    with pytest.raises(IntegrityError, match="describes pack"):
        pack.parse_index(spec_index(pid, 1000, rows), "2" * 64)
    with pytest.raises(IntegrityError, match="reserved"):
        pack.parse_index(spec_index(pid, 1000, rows, reserved=b"\0\0\1"))
    with pytest.raises(IntegrityError, match="version"):
        pack.parse_index(spec_index(pid, 1000, rows, version=9))


# ---- property tests ---------------------------------------------------------------------------

blobs = st.lists(st.binary(min_size=0, max_size=3000), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(blobs, st.integers(min_value=100, max_value=20_000), st.sampled_from([Kind.CHUNK, Kind.COMMIT]))
def test_property_round_trip(raws: list[bytes], target: int, kind: Kind) -> None:
    objects = [(chunk_id(r), encode(r, kind, 1)) for r in raws]
    unique = dict(objects)
    packs = list(pack_build.pack_objects(objects, target))
    assert sum(len(p.index) for p in packs) == len(unique)
    for p in packs:
        assert len(p.data) <= target or len(p.index) == 1
        assert pack.parse_pack(p.data, p.name) == p.index
        assert pack.parse_index(p.index_data, p.name) == p.index
        need = pack.tail_length(p.data[-pack.TRAILER.size :], len(p.data), p.name)
        assert pack.index_from_tail(p.data[-need:], len(p.data), p.name) == p.index
        for e in p.index.entries:
            assert bytes(p.data[e.offset : e.end]) == unique[e.id]


def _mutations() -> st.SearchStrategy:
    flip = st.tuples(st.just("flip"), st.integers(min_value=0), st.integers(min_value=1, max_value=255))
    cut = st.tuples(st.just("truncate"), st.integers(min_value=0), st.just(0))
    grow = st.tuples(st.just("insert"), st.integers(min_value=0), st.integers(min_value=0, max_value=255))
    drop = st.tuples(st.just("delete"), st.integers(min_value=0), st.just(0))
    return st.lists(st.one_of(flip, cut, grow, drop), min_size=1, max_size=4)


def _apply(data: bytes, ops: list[tuple[str, int, int]]) -> bytes:
    b = bytearray(data)
    for op, pos, val in ops:
        if not b:
            break
        i = pos % len(b)
        if op == "flip":
            b[i] ^= val
        elif op == "truncate":
            del b[i:]
        elif op == "insert":
            b.insert(i, val)
        else:
            del b[i]
    return bytes(b)


# Built once: hypothesis varies the mutations, not the pack.
_FUZZ = next(pack_build.pack_objects(make_objects(4, size=60)))


@settings(max_examples=400, deadline=None)
@given(_mutations())
def test_fuzz_mutated_packs_and_indexes_raise_only_integrity_errors(ops: list[tuple[str, int, int]]) -> None:
    data = _apply(_FUZZ.data, ops)
    idx = _apply(_FUZZ.index_data, ops)
    changed = data != _FUZZ.data
    for call in (
        lambda: pack.parse_pack(data, _FUZZ.name),
        lambda: pack.parse_index(idx, _FUZZ.name),
        lambda: pack.parse_index(idx),
        lambda: pack.index_from_tail(data, len(data), _FUZZ.name),
    ):
        try:
            call()
        except IntegrityError:
            pass
    if changed:
        # Not by its name (packs are named at random) but by what covers every byte: the header
        # fields, each object's digest, the table's checksum and the trailer.
        with pytest.raises(IntegrityError):
            pack.parse_pack(data, _FUZZ.name)
    if idx != _FUZZ.index_data:
        # The checksum covers every byte, so any change to an index is caught.
        with pytest.raises(IntegrityError):
            pack.parse_index(idx, _FUZZ.name)


@given(
    st.lists(st.sampled_from(range(12)), max_size=30), st.lists(st.text("0123456789abcdefxz", max_size=66), max_size=4)
)
def test_objects_located_together_are_where_find_puts_them(picks: list[int], odd: list[str]) -> None:
    """gc's bulk header reads locate many objects at once (``locate_many``): in a table read
    from the pack's tail (arrays) and in a built index alike, each found where ``find`` finds it,
    in the order asked, absent and malformed ids left out."""
    objects = make_objects(8)
    (built,) = pack_build.pack_objects(objects)
    table = pack.table_from_tail(built.data[-pack.TAIL_GUESS :], len(built.data), built.name)
    candidates = [oid for oid, _ in objects] + [chunk_id(bytes([i])) for i in range(4)]
    asked = [candidates[i] for i in picks] + odd
    expected = [(i, e.offset, e.length) for i, oid in enumerate(asked) if (e := built.index.find(oid)) is not None]
    for index in (table, built.index):
        positions, offsets, lengths = index.locate_many(asked)
        assert list(zip(positions.tolist(), offsets.tolist(), lengths.tolist())) == expected
