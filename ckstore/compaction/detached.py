"""Compaction in a detached process, the way git detaches its automatic gc.

The CLI's commands return once their commit is durable: the compaction after it (compact.py)
runs in ``python -m ckstore.compaction.detached REPO BRANCH``, started here in a session of its own
(no terminal, so the user's Ctrl-C never reaches it), with its output appended to
``compact.log`` in the repository. It runs at lower priority (runtime/priority.py) on a bounded
number of threads, so a training process on the same machine keeps its cores.

One compaction waits per branch at most: ``start`` takes the branch's place in line
(``LocalBackend.compaction_place``) before it starts the process and hands the descriptor to
it; a commit whose branch already has a compaction waiting starts none, since that one reads
the branch's tip when it gets the compaction lock. The child gives its place up once it holds
the compaction lock, so the next commit can queue behind it.

Killing the process at any moment leaves the repository valid: a compaction applies its
replacements together after one durability barrier, each object ends in its old or its new
encoding (both decode to the same bytes), the locks are flocks that die with their holder, and
every run also covers the pair below the tip, so the next commit's compaction (or repack)
redoes what was left.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from ckstore.errors import CkstoreError, CkstoreWarning

if TYPE_CHECKING:
    from ckstore.compaction.compact import CompactReport
    from ckstore.repository.context import RepoContext

COMPACTION_LOG = "compact.log"  # in the repository: what detached compactions did
# How long a detached compaction waits for the one before it (a big state compacts for minutes);
# after that it leaves its work to the next commit's, losing nothing.
LOCK_WAIT = 3600.0
LOG_LIMIT = 1 << 20  # compact.log is rotated beyond this size
ROTATED_LOG = COMPACTION_LOG + ".1"  # the log before the last rotation
# After its compaction, the process waits this long for a newer commit before it settles the tip's
# own chunks (compact.py, tip.py): an epoch shorter than this leaves them to the next commit's
# compaction, which makes most of them deltas, and the run's end settles them once. Settling
# every epoch doubled the background CPU of an epoch (docs/benchmarks.md, "At rest").
# CKSTORE_QUIET_SECONDS overrides it (the test suite sets 0: no process outlives a test by minutes).
QUIET_SECONDS = 300.0
QUIET_POLL = 1.0  # seconds between two reads of the branch's ref meanwhile
# Quiet that long, it settles only the tip's chunks likely to stay whole (the next compaction
# would settle them anyway); the delta bases (tip.py), which the next epoch's compaction most
# likely makes deltas, once the run looks over: its tip older than RUN_OVER_EPOCHS times the
# median interval between its last RUN_OVER_COMMITS commits (at least QUIET_SECONDS, at most
# RUN_OVER_MAX_QUIETS of them). Epochs longer than QUIET_SECONDS settled every chunk of every
# epoch, two thirds of them only to be made deltas one epoch later (fp32 MiniLM: 1.7 CPU s on
# top of the compaction's 2.2).
RUN_OVER_EPOCHS = 2.0
RUN_OVER_COMMITS = 5
RUN_OVER_MAX_QUIETS = 72.0  # 6 hours at the default
# glibc hands a freed block above its mmap threshold (128 KiB at start, rising to 32 MiB) back to
# the kernel, and trims a thread's heap beyond 128 KiB free: compaction allocates and frees
# chunk-sized buffers (1 MiB encodings, planes, decoded bytes) hundreds of times a run, and each
# came back as fresh pages, faulted in and zeroed again. Kept instead, the run's system time
# halved (fp32 MiniLM epoch: 0.59 -> 0.28 s of 1.5 s CPU); the heap it keeps stays under 128 MiB.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 128 << 20


def workers() -> int:
    """Threads a detached compaction uses: half the cores, at least one."""
    return max(1, (os.cpu_count() or 1) // 2)


def place_key(branch: str) -> str:
    """The branch's file in ``compact-queue/``: branch names may hold '/' and other characters."""
    import hashlib  # here, and subprocess in start: `ckstore status` and `log` import this module for its names

    return hashlib.blake2b(branch.encode(), digest_size=8).hexdigest()


def _can_fork() -> bool:
    """Whether this process may fork its compaction (``start``): on Linux, with no library loaded
    whose native threads a child would miss (torch's OpenMP pool, after ``ckstore import`` ran a
    torch checkpoint): only the forking thread exists in a child."""
    return sys.platform.startswith("linux") and hasattr(os, "fork") and "torch" not in sys.modules


