"""Ordered, bounded parallel map: the engine behind streaming commit and checkout.

blake3 and zstandard release the GIL, so threads use every core; at most ``max_inflight`` items
are queued or running, which bounds memory to that many chunks whatever the file size.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def default_workers() -> int:
    return max(1, min(32, os.cpu_count() or 1))


def ordered_map(
    fn: Callable[[T], R], items: Iterable[T], workers: int | None = None, max_inflight: int | None = None
) -> Iterator[R]:
    """Yield ``fn(item)`` for each item, in input order, computing up to ``workers`` at once."""
    workers = workers or default_workers()
    max_inflight = max_inflight or 2 * workers + 1
    if workers == 1:
        yield from map(fn, items)
        return
    pending: deque[Future[R]] = deque()
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckstore") as pool:
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
