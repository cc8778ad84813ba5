"""Work that must not slow what the machine is for: a lower, or the lowest, CPU priority.

``lower`` takes a thread or the whole process ``by`` nice steps down from where it is: the local
compaction beside a training loop (compaction/compact.py's worker threads, the detached
compaction process of compaction/detached.py) takes 10, so training's data loading and steps
come first while compaction still gets a fair share of a busy machine.

A detached process that re-encodes a remote's previous save (dcp/remote_compaction.py) shares
the machine with the training loop that just saved; at normal priority its CPU time competes
with the next save and the next steps. ``lowest`` puts every thread of the calling process on:

- ``SCHED_IDLE``: the scheduler runs it only on a core nothing else wants (weight 3 against a
  normal task's 1024); unprivileged processes may enter it on Linux (2.6.39 and later), a
  sandbox may refuse it;
- nice 19, which still ranks it last where ``SCHED_IDLE`` is refused or does not exist
  (macOS), and for the threads the kernel gives it later (threads inherit both);
- no I/O priority of its own: Linux derives a process's I/O class from its scheduling policy
  while none is set (``SCHED_IDLE`` -> the idle class, on the I/O schedulers that honour
  classes, BFQ), so ``ioprio_set``, which the standard library lacks, adds nothing.

Each step is best effort: a refusal leaves the process as it was on that point, never fails it.
"""

from __future__ import annotations

import os
import sys
import threading

NICEST = 19
BESIDE_TRAINING = 10  # nice steps the local compaction takes down (``lower``)


def _threads() -> list[int]:
    """This process's thread ids (Linux: /proc/self/task); elsewhere the calling thread's, as 0."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def lowest() -> list[str]:
    """Move every thread of this process to the lowest priority it may take; what was applied
    (``"SCHED_IDLE"``, ``"nice 19"``), for the process's log."""
    applied: set[str] = set()
    idle = getattr(os, "SCHED_IDLE", None)
    for tid in _threads():
        # Policy and nice value are per thread on Linux: a thread started before this call
        # would otherwise keep running at normal priority.
        if idle is not None and hasattr(os, "sched_setscheduler"):
            try:
                os.sched_setscheduler(tid, idle, os.sched_param(0))
                applied.add("SCHED_IDLE")
            except OSError:
                pass
        try:
            os.setpriority(os.PRIO_PROCESS, tid, NICEST)
            applied.add(f"nice {NICEST}")
        except OSError:
            pass
    return sorted(applied)


def lower(by: int, thread: bool = False) -> bool:
    """Lower the priority of every thread of this process, or of the calling thread only
    (``thread``), by ``by`` nice steps, to NICEST at most; True when it was applied.

    ``thread`` needs Linux, where nice values are per thread; elsewhere it does nothing, since
    there the same call would lower the whole process. Threads started later inherit the value
    of the thread that starts them."""
    if thread and not sys.platform.startswith("linux"):
        return False
    applied = False
    for tid in [threading.get_native_id()] if thread else _threads():
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(NICEST, os.getpriority(os.PRIO_PROCESS, tid) + by))
            applied = True
        except OSError:
            pass  # a sandbox that forbids it: the work still runs, only at the priority it had
    return applied


__all__ = ["BESIDE_TRAINING", "NICEST", "lower", "lowest"]
