"""Pack files and pack indexes: many stored objects in one file (pure, no I/O).

Objects travel to and live on a remote in packs, because one request per ~1 MiB chunk is the
wrong grain for object storage (a 10 GB checkpoint would be ~10,000 requests) and for network
drives. A pack is the concatenation of stored objects exactly as the loose store holds them
(codecs/objects.py: 16-byte header + body, never re-encoded), framed by a small header and followed by
its own table of contents; a separate index file repeats that table with the pack's name and
size, so a client learns what every pack holds by fetching only indexes (72 bytes an object),
and reads any one object with a single ranged GET. docs/format.md ("Remote repositories and
packs") is the normative layout; in short:

    pack  = "CKPK" ver 0 0 0 | object ... object | table | trailer
    table = count x (id[32] offset u32 length u32 blake3(stored bytes)[32]), sorted by id
    trailer = count u32 | ver u8 | 0 0 0 | blake3(table)[32] | "CKPK"
    index = "CKPI" ver 0 0 0 | pack id[32] | pack size u64 | count u32 | 0 0 0 0 | table | blake3[32]

Version 2 (written now) records in each entry the BLAKE3 of the object's stored bytes, so a
reader checks what a ranged read returned with one hash of those bytes, without decoding them
(docs/design.md, "Verification on arrival"); version 1 entries lack it (40 bytes, not 72) and
stay readable: their objects are checked by decoding them, as before.

Why a pack's name is random rather than the hash of its bytes (as it was before): a name that
depends on the bytes is known only once the last object is in, so a pusher would have to read
and verify a whole pack before the first byte of it could leave; a name chosen up front lets the
upload run while the pack is being made (push.py). Nothing needs the content name: each object
is checked against the digest its entry records, the table against the trailer's checksum, the
index against its own, and two packs holding the same object are allowed anyway.

Why a table inside the pack as well as the index file (restic does the same): the pack alone
is then self-describing, so a lost or damaged index is rebuilt from the pack's tail with one or
two ranged reads, and fsck can check a pack without trusting anything else. Why sorted by id:
the bytes of an index are canonical (one pack, one index) and a duplicate is an adjacent pair.

An entry carries its object id because the id is the hash of the *decoded* bytes: nothing in
the stored bytes names the object. Parsing is strict, like safetensors.py: every count,
offset and length is checked against hard limits before use, the entries must tile the object
area exactly (no hole, no overlap, no trailing byte), checksums must match, and every failure is
an IntegrityError naming the pack.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import blake3

from ckstore.codecs.objects import HEADER_SIZE, parse_header
from ckstore.errors import IntegrityError
from ckstore.format.ids import is_object_id

PACK_MAGIC = b"CKPK"
INDEX_MAGIC = b"CKPI"
PACK_VERSION = 2  # what writers write
PACK_HEADER = struct.Struct("<4sB3s")
ENTRY_V1 = struct.Struct("<32sII")
ENTRY = struct.Struct("<32sII32s")
# Entry layout by version: readers accept both.
ENTRIES = {1: ENTRY_V1, 2: ENTRY}
TRAILER = struct.Struct("<IB3s32s4s")
INDEX_HEADER = struct.Struct("<4sB3s32sQI4s")
CHECKSUM_SIZE = 32
ZERO3 = b"\0\0\0"
ZERO4 = b"\0\0\0\0"

DEFAULT_TARGET_SIZE = 32 << 20
# Offsets and lengths are u32: packs are tens of MiB, and the limit keeps a hostile index from
# naming ranges no pack can have.
MAX_PACK_SIZE = (1 << 32) - 1
# Bounds the memory a hostile count can make a reader allocate (40 MiB of table at most).
MAX_PACK_OBJECTS = 1 << 20
# The largest stored object: a manifest of store.MAX_COMMIT_SIZE stored raw behind its header
# (codec never stores an object larger than raw + header).
MAX_OBJECT_LENGTH = (1 << 30) + HEADER_SIZE
# A reader that rebuilds an index from a pack first fetches this many bytes of its tail: enough
# for the table of a full 32 MiB pack of 1 MiB chunks with room to spare.
TAIL_GUESS = 64 << 10


@dataclass(frozen=True)
class PackEntry:
    """Where one stored object lies in its pack."""

    id: str
    offset: int
    length: int
    # BLAKE3-256 of the stored bytes (pack version 2); None in a version 1 pack.
    digest: bytes | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class PackIndex:
    """The validated contents of one pack: its name, size and entries sorted by object id."""

    pack_id: str
    pack_size: int
    entries: tuple[PackEntry, ...]
    version: int = PACK_VERSION
    _by_id: dict[str, PackEntry] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_id", {e.id: e for e in self.entries})

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, oid: object) -> bool:
        return oid in self._by_id

    def find(self, oid: str) -> PackEntry | None:
        return self._by_id.get(oid)

    def in_pack_order(self) -> list[PackEntry]:
        return sorted(self.entries, key=lambda e: e.offset)

    def columns(self) -> tuple[list[str], list[int], list[int]]:
        """(ids, offsets, lengths) of every entry, in table order (as ``PackTable.columns``)."""
        return [e.id for e in self.entries], [e.offset for e in self.entries], [e.length for e in self.entries]

    def locate_many(self, oids: Sequence[str]) -> tuple[Any, Any, Any]:
        """As ``PackTable.locate_many``."""
        import numpy as np  # only bulk readers of packs pay its import

        found = [(i, e.offset, e.length) for i, oid in enumerate(oids) if (e := self._by_id.get(oid)) is not None]
        columns = np.array(found, dtype=np.int64).reshape(len(found), 3)
        return columns[:, 0], columns[:, 1], columns[:, 2]

    def to_bytes(self) -> bytes:
        """The index file for this pack (section "Pack index" of docs/format.md)."""
        return encode_index(self.pack_id, self.pack_size, self.entries, self.version)


def table_bytes(entries: Iterable[PackEntry], version: int) -> bytes:
    """A pack's (and its index's) table of entries, in the given order, in ``version``'s layout."""
    if version == 1:
        return b"".join(ENTRY_V1.pack(bytes.fromhex(e.id), e.offset, e.length) for e in entries)
    rows = list(entries)
    if any(e.digest is None for e in rows):
        raise ValueError(f"a version {version} table needs every entry's digest")
    return b"".join(ENTRY.pack(bytes.fromhex(e.id), e.offset, e.length, e.digest) for e in rows)


