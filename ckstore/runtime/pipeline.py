"""Ordered, bounded parallel map: the engine behind streaming commit and checkout.

blake3 and zstandard release the GIL, so threads use every core; at most ``max_inflight`` items
are queued or running, which bounds memory to that many chunks whatever the file size.
"""

from __future__ import annotations

import gc
import os
import threading
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


_WORKER_LIMIT: int | None = None


def default_workers() -> int:
    return max(1, min(32, _WORKER_LIMIT or os.cpu_count() or 1))


def limit_workers(n: int) -> None:
    """Use at most ``n`` threads from now on (a detached compaction leaves cores to training).
    Call before the first parallel map: the shared pool is sized when first used."""
    global _WORKER_LIMIT
    _WORKER_LIMIT = max(1, n)


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
_IN_WORKER = threading.local()


def _shared_pool() -> ThreadPoolExecutor:
    """One pool per process: loading a state of many small tensors must not start threads per tensor."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(
                max_workers=default_workers(),
                thread_name_prefix="ckstore",
                initializer=lambda: setattr(_IN_WORKER, "active", True),
            )
        return _POOL


def _forget_threads_after_fork() -> None:
    """A forked child has only the thread that forked (a detached compaction: detached.py): the
    shared pool's workers are not there to run what it is given, and a lock another thread held
    stays held. The pool starts afresh when first used."""
    global _POOL, _POOL_LOCK, _GC_LOCK
    _POOL, _POOL_LOCK, _GC_LOCK = None, threading.Lock(), threading.Lock()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forget_threads_after_fork)


GROUP_MAX_ITEMS = 64


def grouped(items: Iterable[T], size: Callable[[T], int], limit: int) -> Iterator[list[T]]:
    """Consecutive items in lists of at most ``limit`` bytes (an item larger than that alone) and
    ``GROUP_MAX_ITEMS`` items: one pool task per list. A checkpoint has hundreds of tiny tensors
    (biases, norms, optimizer steps), and one task each cost more in hand-offs under the GIL than
    hashing, storing or decoding them."""
    group: list[T] = []
    total = 0
    for item in items:
        n = size(item)
        if group and (total + n > limit or len(group) >= GROUP_MAX_ITEMS):
            yield group
            group, total = [], 0
        group.append(item)
        total += n
    if group:
        yield group


def ordered_map(
    fn: Callable[[T], R],
    items: Iterable[T],
    workers: int | None = None,
    max_inflight: int | None = None,
    pool: Executor | None = None,
) -> Generator[R, None, None]:
    """Yield ``fn(item)`` for each item, in input order, computing up to ``workers`` at once.

    ``workers`` None uses the process-wide pool; a call made from inside one of its workers runs
    sequentially, since waiting on the same bounded pool could deadlock. ``pool`` (with its size as
    ``workers``) runs every item on the caller's own pool, even a one-thread one (compaction's,
    whose threads run at a lower priority).
    """
    if pool is None and (getattr(_IN_WORKER, "active", False) or workers == 1 or default_workers() == 1):
        yield from map(fn, items)
        return
    own = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckstore") if workers and pool is None else None
    pool = pool or own or _shared_pool()
    max_inflight = max_inflight or 2 * (workers or default_workers()) + 1
    pending: deque[Future[R]] = deque()
    try:
        for item in items:
            if len(pending) >= max_inflight:
                yield pending.popleft().result()
            pending.append(pool.submit(fn, item))
        while pending:
            yield pending.popleft().result()
    finally:
        for future in pending:
            future.cancel()
        for future in pending:  # a cancelled map must not leave work running behind its caller
            if not future.cancelled():
                future.exception()
        if own is not None:
            own.shutdown(wait=True)


_GC_PAUSES = 0
_GC_WAS_ENABLED = False
_GC_LOCK = threading.Lock()


@contextmanager
def collection_paused() -> Iterator[None]:
    """No automatic garbage collection while the block runs (nested and concurrent blocks alike);
    the interpreter's setting is restored when the last block ends.

    A commit keeps tens of objects per chunk alive until its manifest is written (chunk refs,
    results, futures), which kept triggering collections that traverse every object of the
    process (torch's and the training script's): a 3 GB commit_state ran 258 collections, one
    full one of 0.32 s. Its objects are freed by reference counting when it returns, before any
    collection needs to look at them.
    """
    global _GC_PAUSES, _GC_WAS_ENABLED
    with _GC_LOCK:
        if _GC_PAUSES == 0:
            _GC_WAS_ENABLED = gc.isenabled()
            gc.disable()
        _GC_PAUSES += 1
    try:
        yield
    finally:
        with _GC_LOCK:
            _GC_PAUSES -= 1
            if _GC_PAUSES == 0 and _GC_WAS_ENABLED:
                gc.enable()
