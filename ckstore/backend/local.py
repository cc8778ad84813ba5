"""A repository in a local directory: one file per key, written atomically.

Writes go to ``tmp/`` first, are fsynced, then linked (``put_if_absent``) or renamed
(``replace``) into place, and the directory is fsynced, so a crash leaves either the old state or
the new one plus, at worst, a stray temporary file that the next gc removes.

The repository lock is ``fcntl.flock`` on the file ``lock``: the kernel drops it when its holder
dies, so a killed commit can never wedge gc. (flock is not reliable on every network filesystem;
docs/design.md says so.)

Test-only fault injection: when the environment variable ``CKSTORE_FAULT`` is ``ACTION@K``, the
K-th mutating step (write, fsync, link, rename, unlink, mkdir; checkout's output files count too,
through ``fault_point``) of this process does ACTION instead:
``kill`` (SIGKILL itself), ``enospc`` or ``eio`` (raise that OSError). ``CKSTORE_FAULT_COUNT=path``
makes the process write its step count to that file, so a harness can enumerate every K.
"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import LockedError, StorageError
from .base import Backend, check_key, check_prefix

TMP_DIR = "tmp"
LOCK_FILE = "lock"


class _FaultPlan:
    def __init__(self) -> None:
        spec = os.environ.get("CKSTORE_FAULT", "")
        self.action, _, k = spec.partition("@")
        self.at = int(k) if k.isdigit() else 0
        self.count_file = os.environ.get("CKSTORE_FAULT_COUNT")
        self.steps = 0

    def step(self) -> None:
        self.steps += 1
        if self.count_file:
            with open(self.count_file, "w") as f:
                f.write(str(self.steps))
        if self.steps != self.at:
            return
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.action == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if self.action == "eio":
            raise OSError(errno.EIO, os.strerror(errno.EIO))


_FAULTS = _FaultPlan()


def fault_point() -> None:
    """One mutating step outside the backend (checkout output files), for the test-only hook."""
    _FAULTS.step()


def _storage_error(exc: OSError, doing: str) -> StorageError:
    reason = exc.strerror or str(exc)
    return StorageError(f"{reason} while {doing}")


class LocalBackend(Backend):
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
        _FAULTS.step()
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _ensure_dir(self, path: Path) -> None:
        if path.is_dir():
            return
        self._ensure_dir(path.parent)
        _FAULTS.step()
        try:
            os.mkdir(path)
        except FileExistsError:
            return
        self._fsync_dir(path.parent)

    def _write_temp(self, data: bytes) -> Path:
        tmp_dir = self.root / TMP_DIR
        self._ensure_dir(tmp_dir)
        tmp = tmp_dir / f"{uuid.uuid4().hex}.tmp"
        _FAULTS.step()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            _FAULTS.step()
            os.fsync(fd)
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
            _FAULTS.step()
            if exclusive:
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    return False
            else:
                os.replace(tmp, path)
                tmp = None
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

    def delete(self, key: str) -> bool:
        path = self._path(key)
        try:
            _FAULTS.step()
            path.unlink()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return False
        except OSError as exc:
            raise _storage_error(exc, f"deleting {self.describe(key)}") from None
        return True

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

    @contextmanager
    def repo_lock(self, exclusive: bool, timeout: float) -> Iterator[None]:
        path = self.root / LOCK_FILE
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
                        what = "a running commit" if exclusive else "a running gc"
                        raise LockedError(f"repository is locked by {what}; try again later") from None
                    time.sleep(0.05)
            yield
        finally:
            os.close(fd)  # closing drops the flock

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
