"""The storage backend interface: the only layer that touches bytes at rest.

Keys are relative POSIX paths such as ``objects/ab/cdef…`` or ``refs/heads/main``. Every
implementation must satisfy these obligations (``tests/backend/test_base.py`` is the conformance
suite that runs against each one):

* ``put_if_absent`` and ``replace`` are atomic: a reader sees the old value or the new one, never
  a partial write; once they return, the data is durable (fsync of file and directory locally).
* ``put_if_absent`` writes only when the key is absent and says whether it wrote; calling it
  twice with the same data is harmless (objects are content-addressed).
* ``create_exclusive`` succeeds for exactly one of several concurrent callers (lock files).
* ``get`` of a missing key raises ``KeyError``; ``delete`` of a missing key returns False.
* ``list(prefix)`` yields every key under a folder-like prefix, never temporary files.
* ``repo_lock(exclusive=…)`` is a reader/writer lock over the whole repository, released when
  the holder exits, even by a crash: commits hold it shared, gc holds it exclusively. It is the
  only locking seam above the backend: the local backend uses ``flock``; a backend on object
  storage, where no such lock exists, implements it with lock objects and a grace period.
* Storage failures surface as ``ckstore.errors.StorageError`` with a one-line message.
* ``append_line(key, line)`` adds one ``\n``-terminated line at the end of a value, durably; a
  line that a crash tore during an earlier append (a value not ending in ``\n``) is cut off
  first, so it never runs into the new one. Callers serialise appends to one key.
* ``batch()`` yields a view of the backend whose ``put_if_absent`` and ``replace_object`` may be
  deferred: a put is visible through the view at once (``get``, ``size``, ``exists``, a second
  put of the key returns False), and every put is durable and visible to everyone when the
  ``with`` block ends without an exception; staged replacements are applied after that, each
  dropped when the put it depends on (``after``) lost to another writer. Nothing staged is
  visible outside the view before the block ends; on an exception nothing staged is applied.
  The default batch is the backend itself (every write immediate and durable at once).
* ``compaction_lock(timeout)`` is held by at most one holder per repository, across processes,
  and released when the holder exits, even by a crash.
"""

from __future__ import annotations

import builtins
import errno
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterator
from contextlib import AbstractContextManager, contextmanager

from ckstore.errors import InvalidPathError, LockedError, StorageError
from ckstore.format.ids import is_object_id, key_object_id

# '%' carries the escapes of ref names (refs.encode_ref); no character here can change a path.
# A key is parts joined by '/', none empty, '.' or '..': one match per key (every object access
# checks its key, so a split and a match per part showed up in a commit's profile).
_PART = r"(?!\.\.?(?:/|$))[A-Za-z0-9._@+%-]+"
_KEY = re.compile(rf"{_PART}(?:/{_PART})*")
# How long an operation waits for the repository lock (a gc or repack may hold it that long).
REPO_LOCK_TIMEOUT = 600.0


def check_key(key: str) -> str:
    """Refuse keys that could name anything outside the repository (defence in depth)."""
    if not _KEY.fullmatch(key):
        raise InvalidPathError(f"invalid storage key {key!r}")
    return key


def check_line(line: bytes) -> bytes:
    """``append_line`` takes exactly one line: a torn-tail repair must never cut a record in two."""
    if not line.endswith(b"\n") or b"\n" in line[:-1]:
        raise ValueError("append_line takes one line ending in a newline")
    return line


def check_prefix(prefix: str) -> str:
    """A ``list`` prefix names a folder: ``""`` (everything) or a valid key, with a trailing ``/``."""
    folder = prefix.removesuffix("/")
    return check_key(folder) + "/" if folder else ""


