"""submitit: a job's preemption or timeout signal becomes one ckstore commit, and the requeued job resumes from it.

submitit calls a ``Checkpointable`` task's ``checkpoint`` hook from its signal handler (USR2 by
default, ``SUBMITIT_PREEMPT_SIGNAL``; sent on preemption and ``signal_delay_s`` before the time
limit), then requeues the job. That handler interrupts whatever step was running, so saving there
would commit a half-updated state. ``CkstoreCheckpointable.preemption()`` is a ``Preemption``
(preemption.py) on that signal with ``chain=True``: the handler only takes note, the loop's next
safe point makes the durable commit, and only then does submitit's own handler run: it calls
``checkpoint`` (which resubmits this task, carrying the commit in ``resume``) and requeues::

    import submitit
    from ckstore.integrations.submitit import CkstoreCheckpointable

    class Train(CkstoreCheckpointable):
        def __call__(self, repo_path, steps):
            repo = Repo(repo_path)
            model, opt, start = build(), ..., 0
            if (state := self.resume_state(repo)) is not None:   # a requeued job
                model.load_state_dict(state["model"]); opt.load_state_dict(state["optimizer"])
                ckstore.set_rng_state(state["rng"]); start = state["step"] + 1
            with self.preemption() as preempt:
                for step in range(start, steps):
                    train_step()
                    preempt.safe_point(repo, lambda: {"model": model.state_dict(), "optimizer": opt.state_dict(),
                                                      "step": step, "rng": ckstore.rng_state()})

    job = submitit.AutoExecutor(folder="jobs").submit(Train(), "runs/.ckstore", 10_000)

A signal that arrives outside the ``with`` block goes straight to submitit: the job is requeued
without a new commit and resumes from the last one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ckstore.errors import MissingDependencyError
from ckstore.format.ids import ObjectId
from ckstore.integrations.preemption import Preemption
from ckstore.repo import Repo

try:
    from submitit.core.job_environment import JobEnvironment
    from submitit.helpers import Checkpointable
except ImportError:  # pragma: no cover - depends on what is installed
    raise MissingDependencyError("ckstore.integrations.submitit needs submitit: pip install submitit") from None


def preemption_signal() -> int:
    """The signal submitit's jobs get on preemption and before their time limit (USR2 unless
    ``SUBMITIT_PREEMPT_SIGNAL`` says otherwise)."""
    return int(JobEnvironment._usr_sig())


class CkstoreCheckpointable(Checkpointable):
    """A submitit task whose preemption save is a ckstore commit at the loop's next safe point."""

    resume: ObjectId | None = None  # the commit a requeued job starts from (set by the preemption save)

    def preemption(self, push: str | bool = False, on_saved: Callable[[ObjectId], object] | None = None) -> Preemption:
        """A ``Preemption`` on submitit's signal that hands over to submitit once its commit is durable."""

        def saved(oid: ObjectId) -> None:
            self.resume = oid  # pickled with this task when submitit's handler resubmits it
            if on_saved is not None:
                on_saved(oid)

        return Preemption(signals=(preemption_signal(),), push=push, chain=True, on_saved=saved)

    def resume_state(self, repo: Repo, branch: str | None = None, **load: Any) -> Any:
        """The state to resume from: the preemption save this task carries, else the newest commit
        of ``branch`` (default: the current one) when the job was requeued without one; None for
        a fresh start."""
        if self.resume is not None:
            return repo.load_state(self.resume, **load)
        name = branch or repo.head_branch
        return repo.load_state(name, **load) if name in repo.branches() else None
