"""The coordinator's hold on the writers' locks for the length of one DCP save.

The coordinator takes the shared locks before any rank writes (its global plan goes out only
after) and must keep them until the ref has moved, so that gc cannot delete a rank's objects
between their write and the manifest that names them. DCP has no abort callback: when any rank
fails — in the Writer's ``write_data``, in the planner's ``finish_plan`` or ``resolve_data``,
anywhere before ``finish`` — DCP gathers the failure to the coordinator and raises
``CheckpointException`` there (and on every rank) without calling ``finish``. So from planning
on, the coordinator watches the thread that runs the save: once DCP's save call has left that
thread's stack without ``finish`` having run, the save failed somewhere and the locks go at
once. A failure of the coordinator's own ``write_data`` releases them at once too. When
the save runs under something other than DCP's save function (no such frame is found), or a
rank died and the gather waits for it, ``lock_hold`` seconds after planning is the bound.
"""

from __future__ import annotations

import sys
import threading
from contextlib import ExitStack
from types import FrameType

from ckstore.repository.context import RepoContext
from ckstore.repository.writing import writing

# The functions of torch.distributed.checkpoint that run one save from planning to ``finish``.
SAVE_FUNCTIONS = frozenset({"_save_state_dict"})
WATCH_INTERVAL = 0.05  # seconds between looks at the saving thread's stack


def _save_frame(frame: FrameType | None) -> FrameType | None:
    """The innermost frame of DCP's save function at or above ``frame``."""
    while frame is not None:
        code = frame.f_code
        if code.co_name in SAVE_FUNCTIONS and "torch" in code.co_filename:
            return frame
        frame = frame.f_back
    return None


def _on_stack(thread: int, frame: FrameType) -> bool:
    here = sys._current_frames().get(thread)
    while here is not None:
        if here is frame:
            return True
        here = here.f_back
    return False


class SaveHold:
    """Held locks of one save, released by ``release``, when the save is seen to have failed, or
    after ``lock_hold`` seconds, whichever comes first."""

    def __init__(self) -> None:
        self._guard = threading.Lock()  # release runs on the timer's and the watcher's threads too
        self._held: ExitStack | None = None
        self._timer: threading.Timer | None = None
        self._done = threading.Event()  # set by release: the watcher stops

    def take(self, ctx: RepoContext, lock_hold: float) -> None:
        """Take the writers' locks; call it from the coordinator's ``prepare_global_plan``, on the
        thread that runs DCP's save."""
        self.release()
        held = ExitStack()
        held.enter_context(writing(ctx))
        timer = threading.Timer(lock_hold, self.release)
        timer.daemon = True
        with self._guard:
            self._held, self._timer, self._done = held, timer, threading.Event()
        timer.start()
        frame = _save_frame(sys._getframe(1))
        if frame is None:
            return  # not under DCP's save function: the lock_hold bound applies
        watcher = threading.Thread(target=self._watch, args=(threading.get_ident(), frame, self._done), daemon=True)
        del frame  # the watcher holds the only reference, dropped when it ends
        watcher.start()

    def _watch(self, thread: int, frame: FrameType, done: threading.Event) -> None:
        while not done.wait(WATCH_INTERVAL):
            if not _on_stack(thread, frame):
                break
        del frame
        with self._guard:
            ours = self._done is done
        if ours:  # not a later save's hold
            self.release()

    def release(self) -> None:
        with self._guard:
            held, timer, done = self._held, self._timer, self._done
            self._held, self._timer = None, None
        done.set()
        if timer is not None:
            timer.cancel()
        if held is not None:
            held.close()
