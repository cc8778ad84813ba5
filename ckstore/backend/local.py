"""A repository in a local directory: one file per key, written atomically.

Writes go to ``tmp/`` first, are fsynced, then linked (``put_if_absent``) or renamed
(``replace``) into place, and the directory is fsynced, so a crash leaves either the old state or
the new one plus, at worst, a stray temporary file that the next gc removes.

A batch (``LocalBackend.batch``, used for a commit's chunk objects) pays for durability once
instead of per object: every object is written to ``tmp/`` without fsync, then one barrier makes
all their bytes durable (``syncfs(2)`` on the repository's filesystem; without it, an fsync of
each staged file), then each is moved to its final name without replacing anything
(``renameat2`` RENAME_NOREPLACE, else ``link``: EEXIST means another writer stored it), then a second barrier makes the new directory entries durable. So no object
ever appears under its final name before its bytes are on disk, and the caller writes its
manifest only after the batch returned. Measured: ~1,000 per-object fsyncs took 3.0 s of a
6.8 s commit; two syncfs calls take ~0.1 s.

The repository lock is ``fcntl.flock`` on the file ``lock``: the kernel drops it when its holder
dies, so a killed commit can never wedge gc. (flock is not reliable on every network filesystem;
docs/design.md says so.)

Every mutating step (write, fsync, link, rename, unlink, mkdir) goes through
``fsio.mutating_step``, the seam the crash and fault-injection tests use.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from ..errors import InvalidInputError, LockedError, RefExistsError, StorageError
from ..fsio import fsync_path, mutating_step
from .base import Backend, check_key, check_line, check_prefix

TMP_DIR = "tmp"
LOCK_FILE = "lock"
COMPACTION_LOCK_FILE = "compact.lock"


def _load_syncfs() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        return ctypes.CDLL(None, use_errno=True).syncfs  # Linux (glibc, musl)
    except (OSError, AttributeError):
        return None


_SYNCFS = _load_syncfs()
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1


def _load_renameat2() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2  # glibc 2.28+
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn


_RENAMEAT2 = _load_renameat2()
_SYNC_FILE_RANGE_WRITE = 2


def _load_sync_file_range() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range  # Linux
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_SYNC_FILE_RANGE = _load_sync_file_range()


def _start_writeback(fd: int) -> None:
    """Ask the kernel to start writing a staged file to disk now, without waiting: the batch's
    barrier then mostly waits for writes already under way while the commit was still encoding
    (measured: the barrier was half of a 271 MB commit's time). Only a hint; durability still
    comes from the barrier."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


def _move_if_absent(src: Path, dst: Path) -> bool | None:
    """Put ``src`` at ``dst`` unless ``dst`` exists (False). True: moved, ``src`` is gone;
    None: linked (the fallback where renameat2's RENAME_NOREPLACE is missing), ``src`` stays.
    Either way the check and the new entry are one atomic step, as put-if-absent needs."""
    if _RENAMEAT2 is not None:
        if _RENAMEAT2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return True
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            return False
        if err not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
            raise OSError(err, os.strerror(err), str(dst))
    try:
        os.link(src, dst)
    except FileExistsError:
        return False
    return None


def locate_repository(path: str | os.PathLike[str], marker: str, default_dir: str) -> Path | None:
    """The repository folder at ``path`` (or its ``default_dir`` child): where ``marker`` exists."""
    root = Path(path)
    for candidate in (root, root / default_dir):
        if (candidate / marker).is_file():
            return candidate
    return None


def find_repository(start: str | os.PathLike[str], marker: str, default_dir: str) -> Path | None:
    """The nearest ``default_dir`` holding ``marker`` at or above ``start``."""
    here = Path(start).resolve()
    for folder in (here, *here.parents):
        if (folder / default_dir / marker).is_file():
            return folder / default_dir
    return None


def prepare_new_repository(path: str | os.PathLike[str], marker: str) -> Path:
    """Create the folder for a new repository; refuse one that exists with anything in it."""
    root = Path(path)
    if (root / marker).exists():
        raise RefExistsError(f"a repository already exists at {root}")
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise InvalidInputError(f"{root} exists and is not an empty directory")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _storage_error(exc, f"creating {root}") from None
    return root


def _last_line_end(fd: int, end: int, block: int = 1 << 16) -> int:
    """Offset just past the last newline before ``end`` (0 when there is none)."""
    while end > 0:
        start = max(0, end - block)
        found = os.pread(fd, end - start, start).rfind(b"\n")
        if found >= 0:
            return start + found + 1
        end = start
    return 0


def _storage_error(exc: OSError, doing: str) -> StorageError:
    reason = exc.strerror or str(exc)
    return StorageError(f"{reason} while {doing}")


class LocalBackend(Backend):
    # Batches use syncfs(2) when the platform has it; tests turn it off to cover the fallback.
    use_syncfs: bool = _SYNCFS is not None

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def describe(self, key: str) -> str:
        return str(self._path(key))

    def get(self, key: str) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            # A folder is not a key, and no key lies below a file ("a/b" when "a" is a ref).
            raise KeyError(key) from None
        except OSError as exc:
            raise _storage_error(exc, f"reading {self.describe(key)}") from None

    def get_prefix(self, key: str, n: int) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                return f.read(n)
        except (FileNotFoundError, IsADirectoryError):
            raise KeyError(key) from None
        except OSError as exc:
            raise _storage_error(exc, f"reading {self.describe(key)}") from None

    def _fsync_dir(self, path: Path) -> None:
        mutating_step()
        fsync_path(path)

    def _ensure_dir(self, path: Path, created: set[Path] | None = None) -> None:
        """Create ``path`` and missing parents. Each new entry's parent is fsynced at once,
        unless ``created`` collects the new folders for the caller's own barrier (batches)."""
        if path.is_dir():
            return
        self._ensure_dir(path.parent, created)
        mutating_step()
        try:
            os.mkdir(path)
        except FileExistsError:
            return
        if created is None:
            self._fsync_dir(path.parent)
        else:
            created.add(path)

    def _write_temp(self, data: bytes | memoryview, sync: bool = True) -> Path:
        tmp_dir = self.root / TMP_DIR
        self._ensure_dir(tmp_dir)
        tmp = tmp_dir / f"{uuid.uuid4().hex}.tmp"
        mutating_step()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if sync:
                mutating_step()
                os.fsync(fd)
            else:
                _start_writeback(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        return tmp

    def _install(self, key: str, data: bytes, exclusive: bool) -> bool:
        path = self._path(key)
        tmp: Path | None = None
        try:
            self._ensure_dir(path.parent)
            tmp = self._write_temp(data)
            for attempt in range(3):
                mutating_step()
                try:
                    if exclusive:
                        os.link(tmp, path)
                    else:
                        os.replace(tmp, path)
                        tmp = None
                    break
                except FileExistsError:
                    return False
                except FileNotFoundError:
                    if attempt == 2 or not tmp.exists():
                        raise
                    self._ensure_dir(path.parent)  # a ref deletion pruned the empty folder meanwhile
            self._fsync_dir(path.parent)
            return True
        except OSError as exc:
            raise _storage_error(exc, f"writing {self.describe(key)}") from None
        finally:
            if tmp is not None:
                try:
                    tmp.unlink(missing_ok=True)
                except OSError:
                    pass  # a stray temporary file is harmless; gc removes it

    def put_if_absent(self, key: str, data: bytes) -> bool:
        if self._path(key).exists():
            return False
        return self._install(key, data, exclusive=True)

    def replace(self, key: str, data: bytes) -> None:
        self._install(key, data, exclusive=False)

    def create_exclusive(self, key: str, data: bytes) -> bool:
        return self._install(key, data, exclusive=True)

    def append_line(self, key: str, line: bytes) -> None:
        """Append in place: the file is never rewritten, so a long reflog costs one write."""
        path = self._path(check_key(key))
        check_line(line)
        try:
            self._ensure_dir(path.parent)
            mutating_step()
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                end = new_file_end = os.fstat(fd).st_size
                if end and os.pread(fd, 1, end - 1) != b"\n":
                    end = _last_line_end(fd, end)
                    mutating_step()
                    os.ftruncate(fd, end)  # a line torn by a crash: it must not run into ours
                view = memoryview(line)
                mutating_step()
                while view:
                    written = os.pwrite(fd, view, end)
                    view, end = view[written:], end + written
                mutating_step()
                os.fsync(fd)
            finally:
                os.close(fd)
            if not new_file_end:  # the file may be new: make its directory entry durable too
                self._fsync_dir(path.parent)
        except OSError as exc:
            raise _storage_error(exc, f"appending to {self.describe(key)}") from None

    def delete(self, key: str) -> bool:
        path = self._path(key)
        try:
            mutating_step()
            path.unlink()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return False
        except OSError as exc:
            raise _storage_error(exc, f"deleting {self.describe(key)}") from None
        return True

    def prune_folders(self, key: str, stop: str) -> None:
        path, top = self._path(key).parent, self.root / check_key(stop)
        while path != top and top in path.parents:
            mutating_step()
            try:
                os.rmdir(path)
            except OSError:
                return  # not empty (another ref, or a writer's new lock file), or gone already
            path = path.parent

    def size(self, key: str) -> int | None:
        try:
            st = self._path(key).stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise _storage_error(exc, f"reading {self.describe(key)}") from None
        return st.st_size if not os.path.isdir(self._path(key)) else None

    def list(self, prefix: str) -> Iterator[str]:
        prefix = check_prefix(prefix)  # never a path outside the repository
        base = self.root / prefix if prefix else self.root
        if not base.is_dir():
            return
        keys = []
        for dirpath, dirnames, filenames in os.walk(base):
            rel = Path(dirpath).relative_to(self.root).as_posix()
            if rel == TMP_DIR:
                dirnames.clear()
                continue
            keys.extend(name if rel == "." else f"{rel}/{name}" for name in filenames)
        # Sorted as whole keys (os.walk yields a folder's files before its subfolders').
        yield from sorted(keys)

    def repo_lock(self, exclusive: bool, timeout: float) -> AbstractContextManager[None]:
        what = "a running commit" if exclusive else "a running gc"
        return self._flock(LOCK_FILE, exclusive, timeout, f"repository is locked by {what}; try again later")

    def compaction_lock(self, timeout: float) -> AbstractContextManager[None]:
        return self._flock(COMPACTION_LOCK_FILE, True, timeout, "another process is compacting this repository")

    @contextmanager
    def _flock(self, name: str, exclusive: bool, timeout: float, busy: str) -> Iterator[None]:
        path = self.root / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise _storage_error(exc, f"opening {path}") from None
        mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    fcntl.flock(fd, mode)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise LockedError(busy) from None
                    time.sleep(0.05)
            yield
        finally:
            os.close(fd)  # closing drops the flock

    @contextmanager
    def batch(self) -> Iterator[Backend]:
        staged = LocalBatch(self)
        try:
            yield staged
        except BaseException:
            staged.discard()
            raise
        staged.flush()

    def sync_barrier(self, paths: Iterable[Path]) -> None:
        """Make everything written under the repository durable: one syncfs(2), or, where the
        platform lacks it, an fsync of each of ``paths`` (files or folders), run concurrently so
        the filesystem can commit them together."""
        if self.use_syncfs and _SYNCFS is not None:
            mutating_step()
            fd = os.open(self.root, os.O_RDONLY)
            try:
                if _SYNCFS(fd) == 0:
                    return
                err = ctypes.get_errno()
            finally:
                os.close(fd)
            if err not in (errno.ENOSYS, errno.EINVAL):
                raise OSError(err, os.strerror(err))
        todo = sorted(set(paths))
        for _ in todo:
            mutating_step()  # one step per fsync, counted up front (the fsyncs run in parallel)
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(fsync_path, todo))

    def clean_temporary(self) -> int:
        removed = 0
        tmp_dir = self.root / TMP_DIR
        if tmp_dir.is_dir():
            for entry in tmp_dir.iterdir():
                try:
                    entry.unlink()
                    removed += 1
                except OSError:
                    pass
        return removed


class LocalBatch(Backend):
    """A staged view of a LocalBackend (see ``LocalBackend.batch`` and the module docstring).

    Puts are written to ``tmp/`` unsynced and remembered by key, so reads and dedup through this
    view see them at once while other readers see nothing until ``flush``. Thread-safe: a
    commit's workers put concurrently. Memory stays bounded: only paths are kept, never bytes.
    """

    def __init__(self, backend: LocalBackend) -> None:
        self.inner = backend
        self._mutex = threading.Lock()
        self._puts: dict[str, Path] = {}
        self._replaces: dict[str, tuple[Path, str | None]] = {}

    def _staged(self, key: str) -> Path | None:
        with self._mutex:
            return self._puts.get(check_key(key))

    def get(self, key: str) -> bytes:
        tmp = self._staged(key)
        if tmp is None:
            return self.inner.get(key)
        try:
            return tmp.read_bytes()
        except OSError as exc:
            raise _storage_error(exc, f"reading staged {self.describe(key)}") from None

    def get_prefix(self, key: str, n: int) -> bytes:
        tmp = self._staged(key)
        if tmp is None:
            return self.inner.get_prefix(key, n)
        try:
            with open(tmp, "rb") as f:
                return f.read(n)
        except OSError as exc:
            raise _storage_error(exc, f"reading staged {self.describe(key)}") from None

    def size(self, key: str) -> int | None:
        tmp = self._staged(key)
        return self.inner.size(key) if tmp is None else tmp.stat().st_size

    def put_if_absent(self, key: str, data: bytes) -> bool:
        if self._staged(key) is not None or self.inner.exists(key):
            return False
        try:
            tmp = self.inner._write_temp(data, sync=False)
        except OSError as exc:
            raise _storage_error(exc, f"staging {self.describe(key)}") from None
        with self._mutex:
            if key not in self._puts:
                self._puts[key] = tmp
                return True
        self._unlink(tmp)  # a concurrent put of the same key won (same name, same bytes)
        return False

    def replace_object(self, key: str, data: bytes, after: str | None = None) -> None:
        try:
            tmp = self.inner._write_temp(data, sync=False)
        except OSError as exc:
            raise _storage_error(exc, f"staging {self.describe(key)}") from None
        with self._mutex:
            old = self._replaces.pop(check_key(key), None)
            self._replaces[key] = (tmp, after)
        if old is not None:
            self._unlink(old[0])

    def replace(self, key: str, data: bytes) -> None:
        self.inner.replace(key, data)

    def create_exclusive(self, key: str, data: bytes) -> bool:
        return self.inner.create_exclusive(key, data)

    def delete(self, key: str) -> bool:
        return self.inner.delete(key)

    def list(self, prefix: str) -> Iterator[str]:
        return self.inner.list(prefix)  # staged keys are not stored yet

    def repo_lock(self, exclusive: bool, timeout: float) -> AbstractContextManager[None]:
        return self.inner.repo_lock(exclusive, timeout)

    def clean_temporary(self) -> int:
        return self.inner.clean_temporary()

    def compaction_lock(self, timeout: float) -> AbstractContextManager[None]:
        return self.inner.compaction_lock(timeout)

    def describe(self, key: str) -> str:
        return self.inner.describe(key)

    @staticmethod
    def _unlink(tmp: Path) -> None:
        try:
            mutating_step()
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # a stray temporary file is harmless; gc removes it

    def _take(self) -> tuple[list[tuple[str, Path]], list[tuple[str, Path, str | None]]]:
        with self._mutex:
            puts = sorted(self._puts.items())
            replaces = sorted((k, tmp, after) for k, (tmp, after) in self._replaces.items())
            self._puts.clear()
            self._replaces.clear()
        return puts, replaces

    def discard(self) -> None:
        """Drop everything staged (the batch failed): nothing becomes visible."""
        puts, replaces = self._take()
        for tmp in [t for _, t in puts] + [t for _, t, _ in replaces]:
            self._unlink(tmp)

    def flush(self) -> None:
        """Barrier, link every put, barrier, then apply the replacements (module docstring)."""
        puts, replaces = self._take()
        if not puts and not replaces:
            return
        leftovers = dict.fromkeys([t for _, t in puts] + [t for _, t, _ in replaces])
        try:
            self.inner.sync_barrier(leftovers)  # every staged byte is durable before any link
            lost: set[str] = set()
            folders: set[Path] = set()
            for key, tmp in puts:
                path = self.inner._path(key)
                self.inner._ensure_dir(path.parent, folders)
                folders.add(path.parent)
                mutating_step()
                moved = _move_if_absent(tmp, path)
                if moved is False:
                    lost.add(key)  # another writer stored it first: same name, same bytes
                elif moved:
                    del leftovers[tmp]
            # New entries (and new folders' entries in their parents) are durable before the
            # caller writes a manifest naming them, and before a replacement can depend on them.
            self.inner.sync_barrier(folders | {f.parent for f in folders})
            for key, tmp, after in replaces:
                if after is not None and after in lost:
                    continue
                mutating_step()
                os.replace(tmp, self.inner._path(key))
                del leftovers[tmp]
            # No barrier for the replacements: the old and the new encoding decode to the same
            # bytes and the new one's base is already durable, so losing the rename is harmless.
        except OSError as exc:
            raise _storage_error(exc, "storing a commit's objects") from None
        finally:
            for tmp in leftovers:
                self._unlink(tmp)
