"""Linux system calls the local backend uses when they exist, through ctypes, each with the
portable fallback its caller needs: syncfs(2) and renameat2(2) with RENAME_NOREPLACE
(sync_file_range(2) is in fsio.py, which checkout uses too); and holding signals back around
a step that must not be cut in two."""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ckstore.backend.fsio import libc_function

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1

_SYNCFS = libc_function("syncfs")  # Linux (glibc, musl)
_RENAMEAT2 = libc_function(  # glibc 2.28+
    "renameat2", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
)

HAS_SYNCFS = _SYNCFS is not None


def syncfs(path: Path) -> bool:
    """Make everything written to ``path``'s filesystem durable. False when the platform or the
    filesystem lacks syncfs (the caller then fsyncs file by file); OSError when it failed."""
    if _SYNCFS is None:
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        if _SYNCFS(fd) == 0:
            return True
        err = ctypes.get_errno()
    finally:
        os.close(fd)
    if err in (errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(err, os.strerror(err), str(path))


def move_if_absent(src: Path, dst: Path) -> bool | None:
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


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back while a few steps must finish together (a ref update and the
    bookkeeping that says it happened); a signal that arrives meanwhile is handled, by the
    handler that was in place, when the block ends. Python runs signal handlers on the main
    thread only, so elsewhere this does nothing.

    The handlers are swapped for one that only notes the signal, rather than the signals masked:
    a mask is per thread, and in a process with other threads (a commit's workers) the kernel
    hands the signal to one of those, whose C handler still makes the main thread run the
    Python handler inside the block (found by tests/backend/test_local_batch.py under xdist)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []

    def note(signum: int, frame: object) -> None:
        caught.append(signum)

    before: dict[int, Any] = {}
    try:
        for held in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(held) is not None:  # None: set outside Python, cannot be restored
                before[held] = signal.signal(held, note)
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(caught):
            handler = before[signum]
            if callable(handler):
                handler(signum, None)
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), signum)  # its default action, now that the block is done