def start(path: Path, branch: str, fork: bool = False) -> bool:
    """Start the detached compaction of ``branch`` in the repository at ``path``; False when one
    already waits for that branch. ``fork``: this process is only a ckstore command (the CLI),
    so the compaction may run in a fork of it (where ``_can_fork``) rather than in a new
    interpreter. Why: the command has imported numpy, zstandard, blake3 and most of ckstore
    already; a new interpreter importing them again cost 0.2-0.25 CPU s, a third of a 0.14 GB
    epoch's compaction. Never a training process's fork: its libraries' threads (CUDA, data
    loaders) would be missing in the child."""
    from ckstore.backend.local import LocalBackend

    fd = LocalBackend(path).compaction_place(place_key(branch))
    if fd is None:
        return False
    path = Path(path).resolve()
    try:
        if not (fork and _can_fork() and _fork(path, branch, fd)):
            _spawn(path, branch, fd)
    except OSError as exc:  # the commit stands: only its compaction is left to the next one
        warnings.warn(
            CkstoreWarning(
                f"could not start the compaction after the commit ({exc}); the commit is"
                " intact, its chunks are stored less compactly until the next commit"
            ),
            stacklevel=1,
        )
        return False
    finally:
        os.close(fd)  # the child's copy holds the place now
    return True


def _spawn(path: Path, branch: str, place: int) -> None:
    """The compaction in a new interpreter, ``python -m ckstore.compaction.detached``."""
    import subprocess

    # The child imports this very ckstore (a source tree on PYTHONPATH, an editable install), and
    # runs in the repository folder, where no stray package can shadow it.
    package_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    # Bounded threads: numpy's BLAS would start one spinning thread per core (the small solves
    # of predicted deltas gain nothing from them); a user's own setting wins.
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    out = _open_log(path)
    try:
        subprocess.Popen(
            [sys.executable, "-m", "ckstore.compaction.detached", str(path), branch, str(place)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            pass_fds=(place,),
            start_new_session=True,
            close_fds=True,
            cwd=path,
            env=env,
        )
    finally:
        os.close(out)


def _open_log(path: Path) -> int:
    """A descriptor appending to the repository's compact.log. The name is opened without
    following a symlink and must be a regular file: anyone who can write into a shared repository
    could otherwise point it at a file of the committer's elsewhere. Past LOG_LIMIT the log is
    rotated, renamed to compact.log.1 (replacing the one before), so its latest lines are kept."""
    log = path / COMPACTION_LOG
    fd = _open_regular(log)
    if os.fstat(fd).st_size >= LOG_LIMIT:
        os.close(fd)
        os.replace(log, path / ROTATED_LOG)  # renames the name itself, never a symlink's target
        fd = _open_regular(log)
    return fd


def _open_regular(log: Path) -> int:
    # O_NONBLOCK: a FIFO planted under the name fails (ENXIO) instead of blocking the command.
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(log))
    return fd


def _fork(path: Path, branch: str, place: int) -> bool:
    """The compaction in a grandchild of this process, in a session of its own (the way a daemon
    detaches: the middle process exits at once, so the command waits for nothing; the grandchild
    is reaped by PID 1, which in a container must be an init: README, "Compression"); False when
    the middle process failed (then ``_spawn``). The log is opened here, so that a repository
    where it cannot be written gets the command's warning (``start``)."""
    out = _open_log(path)
    try:
        null = os.open(os.devnull, os.O_RDONLY)
    except OSError:
        os.close(out)
        raise
    try:
        if min(place, out, null) < 3:
            return False  # a command started without its standard descriptors: dup2 would clobber these
        for stream in (sys.stdout, sys.stderr):
            try:
                if stream is not None:  # None: the command was started with that descriptor closed
                    stream.flush()  # what the command printed so far, printed once: not again from the child
            except (OSError, ValueError, CkstoreError):
                pass  # a closed pipe or stream, a full device: the command's own exit reports it
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.setsid()  # the terminal's Ctrl-C goes to the command's process group, not here
                if os.fork() == 0:
                    _run_forked(path, branch, place, out, null)  # never returns
                code = 0
            finally:
                os._exit(code)  # never back into the command's frames
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status) == 0
    finally:
        os.close(out)
        os.close(null)


def _run_forked(path: Path, branch: str, place: int, out: int, null: int) -> None:
    """The forked compaction: detached from the command's descriptors, signals and output (``out``:
    the log, ``null``: /dev/null), then ``run``; exits the process (the command's frames above
    are never unwound here)."""
    import gc
    import signal

    code = 1
    try:
        # The command's objects stay as they are: none is collected here, so none can close a
        # descriptor number that this process reuses once the command's are closed below.
        gc.freeze()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        # Every other descriptor is the command's: its lock files (a flock lasts while any copy
        # is open), its pipes to a caller waiting for end of file (a training script's
        # subprocess.run), its open packs.
        os.closerange(3, place)
        os.closerange(place + 1, _max_descriptor())
        import io

        sys.stdout = sys.stderr = io.TextIOWrapper(
            io.FileIO(1, "w", closefd=False), line_buffering=True, errors="backslashreplace"
        )
        os.chdir(path)
        code = run(str(path), branch, place)
    except BaseException:  # noqa: BLE001 - the log is the only place left to say it
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
        finally:
            os._exit(code)


def _max_descriptor() -> int:
    try:
        return os.sysconf("SC_OPEN_MAX")
    except (OSError, ValueError):
        return 1 << 16


def keep_freed_memory() -> None:
    """Have glibc keep freed memory for reuse (see TRIM_THRESHOLD); nothing elsewhere."""
    import ctypes

    from ckstore.backend.fsio import libc_function

    mallopt = libc_function("mallopt", [ctypes.c_int, ctypes.c_int])
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)


