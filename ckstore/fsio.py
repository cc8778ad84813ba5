"""Small operating-system helpers shared by the local backend and checkout's output files.

``mutating_step`` marks every step that changes a file system (write, fsync, link, rename,
unlink, mkdir). Production code installs no observer, so it costs a function call; the crash and
fault-injection tests install one that SIGKILLs the process or raises ENOSPC/EIO at the K-th step
(tests/fault_cli.py), which is how they prove that a crash at any step leaves a readable
repository. The fault logic itself lives in the tests.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

_observer: Callable[[], None] | None = None


def observe_steps(observer: Callable[[], None] | None) -> None:
    """Call ``observer`` before every mutating step of this process (None: stop)."""
    global _observer
    _observer = observer


def mutating_step() -> None:
    if _observer is not None:
        _observer()


def fsync_path(path: Path) -> None:
    """fsync a file or folder by path (a folder's fsync makes its entries durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """Whether a process with this id runs on this host (a zombie counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
