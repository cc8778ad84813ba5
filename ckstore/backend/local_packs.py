"""Local packs: a large batch's new objects written into one file, spread into loose objects later.

Creating a file costs far more than writing its bytes on the filesystems checkpoints live on: on
this machine's ext4, staging an fp32 epoch's 612 objects as files took 0.45 s where appending the
same bytes to one file took 0.2 s (scripts/bench.py, docs/design.md "Commit into a pack"). So a
batch that expects many bytes (a commit of an epoch, a fetch) appends its new objects to one pack
(docs/format.md section 15.1, the format remotes use: objects byte for byte, then a table) and
installs it with one rename once its bytes are durable. The commit's critical path creates one
file instead of hundreds.

For large objects packs are an intake: the compaction that replaces some of their objects, and
gc, settle them (local_settle.py, off the training loop's path): objects of 64 KiB or more become
loose, where compaction and repack re-encode them in place; small ones rest in one new pack.
Every read finds a packed object through ``LocalPacks``: a loose object is looked for first, then
the packs, and a pack that vanished under a reader (settled meanwhile) sends it back to the loose
copy or the new pack, which settling makes durable before it deletes the old one.
"""

from __future__ import annotations

import bisect
import os
import threading
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3

from ckstore.backend.fsio import DropBehind, PositionalWriter, drop_cached, mutating_step, read_ahead
from ckstore.errors import IntegrityError
from ckstore.format.ids import is_object_id
from ckstore.format.pack import (
    MAX_PACK_SIZE,
    TAIL_GUESS,
    PackEntry,
    PackIndex,
    PackTable,
    table_from_tail,
    tail_length,
)
from ckstore.format.pack_build import PackBuilder

PACK_FOLDER = "objects/pack"
PACK_SUFFIX = ".pack"


