"""Small operating-system helpers shared by the local backend and checkout's output files.

``EarlyFlush`` makes a long write's final fsync short. On the virtual disks measured here the
cost of an fsync is the device flush that makes the host persist everything written since the
last one (about 0.2 s for 185 MB, with the guest's dirty pages already written back), so
flushing every ``EARLY_FLUSH_BYTES`` on a background thread while the writer goes on overlaps
that cost with the decoding of the next chunks. The early flushes only bring work forward:
durability still comes from the final fsync, and an early flush's error is raised there.

``mutating_step`` marks every step that changes a file system (write, fsync, link, rename,
unlink, mkdir). Production code installs no observer, so it costs a function call; the crash and
fault-injection tests install one that SIGKILLs the process or raises ENOSPC/EIO at the K-th step
(tests/fault_cli.py), which is how they prove that a crash at any step leaves a readable
repository. The fault logic itself lives in the tests.
"""

from __future__ import annotations

import bisect
import ctypes
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

EARLY_FLUSH_BYTES = 16 << 20  # 8 and 16 MiB: bf16 epochs 8-10% faster than 32 (docs/design.md)
_SYNC_FILE_RANGE_WRITE = 2
_SYNC_FILE_RANGE_WAIT_ALL = 1 | 2 | 4  # wait for writeback under way, write, wait for it
_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", None)  # Linux; advice only, absent elsewhere
_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", None)


def libc_function(name: str, argtypes: list[type] | None = None) -> Any:
    """A C library function through ctypes (errno kept), None where the platform lacks it (ctypes
    types its functions only privately)."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    if argtypes is not None:
        fn.argtypes = argtypes
    return fn


_SYNC_FILE_RANGE = libc_function(  # Linux
    "sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
)

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


def process_owner() -> dict[str, object]:
    """Who holds a lock, written into the lock file: the process id, and what makes that id mean
    one process: the host, the boot (ids restart), the pid namespace (containers with the host's
    name see other ids). The last two are Linux's; elsewhere they are absent."""
    import socket  # only lock writers need it: a command that reads starts without it

    owner: dict[str, object] = {"pid": os.getpid(), "host": socket.gethostname(), "time": time.time()}
    try:
        owner["boot"] = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        owner["pidns"] = os.readlink("/proc/self/ns/pid")
    except OSError:
        pass
    return owner


def owner_surely_dead(info: dict[str, object]) -> bool:
    """Whether the process that wrote lock owner ``info`` (``process_owner``) is certainly gone:
    it ran in this host's boot and pid namespace and its id no longer runs, or in an earlier boot
    of this host. Anything less certain (another host, another pid namespace, an older lock
    without these fields) is False."""
    mine = process_owner()
    if "boot" not in mine or info.get("host") != mine["host"] or "boot" not in info:
        return False
    if info["boot"] != mine["boot"]:
        return True  # this host rebooted since: every process of that boot is gone
    pid = info.get("pid")
    return info.get("pidns") == mine["pidns"] and isinstance(pid, int) and not pid_alive(pid)


def dead_owner(data: bytes) -> dict[str, object] | None:
    """The owner recorded in a lock's bytes (``process_owner`` as JSON) when its process is
    surely gone (``owner_surely_dead``); None when it may live or the bytes are no owner."""
    import json

    try:
        info = json.loads(data)
    except (ValueError, TypeError):
        return None
    return info if isinstance(info, dict) and owner_surely_dead(info) else None


FOLDER_OWNER = "owner.json"  # in each private folder: the process it belongs to


def private_folder(parent: Path | None, prefix: str) -> Path:
    """A new folder of this process in ``parent`` (default: the temporary folder), recording its
    owner; first removes the folders of that prefix there whose process is surely gone (same
    host, boot and pid namespace, pid not running: the rule of lock files), such as a killed
    rank's or a killed compaction's, which could not remove their own."""
    import json

    parent = Path(tempfile.gettempdir()) if parent is None else parent
    parent.mkdir(parents=True, exist_ok=True)
    for old in parent.glob(prefix + "*"):
        try:
            owner = (old / FOLDER_OWNER).read_bytes()
        except OSError:
            continue  # being made, or not ours
        if dead_owner(owner) is not None:
            shutil.rmtree(old, ignore_errors=True)
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    (folder / FOLDER_OWNER).write_text(json.dumps(process_owner()))
    return folder


