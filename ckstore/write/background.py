"""Commits that finish in the background, so a training loop waits only for a snapshot.

``Repo.commit_state(..., background=True)`` takes a private copy of the state's tensors in the
caller's thread (CPU tensors copied once; CUDA tensors copied into pinned host memory, then one
synchronize), returns a ``CommitHandle``, and hashes, encodes and writes on one worker thread.
At most ``max_in_flight`` snapshots exist at a time: the next background commit waits for a slot
before copying anything, which bounds host memory to that many copies of the state.

Errors are never silent: ``handle.result()`` raises the commit's error, and a failed commit that
nobody looked at is raised again by the next commit through the same repository. At interpreter
exit pending commits are waited for; a failure nobody observed is printed on stderr.

``Compactions`` runs the compaction that follows every commit (compact.py) the same way: on its
own worker thread, waited for at interpreter exit; or, when the repository's ``BackgroundWork``
says ``detach_compaction`` (the CLI), in a process of its own that outlives this one
(detached.py), so that a command returns as soon as its commit is durable.

``BackgroundWork`` is all of this for one open repository (``work_for(ctx)``): ``Repo`` and the
DCP writer hold no background state of their own, they ask for the context's.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from ckstore.errors import CkstoreError, CkstoreWarning, LockedError
from ckstore.format.ids import ObjectId
from ckstore.repository.context import RepoContext

if TYPE_CHECKING:
    from concurrent.futures import Future, ThreadPoolExecutor

T = TypeVar("T")


class CommitHandle:
    """A commit running in the background."""

    def __init__(self, future: Future[str], owner: BackgroundCommits) -> None:
        self._future = future
        self._owner = owner

    def result(self, timeout: float | None = None) -> str:
        """The commit id once it is recorded; raises the commit's error if it failed."""
        self._owner.observed(self._future)
        return self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()

    def add_done_callback(self, fn: Callable[[str], None]) -> None:
        """Call ``fn(commit id)`` once the commit is recorded (on the worker thread; not on failure)."""
        self._future.add_done_callback(lambda f: None if f.exception() is not None else fn(f.result()))

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._owner.observed(self._future)
        return self._future.exception(timeout)


class BackgroundCommits:
    """One worker thread and a bounded number of snapshots in flight, per repository."""

    def __init__(self, max_in_flight: int = 1) -> None:
        if max_in_flight < 1:
            raise CkstoreError("max_in_flight must be at least 1")
        self.max_in_flight = max_in_flight
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._executor = _one_thread_pool("ckstore-commit")
        self._pending: list[Future[str]] = []
        self._unobserved: list[Future[str]] = []  # failed, and nobody called result() yet
        self._observed: set[Future[str]] = set()  # a handle's result() or exception() was called
        self._lock = threading.Lock()
        _LIVE.add(self)

    def submit(self, snapshot: Callable[[], T], write: Callable[[T], str]) -> CommitHandle:
        """Wait for a free slot, take the snapshot here, write it on the worker thread."""
        self.raise_unobserved()
        self._slots.acquire()
        try:
            taken = snapshot()
            future = self._executor.submit(write, taken)
        except BaseException:
            self._slots.release()
            raise
        with self._lock:
            self._pending.append(future)
        future.add_done_callback(self._finished)
        return CommitHandle(future, self)

    def _finished(self, future: Future[str]) -> None:
        self._slots.release()
        with self._lock:
            self._pending.remove(future)
            if future.exception() is not None and future not in self._observed:
                self._unobserved.append(future)
            self._observed.discard(future)

    def observed(self, future: Future[str]) -> None:
        with self._lock:
            if future in self._unobserved:
                self._unobserved.remove(future)
            elif not future.done() or future in self._pending:
                self._observed.add(future)  # still running: its failure is the caller's to see

    def raise_unobserved(self) -> None:
        """Raise the error of an earlier background commit that nobody has looked at."""
        with self._lock:
            failed = self._unobserved.pop(0) if self._unobserved else None
        if failed is not None:
            error = failed.exception()
            assert error is not None
            raise error

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def wait(self) -> None:
        """Wait for every pending commit and its done-callbacks (errors stay on their handles)."""
        with self._lock:
            pending = list(self._pending)
        for future in pending:
            future.exception()
        # Done-callbacks run on the worker thread before it takes the next job: a no-op job
        # finishing means every earlier callback has finished too.
        self._executor.submit(lambda: None).result()

    def close(self) -> None:
        with self._lock:
            pending = list(self._pending)
        for future in pending:
            future.exception()
        self._executor.shutdown(wait=True)  # after its callbacks, like wait()
        with self._lock:
            failed = list(self._unobserved)
            self._unobserved.clear()
        for future in failed:
            print(
                f"ckstore: a background commit failed and nobody checked its result: {future.exception()}",
                file=sys.stderr,
            )