class Backend(ABC):
    """Abstract key-value storage for one repository."""

    @abstractmethod
    def get(self, key: str) -> bytes: ...

    @abstractmethod
    def put_if_absent(self, key: str, data: bytes) -> bool: ...

    def put_new(self, key: str, data: bytes | memoryview) -> bool:
        """``put_if_absent`` of a key the caller has just found absent: a backend may skip looking
        again (a batch does: if another writer stores the key meanwhile, its flush keeps the copy
        already there, as put-if-absent would)."""
        return self.put_if_absent(key, bytes(data) if isinstance(data, memoryview) else data)

    @abstractmethod
    def replace(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def create_exclusive(self, key: str, data: bytes) -> bool: ...

    @abstractmethod
    def delete(self, key: str) -> bool: ...

    @abstractmethod
    def size(self, key: str) -> int | None:
        """Stored size in bytes, or None when the key is absent."""

    @abstractmethod
    def list(self, prefix: str) -> Iterator[str]: ...

    @abstractmethod
    def repo_lock(self, exclusive: bool, timeout: float) -> AbstractContextManager[None]: ...

    def compaction_lock(self, timeout: float) -> AbstractContextManager[None]:
        """Held by the one process that re-encodes chunks as reverse deltas (compact.py), so two
        compactions never pair the same two objects in opposite directions. Raises LockedError
        after ``timeout`` seconds."""
        return _THREAD_LOCKS.hold((id(self), "compaction"), timeout, "another compaction is running; try again later")

    def config_lock(self, timeout: float) -> AbstractContextManager[None]:
        """Held while the repository settings are read, changed and written back, across processes:
        each change is made to the settings as they are now, never to a copy read earlier."""
        return _THREAD_LOCKS.hold((id(self), "config"), timeout, "another process is changing the settings")

    def compaction_running(self) -> bool:
        """Whether a compaction holds the compaction lock now (this process's own finish first)."""
        try:
            with self.compaction_lock(timeout=0):
                return False
        except LockedError:
            return True

    def compaction_queued(self) -> bool:
        """Whether a compaction waits its turn in another process (only a local repository's do:
        LocalBackend.compaction_place)."""
        return False

    def shared_lock(self) -> AbstractContextManager[None]:
        """The repository lock as writers of new objects hold it (commits, ref updates)."""
        return self.repo_lock(exclusive=False, timeout=REPO_LOCK_TIMEOUT)

    def exclusive_lock(self) -> AbstractContextManager[None]:
        """The repository lock as gc and repack hold it."""
        return self.repo_lock(exclusive=True, timeout=REPO_LOCK_TIMEOUT)

    @abstractmethod
    def clean_temporary(self) -> int:
        """Remove temporary files left by interrupted writers; only safe under the exclusive lock."""

    def state_signature(self, settled_before: float) -> builtins.list[tuple[str, int, int]] | None:
        """(name, mtime in ns, size) of every folder and file whose change may change what the
        repository stores or keeps (object folders, packs, reflogs, pruned record, links, config),
        or None when that cannot be told cheaply or one changed at ``settled_before`` or later
        (a change in the same clock tick would not show). A cache keyed on it (sizes_cache.py)
        is current while it is unchanged."""
        return None

    def temporary_sizes(self) -> builtins.list[int]:
        """The sizes of the temporary files ``clean_temporary`` would remove now (a killed
        commit's half-written pack can be large: stats and gc count it). Under the exclusive
        lock they are all leftovers; otherwise some may belong to a write in progress."""
        return []

    def exists(self, key: str) -> bool:
        return self.size(key) is not None

    def object_prefixes(self, oids: Collection[str], n: int) -> dict[str, bytes]:
        """The first ``n`` stored bytes of those objects of ``oids`` (by name) that this backend
        reads together more cheaply than one by one (a local repository's packed objects); the
        caller reads every one left out with ``get_prefix``. The default reads none together."""
        return {}

    def object_sizes(self) -> dict[str, int]:
        """Every stored object's size, by object name (what ``size`` says of its key), in one
        pass: ``stats`` and gc need all of them (10^6 objects: one ``size`` call each cost more
        than the rest of gc's walk)."""
        out: dict[str, int] = {}
        for key in self.list("objects/"):
            oid = key_object_id(key)
            size = self.size(key) if oid is not None and is_object_id(oid) else None
            if oid is not None and size is not None:
                out[oid] = size
        return out

    def get_prefix(self, key: str, n: int) -> bytes:
        """The first ``n`` bytes of a value (fewer if it is shorter); KeyError when absent.

        gc and fsck read only object headers to follow delta bases; backends that can read a
        range cheaply should override this.
        """
        return self.get(key)[:n]

    def describe(self, key: str) -> str:
        """Where a key lives, for error messages."""
        return key

    def prune_folders(self, key: str, stop: str) -> None:
        """Remove the folders that held the deleted ``key`` while they are empty, up to (not
        including) the folder ``stop``: a deleted ref ``a/b`` must not leave a folder ``a`` that
        blocks a new ref ``a``. Backends without folders have nothing to do."""

    def append_line(self, key: str, line: bytes) -> None:
        """Append ``line`` (one line ending in ``\\n``) to the value at ``key``, creating it.

        This default rewrites the value atomically (correct for any backend, linear in its
        size); backends that can append in place override it.
        """
        check_line(line)
        try:
            old = self.get(key)
        except KeyError:
            old = b""
        self.replace(key, old[: old.rfind(b"\n") + 1] + line)

    @contextmanager
    def batch(self, expected_bytes: int = 0, expected_objects: int = 0) -> Iterator[Backend]:
        """A view whose object writes become durable together when the block ends.

        Backends where durability costs per write (fsync per file) override this to stage
        writes and pay one barrier for the whole batch; this default writes immediately.
        ``expected_bytes`` and ``expected_objects`` (how much the caller is about to store, 0 when
        unknown) let a backend choose how: the local one writes a large batch's objects into one
        pack.
        """
        yield self

    def read_ahead(self, keys: Collection[str]) -> None:
        """Advice: ``keys`` will be read soon (the newest commit's chunks, after compaction). A
        local backend starts reading them into the page cache in the background; this default
        does nothing."""

    def superseded_bytes(self) -> int:
        """Bytes this backend holds for objects beyond their current copies (a local pack's copy
        of an object that was replaced loose, until the pack is rewritten); part of what the
        repository stores."""
        return 0

    def forget_cached(self, key: str) -> None:
        """Advice: nothing will read ``key`` again soon (compaction read a chunk it replaces).
        A local backend drops its pages from the operating system's page cache; this default
        does nothing."""

    def storage_problems(self) -> builtins.list[str]:
        """Damage a backend found in its own containers (a local pack whose table is
        unreadable), one line each, for fsck."""
        return []

    def unpack(self, drop: Collection[str] = (), gather: bool = False, keep_clean: bool = False) -> int:
        """Settle the objects a backend holds in packs (the local backend's, local_settle.py):
        large ones become plain keys, small ones stay packed, the object ids in ``drop`` are
        removed from packs (gc; their plain keys are deleted with ``delete``), and ``gather``
        lets plain small objects join a pack; ``keep_clean`` leaves a pack as it is while none of
        its objects is stored elsewhere too (compaction). Return how many packs were removed.
        Backends without packs have none."""
        return 0

    def release_reserve(self) -> int:
        """Free the space set aside for gc on a full disk (``keep_reserve``); return its bytes.
        gc calls it first, under the exclusive lock, so that what it must write before it can
        delete anything fits. Backends without a notion of free space have none."""
        return 0

    def keep_reserve(self) -> bool:
        """Set the reserve aside again when space allows (repository creation, the end of
        every gc); False when the disk is too full, which leaves it for a later gc."""
        return True

    def drop_packed(self, oids: Collection[str]) -> int:
        """Remove the packed copies of ``oids`` (gc), rewriting only the packs that hold one: their
        other objects are durable in a new pack (or loose) before an old pack goes, so the copies
        of ``oids`` vanish together with each old pack. Return how many packs were removed.
        Backends without packs have none."""
        return 0

    def packed_prefixes(self, oids: Collection[str], n: int) -> dict[str, builtins.list[bytes]]:
        """The first ``n`` bytes of every packed copy of each of ``oids`` (a loose copy, which
        readers see first, does not hide them: gc must know what each copy needs before it
        deletes). Backends without packs have none."""
        return {}

    def replace_object(self, key: str, data: bytes, after: str | None = None, cached: bool = True) -> None:
        """Swap an existing value for an equivalent one (another encoding of the same object).

        Outside a batch this is ``replace``. In a batch it is applied once every staged put is
        durable, and dropped when ``after`` (a key put in the same batch) was stored by another
        writer first: the new value may depend on the exact bytes this batch put there.
        ``cached`` False: nothing will read the new value soon (compaction's older chunks), so a
        local batch keeps it out of the page cache, where it would evict what the next checkout
        reads.
        """
        self.replace(key, data)


class _ThreadLocks:
    """In-process locks by key, for backends that live in one process (memory)."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._locks: dict[tuple[int, str], threading.Lock] = {}

    @contextmanager
    def hold(self, key: tuple[int, str], timeout: float, busy: str) -> Iterator[None]:
        with self._mutex:
            lock = self._locks.setdefault(key, threading.Lock())
        if not lock.acquire(timeout=timeout):
            raise LockedError(busy)
        try:
            yield
        finally:
            lock.release()


_THREAD_LOCKS = _ThreadLocks()


def storage_error(exc: OSError, doing: str) -> StorageError:
    """The one-line error for an OSError met while ``doing`` something to stored data."""
    reason = exc.strerror or str(exc)
    error = StorageError(f"{reason} while {doing}")
    error.no_space = exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return error
