"""Hugging Face Trainer: commit model, optimizer, scheduler, trainer state and RNG to ckstore.

    from ckstore.integrations.hf import CkstoreCallback
    trainer = Trainer(..., callbacks=[CkstoreCallback("ckpts/.ckstore", branch="run1")])

The callback commits on every Trainer save (``on="save"``, following ``save_strategy``) or at the
end of every epoch (``on="epoch"``), with metadata ``epoch``, ``step`` (global step) and the
newest logged metrics (``loss``, ``eval_loss``…), so ``ckstore best eval_loss`` and
``ckstore gc --keep-best 3 --metric eval_loss`` work. Trainer still writes its own output_dir
checkpoints when ``save_strategy`` says so; with ``on="epoch"`` and ``save_strategy="no"`` ckstore
is the only checkpoint store. ``restore(repo, ref, model, optimizer, scheduler)`` loads one back.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ckstore.errors import InvalidInputError, MissingDependencyError
from ckstore.integrations import open_repo, plain, scalar_metrics
from ckstore.integrations.preemption import Preemption
from ckstore.repo import CommitHandle, Repo
from ckstore.training.state import rng_state, set_rng_state

try:
    from transformers import TrainerCallback
except ImportError:  # pragma: no cover - depends on what is installed
    raise MissingDependencyError("ckstore.integrations.hf needs transformers: pip install transformers") from None


class CkstoreCallback(TrainerCallback):
    """Commit the training state to ckstore on Trainer saves or at epoch ends."""

    def __init__(
        self, repo: Repo | str | os.PathLike[str], branch: str | None = None, on: str = "save", background: bool = False
    ) -> None:
        if on not in ("save", "epoch"):
            raise InvalidInputError("on must be 'save' or 'epoch'")
        self.repo = open_repo(repo)
        self.branch = branch
        self.on = on
        self.background = background  # the Trainer waits only for a copy of the tensors
        self.commits: list[str] = []

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.on == "save" and state.is_world_process_zero:
            self._commit(state, kwargs)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.on == "epoch" and state.is_world_process_zero:
            self._commit(state, kwargs)

    def snapshot(self, state: Any, parts: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The training state to commit and its metadata, from a callback's ``state`` and kwargs."""
        model, optimizer, scheduler = parts.get("model"), parts.get("optimizer"), parts.get("lr_scheduler")
        if model is None:
            raise InvalidInputError("the Trainer passed no model to the callback")
        snapshot: dict[str, Any] = {
            "model": model.state_dict(),
            "rng": rng_state(),
            "trainer_state": plain(dataclasses.asdict(state)),
        }
        if optimizer is not None:
            snapshot["optimizer"] = optimizer.state_dict()
        if scheduler is not None:
            snapshot["scheduler"] = scheduler.state_dict()
        metrics: dict[str, Any] = {}
        for entry in state.log_history:  # newest value of every logged metric
            metrics.update(entry)
        metadata = {**scalar_metrics(metrics), "step": state.global_step}
        if state.epoch is not None:
            metadata["epoch"] = int(round(state.epoch)) if abs(state.epoch - round(state.epoch)) < 1e-9 else state.epoch
        return snapshot, metadata

    def _commit(self, state: Any, parts: dict[str, Any]) -> None:
        snapshot, metadata = self.snapshot(state, parts)
        result = self.repo.commit_state(
            snapshot,
            message=f"trainer step {state.global_step}",
            branch=self.branch,
            metadata=metadata,
            background=self.background,
        )
        if isinstance(result, CommitHandle):
            result.add_done_callback(self.commits.append)
        else:
            self.commits.append(result)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.repo.wait()  # every commit recorded (or its error raised) before train() returns


def restore(
    repo: Repo, ref: str, model: Any, optimizer: Any = None, scheduler: Any = None, rng: bool = True
) -> dict[str, Any]:
    """Load the commit ``ref`` into ``model`` (and optimizer, scheduler, RNG); return the state."""
    state = repo.load_state(ref)
    if not isinstance(state, dict):
        raise InvalidInputError(f"commit {ref} holds no training-state dict to restore")
    model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    if rng:
        set_rng_state(state["rng"])
    return state


class PreemptionCallback(TrainerCallback):
    """On a scheduler's signal, commit once at the end of the optimizer step in progress and exit
    (``ckstore.integrations.preemption``); the state is ``CkstoreCallback``'s."""

    def __init__(self, store: CkstoreCallback, preemption: Preemption | None = None) -> None:
        self.store = store
        self.preemption = preemption or Preemption()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.preemption.install()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.preemption.requested:
            return
        snapshot, metadata = self.store.snapshot(state, kwargs)
        self.store.commits.append(
            self.preemption.save(
                self.store.repo, snapshot, f"trainer step {state.global_step} (preempted)", metadata, self.store.branch
            )
        )
        self.preemption.exit()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.preemption.uninstall()