class Compactions:
    """Compaction (compact.py) on one worker thread per repository, after each commit.

    A request made while another is waiting replaces it: every run also compacts the pair below
    the tip, so the newest request covers what the older one would have done. A failure never
    touches a commit (the objects only stay bigger): it is reported as a CkstoreWarning.
    """

    def __init__(self) -> None:
        self._executor = _one_thread_pool("ckstore-compact")
        self._lock = threading.Lock()
        self._next: Callable[[], object] | None = None
        self._scheduled = False
        _LIVE_COMPACTIONS.add(self)

    def request(self, job: Callable[[], object]) -> None:
        with self._lock:
            self._next = job
            if self._scheduled:
                return
            self._scheduled = True
        self._executor.submit(self._run)

    def _run(self) -> None:
        while True:
            with self._lock:
                job, self._next = self._next, None
                if job is None:
                    self._scheduled = False
                    return
            try:
                job()
            except Exception as exc:  # a background thread: the warning is the only way out
                warnings.warn(
                    CkstoreWarning(
                        f"compacting after a commit failed ({exc}); every commit is intact, its chunks are only"
                        " stored less compactly until the next commit or 'ckstore repack'"
                    ),
                    stacklevel=1,
                )

    def busy(self) -> bool:
        with self._lock:
            return self._scheduled

    def wait(self) -> None:
        """Wait until no compaction is running or waiting."""
        self._executor.submit(lambda: None).result()

    def close(self) -> None:
        self.wait()
        self._executor.shutdown(wait=True)


@dataclass(frozen=True)
class BackgroundStatus:
    """What still runs for a repository after the calls that started it returned."""

    commits_pending: int  # background commits of this process not recorded yet
    compaction_pending: bool  # a compaction runs or waits its turn, in this process or another
    recorded: tuple[ObjectId, ...]  # commits recorded through this repository by this process, oldest first
    log: Path | None  # where detached compactions write what they did (None: in memory)