def encode_index(pack_id: str, pack_size: int, entries: Iterable[PackEntry], version: int = PACK_VERSION) -> bytes:
    """Index file bytes; ``entries`` must be sorted by id (PackIndex.entries always are)."""
    rows = list(entries)
    body = INDEX_HEADER.pack(
        INDEX_MAGIC,
        version,
        ZERO3,
        bytes.fromhex(pack_id),
        pack_size,
        len(rows),
        ZERO4,
    ) + table_bytes(rows, version)
    return body + blake3.blake3(body).digest()


# ---- parsing ----------------------------------------------------------------------------------


def _fail(what: str, reason: str) -> IntegrityError:
    return IntegrityError(f"{what} is corrupt: {reason}")


def _table_arrays(
    table: bytes | memoryview, count: int, data_end: int, what: str, version: int, validated: bool = False
) -> _Arrays:
    """The columns of a table whose objects must tile ``[PACK_HEADER.size, data_end)`` exactly,
    validated with array operations (one Python object per entry cost 2-3 s at 10^5 objects);
    the first error is the one a walk in table order, then in offset order, would meet.
    ``validated``: these exact bytes passed this check before (a cached index whose checksum
    still matches): only the columns are taken."""
    import numpy as np  # only readers of packs pay its import

    layout = ENTRIES[version]
    assert len(table) == count * layout.size
    rows = np.frombuffer(table, dtype=np.uint8).reshape(count, layout.size)
    ids = np.ascontiguousarray(rows[:, :32]).view("S32").reshape(count)
    offsets = np.ascontiguousarray(rows[:, 32:36]).view("<u4").reshape(count).astype(np.int64)
    lengths = np.ascontiguousarray(rows[:, 36:40]).view("<u4").reshape(count).astype(np.int64)
    digests = np.ascontiguousarray(rows[:, 40:72]).view("S32").reshape(count) if version >= 2 else None
    if validated:
        return _Arrays(ids, offsets, lengths, digests)
    words = np.ascontiguousarray(rows[:, :32]).view(">u8")  # each id as 4 big-endian words
    differ = words[1:] != words[:-1]
    first = differ.argmax(axis=1)
    step = np.arange(count - 1)
    ascending = differ.any(axis=1) & (words[:-1][step, first] < words[1:][step, first])
    bad_order = np.flatnonzero(~ascending) + 1  # the row that breaks the order
    bad_length = np.flatnonzero((lengths < HEADER_SIZE) | (lengths > MAX_OBJECT_LENGTH))
    row = min(bad_order[0] if bad_order.size else count, bad_length[0] if bad_length.size else count)
    if row < count:
        raw_id = rows[row, :32].tobytes()
        if bad_order.size and bad_order[0] == row:
            twice = not differ[row - 1].any()
            raise _fail(what, "an object is listed twice" if twice else "entries are not sorted by object id")
        raise _fail(what, f"object {raw_id.hex()} has impossible length {int(lengths[row])}")
    order = np.argsort(offsets, kind="stable")
    starts, ends = offsets[order], offsets[order] + lengths[order]
    expected = np.concatenate(([PACK_HEADER.size], ends[:-1]))
    bad = np.flatnonzero((starts != expected) | (ends > data_end))
    if bad.size:
        i = int(bad[0])
        oid = rows[order[i], :32].tobytes().hex()
        start, should = int(starts[i]), int(expected[i])
        if start != should:
            kind = "a hole" if start > should else "overlapping objects"
            raise _fail(what, f"{kind} at offset {min(start, should)} (object {oid})")
        raise _fail(what, f"object {oid} ends at {int(ends[i])}, past the object area ({data_end})")
    if int(ends[-1]) != data_end:
        raise _fail(what, f"{data_end - int(ends[-1])} bytes after the last object are not listed")
    return _Arrays(ids, offsets, lengths, digests)


