"""Preemption saves: a scheduler's signal becomes one durable commit at the next safe point.

Slurm and Kubernetes send SIGTERM a grace period before they kill a job; Slurm sends the signal
chosen with ``--signal=USR1@90`` (``B:`` for the batch shell) that many seconds before. Saving
*in* the signal handler would commit whatever the interrupted step had half updated (an optimizer
that stepped half its parameters), so the handler only takes note; the loop asks at the end of
each step, its safe point::

    from ckstore.integrations.preemption import Preemption

    with Preemption(signals=("TERM", "USR1"), push="origin") as preempt:
        for step in range(start, steps):
            train_step()
            preempt.safe_point(repo, lambda: {"model": model.state_dict(), "optimizer": opt.state_dict(),
                                              "step": step, "rng": ckstore.rng_state()},
                               metadata={"step": step})

``safe_point`` does nothing until a signal arrived. Then it waits for background commits in
flight, makes one foreground commit (durable when ``commit_state`` returns: chunks and manifest
synced, ref moved), pushes it if asked, and exits with the code the scheduler expects:
``128 + signal number`` by default (143 for SIGTERM, 138 for SIGUSR1: what a shell reports for a
job the signal ended), or ``exit_code``. Compaction of that commit is skipped (``ckstore wait``
is not needed before the job is killed; the next commit's compaction does what it left).

Requeueing stays the scheduler's: Slurm with ``#SBATCH --requeue`` plus ``on_saved=slurm_requeue``
(``scontrol requeue $SLURM_JOB_ID``); a Kubernetes Job with a ``podFailurePolicy`` on the exit code
(or ``restartPolicy: OnFailure``); submitit by ``chain=True``, which calls the handler installed
before (submitit's, which calls the task's ``checkpoint`` hook and requeues) once the commit is
durable. ``CkstorePreemption`` (Lightning) and ``PreemptionCallback`` (HF Trainer) put the safe
point at the end of every training batch / optimizer step.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from types import FrameType
from typing import Any

from ckstore.errors import InvalidInputError
from ckstore.format.ids import ObjectId
from ckstore.repo import Repo

Handler = Callable[[int, FrameType | None], Any] | int | None


def signal_number(name: str | int) -> int:
    """``"TERM"``, ``"SIGTERM"``, ``"USR1"`` or a number, as a signal number."""
    if isinstance(name, int):
        return int(signal.Signals(name))
    text = name.upper()
    try:
        return int(signal.Signals[text if text.startswith("SIG") else f"SIG{text}"])
    except KeyError:
        raise InvalidInputError(f"unknown signal {name!r} (TERM, USR1, USR2, INT…)") from None


class Preemption:
    """Catch ``signals``; at the next ``safe_point`` commit once, optionally push, and exit."""

    def __init__(
        self,
        signals: Iterable[str | int] = ("TERM",),
        exit_code: int | None = None,
        push: str | bool = False,
        chain: bool = False,
        on_saved: Callable[[ObjectId], object] | None = None,
    ) -> None:
        self.signals = tuple(dict.fromkeys(signal_number(s) for s in signals))
        if not self.signals:
            raise InvalidInputError("Preemption needs at least one signal")
        self.exit_code = exit_code
        self.push = push  # a remote's name, True for the default remote, False: no push
        self.chain = chain
        self.on_saved = on_saved
        self.received: int | None = None  # the first signal that arrived
        self.received_at: float | None = None  # time.monotonic() when it did
        self.saved: ObjectId | None = None
        self._previous: dict[int, Handler] = {}

    # ---- signals ---------------------------------------------------------------------------------

    def install(self) -> Preemption:
        if threading.current_thread() is not threading.main_thread():
            raise InvalidInputError("Preemption installs signal handlers: start it on the main thread")
        for number in self.signals:
            if number not in self._previous:
                self._previous[number] = signal.signal(number, self._note)
        return self

    def uninstall(self) -> None:
        for number, previous in self._previous.items():
            signal.signal(number, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def __enter__(self) -> Preemption:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def _note(self, number: int, frame: FrameType | None) -> None:
        # Only note it: the interrupted step may have updated half of the state.
        if self.received is None:
            self.received, self.received_at = number, time.monotonic()

    @property
    def requested(self) -> bool:
        return self.received is not None

    # ---- the save --------------------------------------------------------------------------------

    def safe_point(
        self,
        repo: Repo,
        state: Callable[[], object] | object,
        message: str | None = None,
        metadata: Mapping[str, object] | None = None,
        branch: str | None = None,
    ) -> None:
        """At the end of a step: nothing, or (after a signal) commit ``state`` and exit.

        ``state`` may be a function returning it, so a step without a signal builds nothing."""
        if self.received is None:
            return
        self.save(repo, state() if callable(state) else state, message, metadata, branch)
        self.exit()

    def save(
        self,
        repo: Repo,
        state: object,
        message: str | None = None,
        metadata: Mapping[str, object] | None = None,
        branch: str | None = None,
    ) -> ObjectId:
        """One durable commit of ``state`` (after any background commit in flight), pushed if asked."""
        name = signal.Signals(self.received).name if self.received is not None else "request"
        repo.wait()  # a background commit in flight lands first (or raises)
        repo.compact_after_commit = False  # the job is about to be killed: leave it to the next commit
        oid = repo.commit_state(
            state,
            message=message or f"preempted ({name})",
            branch=branch,
            metadata={**(metadata or {}), "preempted": name},
        )
        return self.saved_as(repo, oid)

    def saved_as(self, repo: Repo, oid: ObjectId) -> ObjectId:
        """Note the durable commit ``oid`` as the preemption save; push it and tell ``on_saved``."""
        self.saved = oid
        if self.push:
            repo.push(None if self.push is True else self.push)
        if self.on_saved is not None:
            self.on_saved(oid)
        return oid

    def exit(self) -> None:
        """Leave the way the scheduler expects: the previous handler (``chain``), else the exit code."""
        number = self.received or signal.SIGTERM
        previous = self._previous.get(number)
        self.uninstall()
        if self.chain and callable(previous):
            previous(number, None)
        raise SystemExit(self.exit_code if self.exit_code is not None else 128 + number)


def slurm_requeue(_commit: ObjectId | None = None) -> None:
    """Put this Slurm job back in the queue (``scontrol requeue``), as Lightning's SLURM plugin does."""
    job = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    if not job:
        raise InvalidInputError("slurm_requeue: not in a Slurm job (SLURM_JOB_ID is not set)")
    if task := os.environ.get("SLURM_ARRAY_TASK_ID"):
        job = f"{job}_{task}"
    subprocess.run(["scontrol", "requeue", job], check=True, timeout=60)
