"""Making packs (pure, no I/O): ``PackBuilder`` lays out one pack object by object, so its upload
can start before its last object is read; ``pack_objects`` groups objects into whole packs. The
layout is format/pack.py's (docs/format.md, "Remote repositories and packs")."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import blake3

from ckstore.codecs.objects import parse_header
from ckstore.errors import IntegrityError
from ckstore.format.ids import is_object_id
from ckstore.format.pack import (
    DEFAULT_TARGET_SIZE,
    ENTRY,
    MAX_OBJECT_LENGTH,
    MAX_PACK_OBJECTS,
    MAX_PACK_SIZE,
    PACK_HEADER,
    PACK_MAGIC,
    PACK_VERSION,
    TRAILER,
    ZERO3,
    PackEntry,
    PackIndex,
    table_bytes,
)


@dataclass(frozen=True)
class BuiltPack:
    """A finished pack: its name, bytes, and the index file that describes it."""

    index: PackIndex
    data: bytes
    index_data: bytes

    @property
    def name(self) -> str:
        return self.index.pack_id


class PackBuilder:
    """Lays out one pack, object by object, without holding the objects' bytes.

    The pack's name is chosen before its first byte (random, docs/format.md 15.1), so a caller
    can send ``header``, then each object's stored bytes as it is added, then ``close()``'s tail,
    while later objects are still being read and verified: the upload of a pack overlaps its
    making. The caller decides where one pack ends: ``fits`` says whether an object of a given
    length still belongs in this pack. Objects are laid out in the order they are added, so
    adding the chunks of one tensor in order lets a reader fetch them with one coalesced read.
    """

    def __init__(self, target_size: int = DEFAULT_TARGET_SIZE, pack_id: str | None = None) -> None:
        if not 0 < target_size <= MAX_PACK_SIZE:
            raise ValueError(f"pack target size {target_size} out of range 1..{MAX_PACK_SIZE}")
        if pack_id is not None and not is_object_id(pack_id):
            raise ValueError(f"invalid pack id {pack_id!r}")
        self.target_size = target_size
        self.pack_id = pack_id or os.urandom(32).hex()  # what secrets.token_hex does, without its import
        self.header = PACK_HEADER.pack(PACK_MAGIC, PACK_VERSION, ZERO3)
        self._entries: dict[str, PackEntry] = {}
        self._end = PACK_HEADER.size
        self._closed = False

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, oid: object) -> bool:
        return oid in self._entries

    def entry(self, oid: str) -> PackEntry | None:
        """Where an object added to this pack lies, if it was added."""
        return self._entries.get(oid)

    @property
    def size(self) -> int:
        """The size the pack would have if closed now."""
        return self._end + ENTRY.size * len(self._entries) + TRAILER.size

    def fits(self, length: int) -> bool:
        """Whether an object of ``length`` stored bytes belongs in this pack: always for an empty
        pack (an object larger than the target gets a pack of its own), else while the pack
        stays within the target size and the hard limits."""
        if len(self._entries) >= MAX_PACK_OBJECTS:
            return False
        grown = self.size + length + ENTRY.size
        return not self._entries and grown <= MAX_PACK_SIZE or grown <= self.target_size

    def add(self, oid: str, stored: bytes | memoryview, digest: bytes | None = None) -> PackEntry:
        """Place one stored object (its exact stored bytes) named ``oid`` next in the pack;
        ``digest`` is the BLAKE3 of ``stored`` when the caller has it already (hashed here
        otherwise). The caller writes ``stored`` itself, right after the previous object's."""
        if self._closed:
            raise ValueError("the pack is closed")
        if not is_object_id(oid):
            raise ValueError(f"invalid object id {oid!r}")
        if oid in self._entries:
            raise ValueError(f"object {oid} is already in this pack")
        length = len(stored)
        if length > MAX_OBJECT_LENGTH:
            raise ValueError(f"object {oid} is {length} bytes, more than a stored object can be")
        if len(self._entries) >= MAX_PACK_OBJECTS or self.size + length + ENTRY.size > MAX_PACK_SIZE:
            raise ValueError("pack is full: check fits() before add()")
        try:
            parse_header(stored)
        except IntegrityError as exc:
            raise IntegrityError(f"object {oid} is corrupt: {exc}") from None
        entry = PackEntry(oid, self._end, length, digest if digest is not None else blake3.blake3(stored).digest())
        self._entries[oid] = entry
        self._end += length
        return entry

    def close(self) -> tuple[bytes, PackIndex]:
        """The pack's last bytes (table and trailer) and its index; no object can follow."""
        if not self._entries:
            raise ValueError("an empty pack cannot be written")
        self._closed = True
        entries = tuple(sorted(self._entries.values(), key=lambda e: e.id))
        table = table_bytes(entries, PACK_VERSION)
        trailer = TRAILER.pack(len(entries), PACK_VERSION, ZERO3, blake3.blake3(table).digest(), PACK_MAGIC)
        return table + trailer, PackIndex(self.pack_id, self.size, entries)


def pack_objects(
    objects: Iterable[tuple[str, bytes | memoryview] | tuple[str, bytes | memoryview, bytes]],
    target_size: int = DEFAULT_TARGET_SIZE,
) -> Iterator[BuiltPack]:
    """Group (id, stored bytes[, their BLAKE3]) into whole packs of about ``target_size``
    bytes, in order. A repeated id is stored once (the first time it appears)."""
    builder = PackBuilder(target_size)
    parts: list[bytes | memoryview] = [builder.header]
    seen: set[str] = set()

    def built() -> BuiltPack:
        tail, index = builder.close()
        return BuiltPack(index, b"".join([*parts, tail]), index.to_bytes())

    for oid, stored, *digest in objects:
        if oid in seen:
            continue
        seen.add(oid)
        if not builder.fits(len(stored)):
            yield built()
            builder = PackBuilder(target_size)
            parts = [builder.header]
        builder.add(oid, stored, *digest)
        parts.append(stored)
    if len(builder):
        yield built()