class PackWriter:
    """One pack a batch is writing: objects are placed in order under a lock and their bytes
    written at their offsets outside it, so workers copy into the page cache in parallel."""

    def __init__(self, folder: Path) -> None:
        self._builder = PackBuilder(MAX_PACK_SIZE)
        self.path = folder / f".{self._builder.pack_id}.tmp"
        self._lock = threading.Condition()
        self._written: set[str] = set()
        mutating_step()
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        self._writer = PositionalWriter(self._fd)
        try:
            self._writer.write_at(self._builder.header, 0)
        except BaseException:
            self.discard()
            raise

    @property
    def pack_id(self) -> str:
        return self._builder.pack_id

    def add(self, oid: str, data: bytes | memoryview) -> bool | None:
        """Append one stored object: True when added, False when the pack holds it already,
        None when the pack is full (the caller starts another)."""
        digest = blake3.blake3(data).digest()
        with self._lock:
            if oid in self._builder:
                return False
            if not self._builder.fits(len(data)):
                return None
            entry = self._builder.add(oid, data, digest)
        mutating_step()
        self._writer.write_at(data, entry.offset)
        with self._lock:
            self._written.add(oid)
            self._lock.notify_all()
        return True

    def __contains__(self, oid: str) -> bool:
        with self._lock:
            return oid in self._builder

    def datasync(self) -> None:
        """Make the bytes written so far durable (an early flush of the batch: local_batch.py)."""
        if self._fd >= 0:
            os.fdatasync(self._fd)

    def read(self, oid: str, n: int | None = None) -> bytes | None:
        """The staged object's bytes (the first ``n``), once its writer has written them."""
        with self._lock:
            entry = self._builder.entry(oid)
            if entry is None:
                return None
            while oid not in self._written:
                self._lock.wait()
        return os.pread(self._fd, entry.length if n is None else min(n, entry.length), entry.offset)

    def size_of(self, oid: str) -> int | None:
        with self._lock:
            entry = self._builder.entry(oid)
        return None if entry is None else entry.length

    def finish(self) -> PackIndex | None:
        """Write the table and trailer (unsynced) and close; None for an empty pack (removed)."""
        if not len(self._builder):
            self.discard()
            return None
        tail, index = self._builder.close()
        mutating_step()
        self._writer.write_at(tail, index.pack_size - len(tail))
        os.close(self._fd)
        self._fd = -1
        return index

    def discard(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            mutating_step()
            self.path.unlink(missing_ok=True)
        except OSError:
            pass  # a stray temporary file is harmless; gc removes it


@dataclass(frozen=True)
class _Located:
    path: Path
    entry: PackEntry


class LocalPacks:
    """The installed packs of one repository, each as its table (sorted ids, searched).

    Loaded lazily and refreshed when the pack folder changes (another process installed or
    removed a pack). A pack whose table cannot be read is left out and named by ``damaged``,
    so its objects read as missing (fsck reports them) instead of failing every read. Tables
    stay arrays (format/pack.py ``PackTable``): loading a pack of 10^5 objects costs no Python
    object per object, and a lookup is a binary search in each pack (a handful: settling
    merges them, local_settle.py).
    """

    def __init__(self, root: Path) -> None:
        self.folder = root / PACK_FOLDER
        self._lock = threading.Lock()
        self._indexes: dict[str, PackIndex | PackTable] = {}
        self._seen: tuple[int, int] | None = None  # the folder's (mtime_ns, inode) last loaded
        self._generation = 0  # counts changes of ``_indexes`` (``locate``)
        self.damaged: dict[str, str] = {}  # pack id -> why it was left out
        self._read_behind: dict[Path, DropBehind] = {}  # forget_cached's ranges, per pack

    def path_of(self, pack_id: str) -> Path:
        return self.folder / f"{pack_id}{PACK_SUFFIX}"

    def refresh(self, force: bool = False) -> None:
        try:
            st = self.folder.stat()
        except FileNotFoundError:
            with self._lock:
                self._indexes, self._seen = {}, None
                self._generation += 1
            return
        stamp = (st.st_mtime_ns, st.st_ino)
        with self._lock:
            if not force and stamp == self._seen:
                return
            names = {e.name[: -len(PACK_SUFFIX)] for e in os.scandir(self.folder) if e.name.endswith(PACK_SUFFIX)}
            names = {n for n in names if is_object_id(n)}
            indexes = {pid: ix for pid, ix in self._indexes.items() if pid in names}
            damaged = {pid: why for pid, why in self.damaged.items() if pid in names}
            for pid in sorted(names - indexes.keys() - damaged.keys()):
                try:
                    indexes[pid] = _read_table(self.path_of(pid), pid)
                except FileNotFoundError:
                    continue  # settled meanwhile
                except (IntegrityError, OSError) as exc:
                    damaged[pid] = str(exc)
            self._indexes, self.damaged, self._seen = indexes, damaged, stamp
            self._generation += 1

    def add(self, index: PackIndex) -> None:
        """A pack this process just installed (saves re-reading its table)."""
        with self._lock:
            self._indexes[index.pack_id] = index
            self._generation += 1

    def locate(self, oid: str) -> _Located | None:
        """Where a pack holds ``oid``. A miss looks at the folder again and searches a second
        time only if the packs changed since the first search: most of a commit's lookups are
        misses (its new chunks' dedup checks), and each search asks every table."""
        for attempt in (0, 1):
            with self._lock:
                generation = self._generation
                for pid, index in self._indexes.items():
                    entry = index.find(oid)
                    if entry is not None:
                        return _Located(self.path_of(pid), entry)
            if attempt == 0:
                self.refresh()
                with self._lock:
                    if self._generation == generation:
                        return None
        return None

    def read(self, oid: str, n: int | None = None) -> bytes | None:
        """An object's stored bytes (the first ``n``) from its pack; None when no pack holds
        it, or its pack was removed before the read (the caller looks for the loose copy)."""
        found = self.locate(oid)
        if found is None:
            return None
        e = found.entry
        try:
            fd = os.open(found.path, os.O_RDONLY)
        except FileNotFoundError:
            self.refresh(force=True)
            return None
        try:
            data = os.pread(fd, e.length if n is None else min(n, e.length), e.offset)
        finally:
            os.close(fd)
        if n is None and len(data) != e.length:
            raise IntegrityError(f"pack {found.path.name} is truncated: object {oid} should be {e.length} bytes")
        return data

    def size(self, oid: str) -> int | None:
        found = self.locate(oid)
        return None if found is None else found.entry.length

    def forget_cached(self, oid: str) -> None:
        """``oid`` will not be read again soon: its pack's pages around it leave the page cache
        once enough of their neighbours went too (fsio.DropBehind)."""
        found = self.locate(oid)
        if found is None:
            return
        with self._lock:
            ranges = self._read_behind.setdefault(found.path, DropBehind()).add(found.entry.offset, found.entry.length)
        if not ranges:
            return
        try:
            fd = os.open(found.path, os.O_RDONLY)
        except OSError:
            return  # settled meanwhile: its pages went with it
        try:
            for offset, length in ranges:
                drop_cached(fd, offset, length)
        finally:
            os.close(fd)

    def read_prefixes(self, oids: Collection[str], n: int) -> dict[str, bytes]:
        """The first ``n`` stored bytes of each of ``oids`` that a pack holds, each pack opened
        once, its objects located together (``locate_many``) and neighbouring ones read together
        (``_read_places``): at 10^5 packed objects one open, lookup and read per object through
        ``read`` cost 6-15 s of gc's and fsck's header reads. An object left out (in no pack, or
        its pack settled meanwhile) is read one by one by the caller."""
        out: dict[str, bytes] = {}
        for found in self._prefixes_pack_by_pack(oids, n, first_only=True):
            out.update(found)
        return out

    def every_prefix(self, oids: Collection[str], n: int) -> dict[str, list[bytes]]:
        """The first ``n`` stored bytes of every packed copy of each of ``oids`` (an object may
        lie in several packs: a copy a crash left, a merge interrupted)."""
        out: dict[str, list[bytes]] = {}
        for found in self._prefixes_pack_by_pack(oids, n, first_only=False):
            for oid, prefix in found.items():
                out.setdefault(oid, []).append(prefix)
        return out

    def _prefixes_pack_by_pack(self, oids: Collection[str], n: int, first_only: bool) -> Iterator[dict[str, bytes]]:
        """For each pack in turn, the first ``n`` bytes of its copies of ``oids`` (with
        ``first_only``, of those no earlier pack held)."""
        todo = list(dict.fromkeys(oids))
        for index in self.indexes():
            if not todo:
                break
            positions, offsets, lengths = index.locate_many(todo)
            if not len(positions):
                continue
            try:
                found = _read_places(
                    self.path_of(index.pack_id), [todo[i] for i in positions.tolist()], offsets, lengths.clip(max=n)
                )
            except FileNotFoundError:
                self.refresh(force=True)  # settled meanwhile: its copies are elsewhere now
                continue
            yield found
            if first_only:
                todo = [oid for oid in todo if oid not in found]

    def sizes(self) -> dict[str, int]:
        """Every packed object's stored length (the first pack listing an object wins, as in
        ``locate``)."""
        out: dict[str, int] = {}
        for index in reversed(self.indexes()):
            ids, _, lengths = index.columns()
            out.update(zip(ids, lengths))
        return out

    def ids(self) -> list[str]:
        self.refresh()
        with self._lock:
            indexes = list(self._indexes.values())
        return list(dict.fromkeys(oid for ix in indexes for oid in _ids(ix)))

    def indexes(self) -> list[PackIndex | PackTable]:
        self.refresh()
        with self._lock:
            return list(self._indexes.values())

    def read_ahead(self, oids: Collection[str]) -> None:
        """Start reading packed ``oids`` into the page cache: one advice per run of adjacent
        objects in each pack."""
        runs: dict[Path, list[tuple[int, int]]] = {}
        for oid in oids:
            found = self.locate(oid)
            if found is not None:
                runs.setdefault(found.path, []).append((found.entry.offset, found.entry.end))
        for path, places in runs.items():
            merged: list[list[int]] = []
            for start, end in sorted(places):
                if merged and start <= merged[-1][1] + _GAP:
                    merged[-1][1] = max(merged[-1][1], end)
                else:
                    merged.append([start, end])
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue  # settled meanwhile
            try:
                for start, end in merged:
                    read_ahead(fd, start, end - start)
            finally:
                os.close(fd)

    def shadowed_bytes(self, loose: Collection[str]) -> dict[str, int]:
        """Per pack, the bytes of its objects that a loose copy shadows (replaced objects, kept
        until a settle rewrites the pack: local_settle.py)."""
        out = {}
        for index in self.indexes():
            ids, _, lengths = index.columns()
            out[index.pack_id] = sum(n for oid, n in zip(ids, lengths) if oid in loose)
        return out

    def forget(self, pack_id: str) -> None:
        with self._lock:
            self._indexes.pop(pack_id, None)
            self._read_behind.pop(self.path_of(pack_id), None)


# Neighbouring objects are read with one pread while the bytes between them are at most GAP and
# the read at most SPAN: small packed objects come in runs, large ones each alone.
_GAP = 64 << 10
_SPAN = 1 << 20


def _read_places(path: Path, oids: list[str], offsets: Any, lengths: Any) -> dict[str, bytes]:
    """``{oid: bytes}``: each of ``oids``'s ``lengths`` bytes at its ``offsets`` (arrays) in the
    pack at ``path``, objects in runs read with one pread."""
    import numpy as np

    order = np.argsort(offsets, kind="stable")
    starts = offsets[order]
    # The furthest byte needed so far: a run ends where the next object starts more than _GAP
    # after it, or would take the read past _SPAN.
    reach = np.maximum.accumulate(starts + lengths[order])
    breaks = [0, *(np.flatnonzero(starts[1:] - reach[:-1] > _GAP) + 1).tolist(), len(starts)]
    names = [oids[i] for i in order.tolist()]
    starts_l, ends_l, reach_l = starts.tolist(), (starts + lengths[order]).tolist(), reach.tolist()
    out: dict[str, bytes] = {}
    fd = os.open(path, os.O_RDONLY)
    try:
        for first, stop in zip(breaks[:-1], breaks[1:]):
            i = first
            while i < stop:
                start = starts_l[i]
                j = max(i + 1, bisect.bisect_right(reach_l, start + _SPAN, i, stop))
                data = os.pread(fd, reach_l[j - 1] - start, start)
                for k in range(i, j):
                    out[names[k]] = data[starts_l[k] - start : ends_l[k] - start]
                i = j
    finally:
        os.close(fd)
    return out


def _ids(index: PackIndex | PackTable) -> list[str]:
    return index.ids() if isinstance(index, PackTable) else [e.id for e in index.entries]


def _read_table(path: Path, pack_id: str) -> PackTable:
    """A pack's table from its own tail (two reads at most)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size > MAX_PACK_SIZE:
            raise IntegrityError(f"pack {pack_id} is {size} bytes, more than a pack can be")
        guess = min(size, TAIL_GUESS)
        tail = os.pread(fd, guess, size - guess)
        needed = tail_length(tail, size, pack_id)
        if needed > len(tail):
            tail = os.pread(fd, needed, size - needed)
        return table_from_tail(tail[len(tail) - needed :], size, pack_id)
    finally:
        os.close(fd)