@dataclass(frozen=True)
class _Arrays:
    ids: Any  # numpy "S32": raw ids, sorted
    offsets: Any  # numpy int64
    lengths: Any  # numpy int64
    digests: Any  # numpy "S32", or None (version 1)

    def entries(self) -> tuple[PackEntry, ...]:
        digests = _whole(self.digests) if self.digests is not None else [None] * len(self.ids)
        return tuple(
            PackEntry(i.hex(), o, n, d)
            for i, o, n, d in zip(self._raw_ids(), self.offsets.tolist(), self.lengths.tolist(), digests)
        )

    def _raw_ids(self) -> list[bytes]:
        return _whole(self.ids)


def _whole(column: Any) -> list[bytes]:
    """The 32-byte values of an "S32" column ("S" arrays drop trailing zero bytes on the way out)."""
    return [v.ljust(32, b"\0") for v in column.tolist()]


class PackTable:
    """A validated pack table kept as arrays: an object is found by binary search, and no
    Python object exists per entry until asked for (``entries``). Local packs of 10^5 small
    objects are read this way (backend/local_packs.py); same reading API as ``PackIndex``."""

    # After this many lookups a table builds a dict of its ids: a binary search through numpy
    # costs ~5 us a call, a dict ~0.2 us, and building the dict ~0.3 us an entry.
    SEARCHES_BEFORE_DICT = 256

    def __init__(self, pack_id: str, pack_size: int, arrays: _Arrays, version: int) -> None:
        self.pack_id, self.pack_size, self.version = pack_id, pack_size, version
        self._arrays = arrays
        self._searches = 0
        self._rows: dict[bytes, int] | None = None

    def __len__(self) -> int:
        return len(self._arrays.ids)

    def _row(self, oid: str) -> int | None:
        if not is_object_id(oid):
            return None
        key = bytes.fromhex(oid)
        if self._rows is not None:
            return self._rows.get(key)
        self._searches += 1
        if self._searches > self.SEARCHES_BEFORE_DICT:  # races only build it twice
            self._rows = dict(zip(self._arrays._raw_ids(), range(len(self))))
            return self._rows.get(key)
        ids = self._arrays.ids
        row = int(ids.searchsorted(key))
        return row if row < len(ids) and ids[row].ljust(32, b"\0") == key else None

    def __contains__(self, oid: object) -> bool:
        return isinstance(oid, str) and self._row(oid) is not None

    def find(self, oid: str) -> PackEntry | None:
        row = self._row(oid)
        if row is None:
            return None
        a = self._arrays
        digest = None if a.digests is None else a.digests[row].ljust(32, b"\0")
        return PackEntry(oid, int(a.offsets[row]), int(a.lengths[row]), digest)

    def ids(self) -> list[str]:
        return [i.hex() for i in self._arrays._raw_ids()]

    def columns(self) -> tuple[list[str], list[int], list[int]]:
        """(ids, offsets, lengths) of every entry, in table order, without a ``PackEntry`` each:
        the bulk readers of every object (gc, stats, fsck at 10^6 objects) walk these lists."""
        return self.ids(), self._arrays.offsets.tolist(), self._arrays.lengths.tolist()

    def locate_many(self, oids: Sequence[str]) -> tuple[Any, Any, Any]:
        """(positions in ``oids`` of those this pack holds, their offsets, their lengths) as
        arrays: one binary search for all of them (10^6 objects at gc: a ``find`` each, with
        its Python objects, cost more than reading their headers)."""
        import numpy as np

        a = self._arrays
        try:
            keys = [bytes.fromhex(oid) for oid in oids]
            if any(len(k) != 32 for k in keys):
                raise ValueError("not an object id")
        except ValueError:  # some are not object ids: each looked up on its own
            found = [(i, row) for i, oid in enumerate(oids) if (row := self._row(oid)) is not None]
            rows = np.array([row for _, row in found], dtype=np.int64)
            return np.array([i for i, _ in found], dtype=np.int64), a.offsets[rows], a.lengths[rows]
        wanted = np.array(keys, dtype="S32") if keys else np.zeros(0, dtype="S32")
        rows = a.ids.searchsorted(wanted)
        inside = np.flatnonzero(rows < len(a.ids))
        # "S32" compares without trailing zero bytes, alike on both sides.
        positions = inside[a.ids[rows[inside]] == wanted[inside]]
        return positions, a.offsets[rows[positions]], a.lengths[rows[positions]]

    def longest(self) -> int:
        """The largest object's stored length."""
        return int(self._arrays.lengths.max())

    @property
    def entries(self) -> tuple[PackEntry, ...]:
        return self._arrays.entries()

    def in_pack_order(self) -> list[PackEntry]:
        return sorted(self.entries, key=lambda e: e.offset)


