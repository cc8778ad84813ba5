"""The local repository's locks: ``fcntl.flock`` on files in its folder, so the kernel drops a
lock when its holder dies and a killed process can never wedge another.

``lock`` is the repository lock (shared by readers and commits, exclusive for gc and repack),
``compact.lock`` one compaction at a time, ``config.lock`` one change of ``config.json`` at a
time, and ``compact-queue/<branch>`` a compaction's place in line. A reader of a repository it
cannot write takes its shared lock on a read-only descriptor and creates nothing.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from ckstore.backend.base import storage_error
from ckstore.errors import LockedError

LOCK_FILE = "lock"
COMPACTION_LOCK_FILE = "compact.lock"
CONFIG_LOCK_FILE = "config.lock"  # flock while config.json is read, changed and replaced
COMPACTION_QUEUE_FOLDER = "compact-queue"  # one file per branch: flock while its compaction waits


class LocalLocks:
    """The locks of the repository in the folder ``root`` (the local backend's lock methods)."""

    root: Path

    def repo_lock(self, exclusive: bool, timeout: float) -> AbstractContextManager[None]:
        what = "a running commit" if exclusive else "a running gc"
        return self._flock(LOCK_FILE, exclusive, timeout, f"repository is locked by {what}; try again later")

    def compaction_lock(self, timeout: float) -> AbstractContextManager[None]:
        return self._flock(COMPACTION_LOCK_FILE, True, timeout, "another process is compacting this repository")

    def config_lock(self, timeout: float) -> AbstractContextManager[None]:
        return self._flock(CONFIG_LOCK_FILE, True, timeout, "another process is changing the repository settings")

    def compaction_place(self, key: str) -> int | None:
        """A descriptor holding ``key``'s place in line for a compaction (flock, exclusive, on
        ``compact-queue/<key>``), or None when another holder has it: one waiting compaction per
        branch is enough, since a run reads the branch's tip when it starts. The place passes to
        a child process with the descriptor and ends when every copy is closed, or its holder dies."""
        folder = self.root / COMPACTION_QUEUE_FOLDER
        try:
            folder.mkdir(exist_ok=True)
            fd = os.open(folder / key, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            raise storage_error(exc, f"opening {folder / key}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    def compaction_queued(self) -> bool:
        """Whether a compaction holds its place in line (see ``compaction_place``)."""
        folder = self.root / COMPACTION_QUEUE_FOLDER
        return any(
            _locked_by_another(path, os.O_RDONLY) for path in (sorted(folder.iterdir()) if folder.is_dir() else ())
        )

    def compaction_running(self) -> bool:
        """Whether a process holds ``compact.lock`` now, asked without creating or writing
        anything (``status`` works on a read-only repository): no file, no compaction ever ran."""
        try:
            return _locked_by_another(self.root / COMPACTION_LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return False

    def _open_lock(self, path: Path, exclusive: bool) -> int | None:
        """The descriptor to flock ``path`` with. A shared lock (a reader: log, status, report,
        a dry run) of a repository it cannot write (a read-only mount, another user's files)
        takes the flock on a read-only descriptor; with no lock file there, no writer can hold
        one either (None: nothing to lock)."""
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            if exclusive or exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise storage_error(exc, f"opening {path}") from None
        try:
            return os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise storage_error(exc, f"opening {path}") from None

    @contextmanager
    def _flock(self, name: str, exclusive: bool, timeout: float, busy: str) -> Iterator[None]:
        path = self.root / name
        fd = self._open_lock(path, exclusive)
        if fd is None:
            yield
            return
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


def _locked_by_another(path: Path, flags: int) -> bool:
    """Whether some process holds an exclusive flock on ``path`` now (asked without waiting)."""
    fd = os.open(path, flags)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
