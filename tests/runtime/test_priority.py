"""Lower priorities (ckstore/runtime/priority.py): a thread's or the whole process's, by steps."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest

from ckstore.runtime.priority import NICEST, lower

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")


def _in_a_thread(by: int) -> tuple[int, int, bool]:
    """A new thread's nice value before and after ``lower(by, thread=True)``, and its result."""
    seen: list[object] = []

    def body() -> None:
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        applied = lower(by, thread=True)
        seen.extend((before, os.getpriority(os.PRIO_PROCESS, tid), applied))

    worker = threading.Thread(target=body)
    worker.start()
    worker.join()
    before, after, applied = seen
    assert isinstance(before, int) and isinstance(after, int) and isinstance(applied, bool)
    return before, after, applied


def test_a_thread_lowers_its_own_priority_and_leaves_the_others_as_they_were() -> None:
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    before, after, applied = _in_a_thread(3)
    assert applied and after == min(NICEST, before + 3)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine


def test_lowering_stops_at_the_lowest_nice_value() -> None:
    assert _in_a_thread(100)[1] == NICEST


def test_the_process_lowers_every_thread_it_has_and_the_threads_it_starts_later_inherit_it() -> None:
    # In a child: a process's nice value cannot be raised back without privilege.
    script = textwrap.dedent(
        """
        import os, threading
        from ckstore.runtime.priority import lower
        started, stop = threading.Event(), threading.Event()
        def wait():
            started.set()
            stop.wait()
        early = threading.Thread(target=wait)
        early.start()
        started.wait()
        before = {t: os.getpriority(os.PRIO_PROCESS, t) for t in map(int, os.listdir("/proc/self/task"))}
        assert lower(4)
        after = {t: os.getpriority(os.PRIO_PROCESS, t) for t in before}
        later = []
        late = threading.Thread(target=lambda: later.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        late.start()
        late.join()
        stop.set()
        early.join()
        print(len(before), all(after[t] == min(19, before[t] + 4) for t in before), later[0] == min(19, os.nice(0)))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["2", "True", "True"]