def _check_frame(what: str, part: str, magic_ok: bool, version: int, reserved_ok: bool) -> None:
    """The fixed fields of a pack header, pack trailer or index header."""
    if not magic_ok:
        raise _fail(what, f"its {part} lacks the magic bytes")
    if version not in ENTRIES:
        raise _fail(what, f"unknown version {version} in its {part}")
    if not reserved_ok:
        raise _fail(what, f"reserved bytes of its {part} are not zero")


def _check_count(count: int, what: str) -> None:
    if not 0 < count <= MAX_PACK_OBJECTS:
        raise _fail(what, f"object count {count} out of range 1..{MAX_PACK_OBJECTS}")


def _check_size(size: int, what: str) -> None:
    if size > MAX_PACK_SIZE:
        raise _fail(what, f"size {size} exceeds the limit {MAX_PACK_SIZE}")
    if size < PACK_HEADER.size + HEADER_SIZE + ENTRY_V1.size + TRAILER.size:
        raise _fail(what, f"size {size} is too small for a pack of one object")


def parse_index(data: bytes | memoryview, pack_id: str | None = None) -> PackIndex:
    """Validate an index file; ``pack_id`` (from its name) must match the pack it names."""
    table = parse_index_table(data, pack_id)
    return PackIndex(table.pack_id, table.pack_size, table.entries, table.version)