def break_stale_lock(
    stale: bytes,
    read_lock: Callable[[], bytes],
    delete_lock: Callable[[], object],
    take_breaker: Callable[[], bool],
    drop_breaker: Callable[[], None],
) -> bool:
    """Remove a lock whose bytes ``stale`` were judged dead, whatever stores it (a repository's
    ref lock, a folder remote's key lock); True when this process broke it.

    Breaking is serialised by a second lock (``take_breaker``: an exclusive create), and the lock
    is deleted only if it still holds the bytes judged stale, so two processes breaking at once
    never delete a lock a live process has just taken. False when another process is breaking
    it. ``read_lock`` raises KeyError or FileNotFoundError once the lock is gone."""
    if not take_breaker():
        return False
    try:
        try:
            if read_lock() == stale:
                delete_lock()
        except (KeyError, FileNotFoundError):
            pass
    finally:
        drop_breaker()
    return True


def pid_alive(pid: int) -> bool:
    """Whether a process with this id runs on this host (a zombie counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start_writeback(fd: int) -> None:
    """Ask the kernel to start writing a file's dirty pages now, without waiting. Only a hint:
    durability still comes from a barrier, which then mostly waits for writes already under way."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


class PositionalWriter:
    """Writes into one open file at given offsets, from any number of threads, one at a time.

    The kernel serializes them anyway (ext4 takes the file's inode lock for every buffered
    write), but a writer that finds the lock held spins on it while the holder copies into the
    page cache: on 2 cores, a whole core that could have been decoding or hashing. Waiting here
    sleeps instead. Measured on a 3 GB bf16 checkout (two workers writing each file):
    `rwsem_spin_on_owner` was 24% of the samples of a slow one, and alternated runs took 3.6
    against 4.4 CPU s (medians of 5, same wall time); a 3 GB commit's pack writes spun 4%."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._lock = threading.Lock()

    def write_at(self, data: bytes | memoryview, offset: int) -> None:
        view = memoryview(data)
        with self._lock:
            while view:
                n = os.pwrite(self.fd, view, offset)
                view, offset = view[n:], offset + n


class EarlyFlush:
    """Background ``flush`` every ``every`` bytes written, at most one at a time (module docstring).

    ``flush`` is what makes the bytes so far durable (``os.fdatasync`` of the file being written,
    or a syncfs of a repository's filesystem); it may raise OSError, which ``finish`` re-raises.
    """

    def __init__(self, flush: Callable[[], object], every: int | None = None) -> None:
        self._flush = flush
        self._every = EARLY_FLUSH_BYTES if every is None else every
        self._unflushed = 0
        self._mutex = threading.Lock()
        self._running: threading.Thread | None = None
        self._error: OSError | None = None
        self._stopped = False

    def wrote(self, n: int) -> None:
        with self._mutex:
            self._unflushed += n
            if self._unflushed < self._every or self._stopped or self._error is not None:
                return
            if self.flushing():
                return
            self._unflushed = 0
            self._running = threading.Thread(target=self._run, name="ckstore-flush", daemon=True)
            self._running.start()

    def flushing(self) -> bool:
        """Whether a background flush is running now."""
        running = self._running
        return running is not None and running.is_alive()

    def _run(self) -> None:
        try:
            if self._flush() is False:  # the filesystem cannot: leave it all to the final barrier
                self._stopped = True
        except OSError as exc:
            self._error = exc

    def finish(self, quiet: bool = False) -> None:
        """Wait for the flush under way; raise the OSError of any that failed (unless ``quiet``:
        the caller is abandoning the bytes anyway)."""
        with self._mutex:
            running, self._stopped = self._running, True
        if running is not None:
            running.join()
        if self._error is not None and not quiet:
            raise self._error


def drop_cached(fd: int, offset: int = 0, length: int = 0) -> None:
    """Advise the kernel to drop a file's clean cached pages in ``[offset, offset + length)``
    (``length`` 0: to the end). Advice only: a platform or file system without it loses
    nothing. The kernel drops a folio only when the range covers all of it (callers that drop
    part of a file align their ranges: local_packs.py ``ReadRanges``)."""
    if _DONTNEED is None:
        return
    try:
        os.posix_fadvise(fd, offset, length, _DONTNEED)
    except OSError:
        pass


# Linux reads at most a device's readahead window per WILLNEED advice (128 KiB by default):
# a longer range is advised in steps of that.
_READ_AHEAD_STEP = 128 << 10


def read_ahead(fd: int, offset: int, length: int) -> None:
    """Advise the kernel to read ``[offset, offset + length)`` of a file into the page cache in
    the background. Advice only, as ``drop_cached``."""
    if _WILLNEED is None:
        return
    try:
        for start in range(offset, offset + length, _READ_AHEAD_STEP):
            os.posix_fadvise(fd, start, min(_READ_AHEAD_STEP, offset + length - start), _WILLNEED)
    except OSError:
        pass


def available_memory() -> int | None:
    """Bytes the kernel could give to the page cache without swapping (``MemAvailable``), None
    where it does not say."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def write_out(fd: int) -> None:
    """Write a file's dirty pages to the disk now and wait for them, keeping them cached: a large
    file written without a barrier then never makes the kernel throttle its writer, as dirty
    pages past its background threshold do (not a barrier either: no device flush)."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WAIT_ALL)


def write_out_and_drop(fd: int) -> None:
    """Write a file's dirty pages to the disk now, wait for them, and drop them from the page
    cache: for bytes nothing will read soon (compaction's re-encoded older chunks), which would
    otherwise evict what the next checkout reads. Not a barrier: the device may still hold the
    bytes in its cache until a flush (fsync, syncfs) makes them durable."""
    if _SYNC_FILE_RANGE is None or _DONTNEED is None:
        return
    if _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WAIT_ALL) == 0:
        drop_cached(fd)


class DropBehind:
    """The byte ranges of one file that nobody will read again soon, dropped from the page cache
    in steps (``add`` returns what to advise now; ``drop_cached`` does it).

    The kernel drops a cached folio only when the advice covers all of it, folios reach
    megabytes, and the ranges (a commit's chunks, a pack's objects) are not aligned to them:
    adjacent ranges are merged, and each merged range is advised from its first ``align``
    boundary to its last, once another ``step`` bytes were added (the calls stay few). Not
    thread-safe: the caller holds its own lock.
    """

    def __init__(self, step: int = 64 << 20, align: int = 8 << 20) -> None:
        self._step, self._align = step, align
        self._starts: list[int] = []  # disjoint, sorted, never touching
        self._ends: list[int] = []
        self._advised: dict[int, int] = {}  # a range's start -> the aligned end advised last
        self._added = 0  # bytes added since the last advice

    def add(self, offset: int, length: int) -> list[tuple[int, int]]:
        """Record ``[offset, offset + length)``; the ``(offset, length)`` ranges to advise now."""
        end = offset + length
        i = bisect.bisect_left(self._ends, offset)  # the first range that ends at or after offset
        j = i
        while j < len(self._starts) and self._starts[j] <= end:
            offset, end = min(offset, self._starts[j]), max(end, self._ends[j])
            j += 1
        self._starts[i:j], self._ends[i:j] = [offset], [end]
        self._added += length
        if self._added < self._step:
            return []
        self._added = 0
        return self.pending()

    def pending(self) -> list[tuple[int, int]]:
        """Every aligned part of a range not advised as it is now."""
        out: list[tuple[int, int]] = []
        align = self._align
        for start, end in zip(self._starts, self._ends):
            first, last = -(-start // align) * align, end // align * align
            if last > first and self._advised.get(start) != last:
                self._advised[start] = last
                out.append((first, last - first))
        return out