class BackgroundWork:
    """The background commits and compactions of one open repository, and how they run."""

    def __init__(self) -> None:
        self.commits_in_flight = 1  # background commits: snapshots held at once (host memory)
        # Re-encode each commit's parent as deltas once the commit is durable (compact.py); False
        # leaves it to the next commit that compacts, or to repack.
        self.compact_after_commit = True
        # Compact in a detached process instead of this process's thread (the CLI: detached.py).
        self.detach_compaction = False
        # That process is a fork of this one (detached.start): this process is only a ckstore command.
        self.fork_compaction = False
        self.recorded: list[ObjectId] = []
        self._commits: BackgroundCommits | None = None
        self._compactions: Compactions | None = None
        self._lock = threading.Lock()

    def submit_commit(self, snapshot: Callable[[], T], write: Callable[[T], str]) -> CommitHandle:
        with self._lock:
            if self._commits is None:
                self._commits = BackgroundCommits(self.commits_in_flight)
            commits = self._commits
        return commits.submit(snapshot, write)

    def wait_commits(self) -> None:
        """Wait for background commits; raise the error of one that failed unobserved."""
        if self._commits is not None:
            self._commits.wait()
            self._commits.raise_unobserved()

    def wait(self) -> None:
        """Wait for background commits, then for this process's compactions after them."""
        self.wait_commits()
        if self._compactions is not None:
            self._compactions.wait()

    def commit_recorded(self, ctx: RepoContext, oid: ObjectId, branch: str, compact: bool) -> None:
        """A commit moved ``branch``: remember it and start the compaction after it."""
        with self._lock:
            self.recorded.append(oid)
        if not compact or not self.compact_after_commit:
            return
        if self.detach_compaction and ctx.path is not None:
            from ckstore.compaction.detached import start

            start(ctx.path, branch, fork=self.fork_compaction)
            return
        with self._lock:
            if self._compactions is None:
                self._compactions = Compactions()
            compactions = self._compactions
        compactions.request(lambda: _compact(ctx, branch))

    def status(self, ctx: RepoContext) -> BackgroundStatus:
        pending = self._commits.pending() if self._commits is not None else 0
        busy = self._compactions is not None and self._compactions.busy()
        if not busy:
            busy = ctx.backend.compaction_queued() or not _lock_free(ctx)
        from ckstore.compaction.detached import COMPACTION_LOG

        log = None if ctx.path is None else ctx.path / COMPACTION_LOG
        return BackgroundStatus(pending, busy, tuple(self.recorded), log)


def _compact(ctx: RepoContext, branch: str) -> object:
    from ckstore.compaction.compact import compact_branch

    return compact_branch(ctx, branch)


def _lock_free(ctx: RepoContext) -> bool:
    try:
        with ctx.backend.compaction_lock(0):
            return True
    except LockedError:
        return False


# Per open repository (RepoContext, by identity); an entry goes with its context.
_WORK: dict[int, BackgroundWork] = {}
_WORK_LOCK = threading.Lock()


def work_for(ctx: RepoContext) -> BackgroundWork:
    """The background work of ``ctx`` (created on first use)."""
    with _WORK_LOCK:
        work = _WORK.get(id(ctx))
        if work is None:
            work = _WORK[id(ctx)] = BackgroundWork()
            weakref.finalize(ctx, _WORK.pop, id(ctx), None)
        return work


def wait_all() -> None:
    """Wait for every repository's background commits and compactions in this process."""
    with _WORK_LOCK:
        works = list(_WORK.values())
    for work in works:
        work.wait()


_LIVE: weakref.WeakSet[BackgroundCommits] = weakref.WeakSet()
_LIVE_COMPACTIONS: weakref.WeakSet[Compactions] = weakref.WeakSet()


def _forget_parents_work() -> None:
    # A forked child (a DataLoader worker, multiprocessing) has none of the parent's pool
    # threads: at its exit it must not wait for the parent's pending work, which would hang.
    _LIVE.clear()
    _LIVE_COMPACTIONS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_parents_work)


def _wait_at_exit() -> None:
    for committer in list(_LIVE):
        committer.close()
    # After the commits: each of them requests a compaction when it is recorded.
    for compactions in list(_LIVE_COMPACTIONS):
        compactions.close()


_HOOK_LOCK = threading.Lock()
_hooked = False


def _one_thread_pool(name: str) -> ThreadPoolExecutor:
    """A pool of one thread; the first also registers ``_wait_at_exit``.

    A pending commit still needs the worker pools, and concurrent.futures refuses new work once
    its own exit hook (a threading "atexit", run before ``atexit``'s) has run. Threading's hooks
    run last-registered first, so ours is registered once concurrent.futures is imported, here:
    not when this module is (``ckstore log`` and ``status`` never start a pool)."""
    from concurrent.futures import ThreadPoolExecutor

    global _hooked
    with _HOOK_LOCK:
        if not _hooked:
            _hooked = True
            register = getattr(threading, "_register_atexit", None)
            if register is not None:
                register(_wait_at_exit)
            else:  # pragma: no cover (CPython < 3.9)
                atexit.register(_wait_at_exit)
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