def parse_index_table(data: bytes | memoryview, pack_id: str | None = None, validated: bool = False) -> PackTable:
    """``parse_index``, kept as arrays (``PackTable``): a remote's index of 10^6 objects loads
    without a Python object per entry, and a push or fetch looks up only the objects it needs.

    ``validated``: the caller's own copy of an index that passed this function before (a
    client's cache of a remote's indexes, docs/format.md 15.8). Its framing, length and checksum
    are checked again (accidental damage since), its table's order and tiling are not: at 10^6
    objects that check costs several times the checksum, on every command."""
    what = f"index of pack {pack_id}" if pack_id else "pack index"
    view = memoryview(data)
    if len(view) < INDEX_HEADER.size + CHECKSUM_SIZE:
        raise _fail(what, f"{len(view)} bytes is shorter than the smallest index")
    magic, version, reserved, raw_pack, size, count, reserved2 = INDEX_HEADER.unpack_from(view)
    _check_frame(what, "index header", magic == INDEX_MAGIC, version, reserved == ZERO3 and reserved2 == ZERO4)
    if pack_id is not None and raw_pack.hex() != pack_id:
        raise _fail(what, f"it describes pack {raw_pack.hex()}")
    what = f"index of pack {raw_pack.hex()}"
    _check_count(count, what)
    _check_size(size, what)
    expected_len = INDEX_HEADER.size + count * ENTRIES[version].size + CHECKSUM_SIZE
    if len(view) != expected_len:
        raise _fail(what, f"it is {len(view)} bytes, its count of {count} objects implies {expected_len}")
    body = view[:-CHECKSUM_SIZE]
    if blake3.blake3(body).digest() != bytes(view[-CHECKSUM_SIZE:]):
        raise _fail(what, "checksum mismatch")
    table = view[INDEX_HEADER.size : -CHECKSUM_SIZE]
    data_end = size - len(table) - TRAILER.size
    return PackTable(raw_pack.hex(), size, _table_arrays(table, count, data_end, what, version, validated), version)


def tail_length(trailer: bytes | memoryview, pack_size: int, pack_id: str) -> int:
    """How many bytes at the end of a pack hold its table and trailer, from the last
    ``TRAILER.size`` bytes; fetch that many (``TAIL_GUESS`` first usually covers it)."""
    what = f"pack {pack_id}"
    _check_size(pack_size, what)
    if len(trailer) < TRAILER.size:
        raise _fail(what, "its trailer is truncated")
    count, version, reserved, _, magic = TRAILER.unpack_from(trailer, len(trailer) - TRAILER.size)
    _check_frame(what, "trailer", magic == PACK_MAGIC, version, reserved == ZERO3)
    _check_count(count, what)
    needed = TRAILER.size + count * ENTRIES[version].size
    if PACK_HEADER.size + count * HEADER_SIZE + needed > pack_size:
        raise _fail(what, f"{count} objects cannot fit in {pack_size} bytes")
    return needed


