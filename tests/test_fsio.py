"""fsio.EarlyFlush: background flushes while a long write goes on, errors never lost."""

from __future__ import annotations

import errno
import threading
import time

import pytest

from ckstore.backend.fsio import EarlyFlush


def test_flushes_once_per_threshold_and_one_at_a_time() -> None:
    calls: list[int] = []
    gate = threading.Event()

    def flush() -> None:
        calls.append(1)
        gate.wait(5)

    early = EarlyFlush(flush, every=100)
    early.wrote(99)
    assert calls == []  # below the threshold: nothing yet
    early.wrote(1)
    early.wrote(500)  # a flush is still running: no second one starts
    gate.set()
    early.finish()
    assert calls == [1]


def test_a_failed_early_flush_is_raised_by_finish() -> None:
    def flush() -> None:
        raise OSError(errno.EIO, "Input/output error")

    early = EarlyFlush(flush, every=10)
    early.wrote(10)
    with pytest.raises(OSError) as info:
        early.finish()
    assert info.value.errno == errno.EIO
    early.wrote(100)  # after a failure no more flushes start, and finish stays quiet if asked
    early.finish(quiet=True)


def test_a_filesystem_that_cannot_flush_stops_early_flushes() -> None:
    calls: list[int] = []

    def flush() -> bool:
        calls.append(1)
        return False

    early = EarlyFlush(flush, every=10)
    early.wrote(10)
    deadline = time.monotonic() + 5
    while early.flushing() and time.monotonic() < deadline:
        time.sleep(0.01)
    early.wrote(10)  # the first flush said "cannot": no second one
    early.finish()
    assert calls == [1]
