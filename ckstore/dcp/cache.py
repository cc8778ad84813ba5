"""The node-local cache folder of saves and loads straight to a remote (``cache_dir=`` or
``CKSTORE_CACHE_DIR``): its layout, and what keeps it bounded on a machine that saves for months.

::

    remotes/<h>/               one remote's (<h>: a hash of its URL); every open touches it
    remotes/<h>/indexes/       its index files, by pack
    remotes/<h>/objects/       the objects loads of it read
    remotes/<h>/compaction/    the objects its compaction read: after each run, only the newest
                               save's (the next run pairs them with the save after it)
    remotes/<h>/compaction.lock  one compaction at a time per machine and remote
    remote-compact.log         the detached compactions' output

Without bounds, every save would leave its chunks in ``compaction/`` and every pack it replaced
its index in ``indexes/``. After each compaction run (``bound``, at the run's own lowest
priority) the folder keeps of that remote only what the newest save's compaction reads again,
the index files of the packs the remote still holds, and of the other remotes only those touched
within a week; the log is cut to its last 256 KiB of lines once it passes 1 MiB.

Nothing in the folder is trusted (every index is checksummed, every object decoded and
re-hashed when read: remote.py), so a removal that races with a reader costs that reader a
download, never a wrong byte.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import time
import uuid
from pathlib import Path

from ckstore.backend.base import Backend

REMOTES = "remotes"
COMPACTION = "compaction"  # in a remote's folder: the objects its compaction read
COMPACTION_LOCK = "compaction.lock"
STALE_AFTER = 7 * 86400.0  # seconds untouched after which another remote's folder goes
LOG_LIMIT = 1 << 20  # a log longer than this is cut ...
LOG_TAIL = 256 << 10  # ... to its last lines within this many bytes
_GONE = ".gone-"  # a folder being removed, renamed first so that nobody opens it meanwhile
_OLD_COMPACTION = "remote-compact-objects"  # the objects of every remote's compaction, in one folder


def remote_folder(root: Path, url: str) -> Path:
    """The folder of remote ``url`` in cache folder ``root``, made if need be and touched: its
    age is how long no save, load or compaction on this machine has opened the remote."""
    folder = root / REMOTES / hashlib.sha256(url.encode()).hexdigest()[:24]
    folder.mkdir(parents=True, exist_ok=True)
    try:
        os.utime(folder)
    except OSError:
        pass  # a folder someone else owns: it is only aged sooner
    return folder


def last_touched(folder: Path) -> float:
    """The newest modification time of ``folder`` and anything in it (0 when it is gone)."""
    newest = 0.0
    for where, dirs, files in os.walk(folder):
        for name in [".", *dirs, *files]:
            try:
                newest = max(newest, os.lstat(os.path.join(where, name)).st_mtime)
            except OSError:
                pass  # removed meanwhile
    return newest


def remove_stale(root: Path, keep: Path, now: float | None = None) -> list[str]:
    """Remove from ``root`` the folders of remotes other than ``keep`` untouched for
    ``STALE_AFTER`` seconds, the leftovers of a removal that was killed, and the single objects
    folder an earlier layout kept for every remote's compaction; the names removed."""
    now = time.time() if now is None else now
    removed = []
    remotes = root / REMOTES
    for folder in sorted(remotes.iterdir()) if remotes.is_dir() else []:
        gone = folder.name.startswith(_GONE)
        if folder == keep or not folder.is_dir() or folder.is_symlink():
            continue
        if gone or now - last_touched(folder) > STALE_AFTER:
            _remove(folder, remotes)
            removed.append(folder.name)
    old = root / _OLD_COMPACTION
    if old.is_dir() and not old.is_symlink():
        _remove(old, remotes)
        removed.append(old.name)
    return removed


def _remove(folder: Path, remotes: Path) -> None:
    """Rename, then delete: a save that opens the remote meanwhile makes a fresh folder rather
    than writing into one being deleted."""
    if not folder.name.startswith(_GONE):
        remotes.mkdir(parents=True, exist_ok=True)
        target = remotes / f"{_GONE}{uuid.uuid4().hex}"
        try:
            folder.rename(target)
        except OSError:
            return  # removed by another run, or not ours to move
        folder = target
    shutil.rmtree(folder, ignore_errors=True)


def prune_indexes(cache: Backend, live: set[str], folder: str = "indexes/") -> int:
    """Delete the cached index files of packs not in ``live`` (the remote's packs, listed
    before); how many. A pack listed after the listing loses its index file here only to a
    download when next needed."""
    dropped = 0
    for key in list(cache.list(folder)):
        if key[len(folder) :] not in live and cache.delete(key):
            dropped += 1
    return dropped


def cut_log(path: Path, limit: int = LOG_LIMIT, tail: int = LOG_TAIL) -> bool:
    """Cut the log at ``path`` to its last whole lines within ``tail`` bytes once it is longer
    than ``limit``; whether it was cut. In place (the runs append to it through their own open
    file), under a lock on the file so that two runs never cut it at once."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return False  # no log yet
    try:
        if os.fstat(fd).st_size <= limit:
            return False
        fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size
        if size <= limit:
            return False  # cut by another run meanwhile
        kept = os.pread(fd, tail, size - tail)
        start = kept.find(b"\n") + 1  # from the first whole line
        kept = kept[start:] if 0 < start < len(kept) else kept
        os.pwrite(fd, kept, 0)
        os.ftruncate(fd, len(kept))
        return True
    finally:
        os.close(fd)


__all__ = [
    "COMPACTION",
    "COMPACTION_LOCK",
    "LOG_LIMIT",
    "LOG_TAIL",
    "STALE_AFTER",
    "cut_log",
    "last_touched",
    "prune_indexes",
    "remote_folder",
    "remove_stale",
]