def index_from_tail(tail: bytes | memoryview, pack_size: int, pack_id: str) -> PackIndex:
    """The index of a pack from the last bytes of it (at least ``tail_length`` of them).

    Only the table's checksum vouches for it: the pack's name covers the whole pack, which a
    reader of the tail does not have. Each object is still verified against its id when read.
    """
    table = table_from_tail(tail, pack_size, pack_id)
    return PackIndex(pack_id, pack_size, table.entries, table.version)


def table_from_tail(tail: bytes | memoryview, pack_size: int, pack_id: str) -> PackTable:
    """``index_from_tail``, kept as arrays (``PackTable``): what a local reader needs."""
    what = f"pack {pack_id}"
    view = memoryview(tail)
    needed = tail_length(view, pack_size, pack_id)
    if len(view) < needed:
        raise ValueError(f"need the last {needed} bytes of the pack, got {len(view)}")
    if len(view) > pack_size:
        raise ValueError("tail is longer than the pack")
    count, version, _, checksum, _ = TRAILER.unpack_from(view, len(view) - TRAILER.size)
    table = view[len(view) - needed : len(view) - TRAILER.size]
    if blake3.blake3(table).digest() != checksum:
        raise _fail(what, "table checksum mismatch")
    return PackTable(pack_id, pack_size, _table_arrays(table, count, pack_size - needed, what, version), version)


def parse_pack(data: bytes | memoryview, pack_id: str) -> PackIndex:
    """Validate a whole pack named ``pack_id``: framing, table, and every object's header and
    (version 2) recorded digest.

    A pack's name says nothing about its bytes (packs written now have random names; older ones
    were named by their hash, which readers do not rely on: docs/format.md 15.1). Objects are not
    decoded here (a delta needs its base, which may be in another pack); the store decodes and
    re-hashes each one when it is used.
    """
    view = memoryview(data)
    what = f"pack {pack_id}"
    _check_size(len(view), what)
    magic, version, reserved = PACK_HEADER.unpack_from(view)
    _check_frame(what, "header", magic == PACK_MAGIC, version, reserved == ZERO3)
    index = index_from_tail(view[len(view) - tail_length(view, len(view), pack_id) :], len(view), pack_id)
    if index.version != version:
        raise _fail(what, f"its header says version {version}, its trailer {index.version}")
    for e in index.entries:
        try:
            parse_header(view[e.offset : e.offset + HEADER_SIZE])
        except IntegrityError as exc:
            raise _fail(what, f"object {e.id}: {exc}") from None
        check_read(view[e.offset : e.end], e, what[len("pack ") :])
    return index


def object_bytes(pack: bytes | memoryview, entry: PackEntry) -> memoryview:
    """The stored bytes of one object, out of the whole pack."""
    view = memoryview(pack)
    if entry.end > len(view):
        raise IntegrityError(f"object {entry.id}: the pack is {len(view)} bytes, the object ends at {entry.end}")
    return view[entry.offset : entry.end]


def check_read(data: bytes | memoryview, entry: PackEntry, pack_id: str) -> bool:
    """Refuse a ranged read of one object that came back short (a truncated pack: the
    transport returns fewer bytes when the object ends early, never an error), or whose bytes
    differ from the digest its entry records (pack version 2). True when the bytes were checked
    against a digest: they are exactly what the pusher verified and sent; False for a version 1
    entry, whose object only decoding can check."""
    if len(data) != entry.length:
        raise IntegrityError(
            f"pack {pack_id} is truncated: object {entry.id} at offset {entry.offset} should be "
            f"{entry.length} bytes, read {len(data)}"
        )
    if entry.digest is None:
        return False
    if blake3.blake3(data).digest() != entry.digest:
        raise IntegrityError(
            f"object {entry.id} is corrupt: its stored bytes in pack {pack_id} do not match "
            "the digest its index records"
        )
    return True
