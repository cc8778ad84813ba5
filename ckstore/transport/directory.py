"""A remote in a plain folder: a shared drive, an NFS mount, a second disk.

Each key is a file under the root. Writes go to a temporary file in ``.tmp/`` under the root
(the same filesystem, so the final step is atomic), are fsynced, then renamed (``put``) or
hard-linked (``put_if_absent``) into place, and the folder is fsynced. ``link`` fails with EEXIST
when the name exists, which makes it the create-if-absent primitive that also holds on NFS
(``open(2)``: O_EXCL on old NFS servers is not atomic, link is); because an NFS reply can be lost
and the request replayed, success is judged by the temporary file's link count, as ``open(2)``
advises, not by link's return value.

Compare-and-swap (``put_if_match``) has no single-call primitive on a filesystem, so it takes a
lock file next to the key (``.<name>.lock``, created with O_EXCL), compares the current value's
token (the BLAKE3 hash of its bytes), renames the new value into place and removes the lock. The
lock is held for one small read and one small write; a writer that finds it held waits up to
``lock_timeout`` and then fails with LockedError naming the file. A lock left by a process that
died inside that window is broken when its process is proven gone (the lock holds the owner JSON
of a ref lock: same host, boot and pid namespace, pid not running): under a second lock
(``.<name>.lock.lock``), and only if it still holds the bytes judged stale, so two breakers never
remove a lock a live writer just took. Any other leftover lock (another host's, an older
ckstore's) is removed by hand once no writer is running, like git's ``index.lock``. Readers take
no lock: a rename replaces a file whole.

obstore's LocalStore was considered and is not used: it neither fsyncs files nor folders, and
it has no compare-and-swap (``PutMode::Update`` is not implemented there).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import blake3

from ckstore.backend.fsio import break_stale_lock, dead_owner, fsync_path, process_owner
from ckstore.errors import LockedError, StorageError
from ckstore.transport.base import (
    MAX_SWAPPED,
    NotFound,
    ObjectInfo,
    RemoteOptions,
    Transport,
    check_range,
    check_remote_key,
    check_remote_prefix,
    is_remote_key,
)

TMP_DIR = ".tmp"


def content_token(data: bytes | memoryview) -> str:
    return blake3.blake3(data).hexdigest()


class DirectoryTransport(Transport):
    def __init__(
        self, root: str | os.PathLike[str], url: str | None = None, options: RemoteOptions | None = None
    ) -> None:
        self.root = Path(os.path.abspath(root))
        self.url = url or str(self.root)
        self.options = options or RemoteOptions()

    # ---- helpers -------------------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        path = self.root / check_remote_key(key)
        self._refuse_links(path)
        return path

    def _refuse_links(self, path: Path) -> None:
        """Refuse a path below the root that is, or lies in, a symbolic link: a link to
        another user's folder would make a push write, and a gc delete, files outside the
        remote. The root itself may be a link (the user named it). Opens add O_NOFOLLOW."""
        current = self.root
        for part in path.relative_to(self.root).parts:
            current = current / part
            try:
                st = os.lstat(current)
            except OSError:
                return  # not there (yet), or unreadable: the operation itself reports it
            if stat.S_ISLNK(st.st_mode):
                raise self._link_error(current)

    def _link_error(self, path: Path) -> StorageError:
        rel = path.relative_to(self.root).as_posix()
        return StorageError(
            f"remote {self.url}: {self.describe(rel)} is a symbolic link; a folder remote never "
            "follows links (they can lead outside it): replace it by the folder or file itself"
        )

    def _error(self, exc: OSError, doing: str, key: str = "") -> StorageError:
        if not self.root.is_dir():
            return StorageError(f"remote {self.url}: the folder does not exist (or is not a folder)")
        reason = exc.strerror or str(exc)
        return StorageError(f"remote {self.url}: {reason} while {doing} {self.describe(key)}".rstrip())

    def _ensure_dir(self, path: Path) -> None:
        """Create ``path`` and missing parents below the root, each made durable in its parent."""
        if path == self.root or path.is_dir():
            return
        if self.root not in path.parents:
            raise AssertionError(f"{path} is outside {self.root}")
        if not self.root.is_dir():
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(self.root))
        self._ensure_dir(path.parent)
        try:
            os.mkdir(path)
        except FileExistsError:
            return
        fsync_path(path.parent)

    def _write_temp(self, parts: Iterable[bytes | memoryview]) -> Path:
        tmp_dir = self.root / TMP_DIR
        self._refuse_links(tmp_dir)
        self._ensure_dir(tmp_dir)
        tmp = tmp_dir / uuid.uuid4().hex
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            for part in parts:
                view = memoryview(part).cast("B")
                while view:
                    view = view[os.write(fd, view) :]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            _unlink_quietly(tmp)
            raise
        os.close(fd)
        return tmp

    def _read(self, key: str, limit: int | None = None) -> bytes:
        path = self._path(key)
        try:
            with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
                return f.read() if limit is None else f.read(limit + 1)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            if not self.root.is_dir():
                raise self._error(FileNotFoundError(), "reading", key) from None
            raise NotFound(key) from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # made a link since _path looked
                raise self._link_error(path) from None
            raise self._error(exc, "reading", key) from None

    # ---- reads ---------------------------------------------------------------------------------

    def get(self, key: str, limit: int | None = None) -> bytes:
        return self._read(key, limit)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        return bytes(self.get_ranges(key, [(start, length)])[0])

    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes | memoryview]:
        for start, length in ranges:
            check_range(start, length)
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except (FileNotFoundError, NotADirectoryError):
            if not self.root.is_dir():
                raise self._error(FileNotFoundError(), "reading", key) from None
            raise NotFound(key) from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise self._link_error(path) from None
            raise self._error(exc, "reading", key) from None
        try:
            out: list[bytes | memoryview] = []
            for start, length in ranges:
                parts, pos, left = [], start, length
                while left > 0:
                    piece = os.pread(fd, left, pos)
                    if not piece:
                        break  # the value ends here: a short read, as the obligations say
                    parts.append(piece)
                    pos += len(piece)
                    left -= len(piece)
                out.append(b"".join(parts))
            return out
        except IsADirectoryError:
            raise NotFound(key) from None
        except OSError as exc:
            raise self._error(exc, "reading", key) from None
        finally:
            os.close(fd)

    def get_versioned(self, key: str, limit: int | None = None) -> tuple[bytes, str]:
        data = self._read(key, limit)
        return data, content_token(data)

    def head(self, key: str) -> ObjectInfo | None:
        try:
            st = os.lstat(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            if not self.root.is_dir():
                raise self._error(FileNotFoundError(), "reading", key) from None
            return None
        except OSError as exc:
            raise self._error(exc, "reading", key) from None
        return _info(key, st) if stat.S_ISREG(st.st_mode) else None

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        folder = check_remote_prefix(prefix)
        if not self.root.is_dir():
            raise self._error(FileNotFoundError(), "listing")
        top = self.root / folder if folder else self.root
        self._refuse_links(top)  # os.walk would follow a linked top folder (it never enters linked ones below)

        def fail(exc: OSError) -> None:
            if not isinstance(exc, (FileNotFoundError, NotADirectoryError)):  # gone, or no folder: no keys
                raise self._error(exc, "listing", folder)

        for dirpath, dirnames, filenames in os.walk(top, onerror=fail):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in filenames:
                key = name if rel == "." else f"{rel}/{name}"
                if not is_remote_key(key):
                    continue
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except FileNotFoundError:
                    continue  # deleted while we listed
                except OSError as exc:
                    raise self._error(exc, "listing", key) from None
                if stat.S_ISREG(st.st_mode):  # a link is no key
                    yield _info(key, st)

    def create_location(self) -> None:
        # Only the last level: a typing mistake in a parent folder's name should fail loudly.
        try:
            self.root.mkdir(exist_ok=True)
        except OSError as exc:
            raise self._error(exc, "creating", "") from None

    def location_exists(self) -> bool:
        return self.root.is_dir()

    def check(self) -> None:
        if not self.root.is_dir():
            raise StorageError(f"remote {self.url}: the folder does not exist (or is not a folder)")
        if not os.access(self.root, os.R_OK | os.W_OK | os.X_OK):
            raise StorageError(f"remote {self.url}: permission denied (the folder must be readable and writable)")

    # ---- writes --------------------------------------------------------------------------------

    def put(self, key: str, data: bytes | memoryview) -> None:
        self.put_parts(key, (data,))

    def put_parts(self, key: str, parts: Iterable[bytes | memoryview]) -> None:
        path = self._path(key)
        try:
            self._ensure_dir(path.parent)
            _replace(self._write_temp(parts), path)
        except OSError as exc:
            raise self._error(exc, "writing", key) from None

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        path = self._path(key)
        try:
            self._ensure_dir(path.parent)
            return self._link_new(self._write_temp((data,)), path)
        except OSError as exc:
            raise self._error(exc, "writing", key) from None

    def _link_new(self, tmp: Path, path: Path) -> bool:
        """Link a durable temporary file to ``path`` unless ``path`` exists; removes ``tmp``."""
        try:
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
            except OSError as exc:
                if exc.errno not in (errno.EIO, errno.ETIMEDOUT):
                    raise
            # A replayed NFS link can report EEXIST (or an error) although the first one linked.
            won = os.stat(tmp).st_nlink == 2
        finally:
            _unlink_quietly(tmp)
        if won:
            fsync_path(path.parent)
        return won

    def put_if_match(self, key: str, data: bytes | memoryview, token: str | None) -> bool:
        path = self._path(key)
        try:
            self._ensure_dir(path.parent)
            with self._lock(path, key):
                try:
                    with open(path, "rb") as f:
                        # Bounded: a value past it cannot have a token a bounded read returned.
                        current: str | None = content_token(f.read(MAX_SWAPPED + 1))
                except FileNotFoundError:
                    current = None
                if current != token:
                    return False
                tmp = self._write_temp((data,))
                if token is None:
                    return self._link_new(tmp, path)
                _replace(tmp, path)
                return True
        except OSError as exc:
            raise self._error(exc, "writing", key) from None

    @contextmanager
    def _lock(self, path: Path, key: str) -> Iterator[None]:
        lock = path.parent / f".{path.name}.lock"
        deadline = time.monotonic() + self.options.lock_timeout
        delay = 0.001
        while True:
            try:
                fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
                break
            except FileExistsError:
                if _break_if_dead(lock):
                    continue
                if time.monotonic() >= deadline:
                    raise LockedError(
                        f"remote {self.url}: {lock} is held by another writer of {key}; if no ckstore "
                        "process is writing to this remote, a crashed one left it: remove the file"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
        try:
            os.write(fd, json.dumps(process_owner()).encode())
        finally:
            os.close(fd)
        try:
            yield
        finally:
            _unlink_quietly(lock)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            os.unlink(path)
        except (FileNotFoundError, NotADirectoryError):
            if not self.root.is_dir():
                raise self._error(FileNotFoundError(), "deleting", key) from None
            return
        except IsADirectoryError:
            return
        except OSError as exc:
            raise self._error(exc, "deleting", key) from None
        try:
            fsync_path(path.parent)
        except OSError as exc:
            raise self._error(exc, "deleting", key) from None


def _break_if_dead(lock: Path) -> bool:
    """Remove ``lock`` if the writer that holds it is proven gone; True when removed."""
    try:
        stale = lock.read_bytes()
    except OSError:
        return False  # released meanwhile
    if dead_owner(stale) is None:
        return False  # alive, being written, or an older ckstore's: not provably stale
    breaker = lock.with_name(lock.name + ".lock")

    def take_breaker() -> bool:
        try:
            os.close(os.open(breaker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except OSError:
            return False  # another process is breaking it
        return True

    return break_stale_lock(
        stale, lock.read_bytes, lambda: os.unlink(lock), take_breaker, lambda: _unlink_quietly(breaker)
    )


def _info(key: str, st: os.stat_result) -> ObjectInfo:
    return ObjectInfo(key, st.st_size, datetime.fromtimestamp(st.st_mtime, tz=timezone.utc))


def _replace(tmp: Path, path: Path) -> None:
    """Rename a durable temporary file over ``path`` and make the new entry durable."""
    try:
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    fsync_path(path.parent)


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