def cpu_seconds() -> float:
    """CPU seconds of this process so far, every thread (a forked process counts from its fork)."""
    return time.process_time()


def _say(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} pid {os.getpid()}: {message}", flush=True)


def run(path: str, branch: str, place: int) -> int:
    """The detached process: wait for the compaction lock, give up the place in line (``place``
    < 0: none, scripts/bench_user_path.py times the process that way), compact."""
    from ckstore.runtime.priority import BESIDE_TRAINING, lower

    lower(BESIDE_TRAINING)  # training's data loading and steps come first
    keep_freed_memory()
    from ckstore.compaction.compact import compact_branch
    from ckstore.repository.context import open_context
    from ckstore.repository.refs import HEADS
    from ckstore.runtime.pipeline import limit_workers

    limit_workers(workers())
    started = time.monotonic()
    try:
        ctx = open_context(path)

        def locked() -> None:
            if place >= 0:
                os.close(place)  # the next commit may queue behind this run now
            _say(f"compacting {branch!r}")

        report = compact_branch(ctx, branch, lock_timeout=LOCK_WAIT, on_locked=locked)
        _say(_report_text(branch, started, report))
        tip = ctx.refs.read(HEADS + branch)
        if tip is None or not _quiet(ctx, branch, tip, quiet_seconds()):
            return 0
        _say(f"no commit on {branch!r} for {quiet_seconds():.0f} s: settling what of its newest commit stays whole")
        started = time.monotonic()
        report = compact_branch(ctx, branch, lock_timeout=LOCK_WAIT, settle=True, defer_bases=True)
        _say(_report_text(branch, started, report) + ("" if report.at_rest else ", not yet at rest"))
        over = run_over_after(ctx, tip)
        if not report.at_rest and _quiet(ctx, branch, tip, over - _age(ctx, tip)):
            _say(f"no commit on {branch!r} for {over:.0f} s: settling the rest of its newest commit")
            started = time.monotonic()
            report = compact_branch(ctx, branch, lock_timeout=LOCK_WAIT, settle=True)
            _say(_report_text(branch, started, report))
    except CkstoreError as exc:
        _say(
            f"compacting {branch!r} failed ({exc}); every commit is intact, its chunks are only stored less"
            " compactly until the next commit's compaction or 'ckstore repack'"
        )
        return 1
    return 0


def _report_text(branch: str, started: float, report: CompactReport) -> str:
    return (
        f"compacted {branch!r} in {time.monotonic() - started:.1f} s ({cpu_seconds():.2f} CPU s): {report.deltas}"
        f" delta(s) ({report.predicted} predicted), {report.recompressed} recompressed, {report.saved} bytes saved"
        + (", at rest" if report.at_rest else "")
    )


def run_over_after(ctx: RepoContext, tip: str) -> float:
    """How old ``tip`` must be for its run to look over (see RUN_OVER_EPOCHS), in seconds."""
    import statistics

    quiet = quiet_seconds()
    try:
        from ckstore.format.ids import ObjectId

        times = [c.timestamp for c in ctx.graph.first_parents(ObjectId(tip), RUN_OVER_COMMITS + 1)]
    except (CkstoreError, ValueError):
        times = []
    intervals = [newer - older for newer, older in zip(times, times[1:]) if newer >= older]
    epoch = statistics.median(intervals) if intervals else 0.0
    return min(max(quiet, RUN_OVER_EPOCHS * epoch), RUN_OVER_MAX_QUIETS * quiet)


def _age(ctx: RepoContext, tip: str) -> float:
    """Seconds since ``tip`` was committed (0 when its time cannot be read)."""
    try:
        return max(0.0, time.time() - ctx.graph.read_commit(tip, files=False).timestamp)
    except (CkstoreError, ValueError):
        return 0.0


def _quiet(ctx: RepoContext, branch: str, tip: str, seconds: float) -> bool:
    """Sleep until ``branch`` has kept ``tip`` for ``seconds`` more (True), or until a newer commit
    arrives or something else brought ``tip`` to rest (False). Holds no lock meanwhile: gc, repack
    and the newer commit's own compaction go on, and the sleep costs no CPU."""
    from ckstore.compaction.at_rest import is_at_rest
    from ckstore.repository.refs import HEADS

    deadline = time.monotonic() + max(0.0, seconds)
    while time.monotonic() < deadline:
        time.sleep(min(QUIET_POLL, max(0.0, deadline - time.monotonic())))
        if ctx.refs.read(HEADS + branch) != tip or is_at_rest(ctx.backend, tip):
            return False
    return ctx.refs.read(HEADS + branch) == tip and not is_at_rest(ctx.backend, tip)


def quiet_seconds() -> float:
    try:
        return max(0.0, float(os.environ.get("CKSTORE_QUIET_SECONDS", QUIET_SECONDS)))
    except ValueError:
        return QUIET_SECONDS


if __name__ == "__main__":
    sys.exit(run(sys.argv[1], sys.argv[2], int(sys.argv[3])))
