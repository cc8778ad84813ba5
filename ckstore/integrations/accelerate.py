"""Hugging Face Accelerate: ``save_state``/``load_state`` as ckstore commits, without pickle.

    from ckstore.integrations.accelerate import CkstoreState
    accelerator = Accelerator(project_config=ProjectConfiguration(total_limit=3))
    model, opt, sched = accelerator.prepare(model, opt, sched)
    store = CkstoreState(accelerator, "runs/.ckstore", branch="run1")
    store.load_state()                         # resume from the branch's newest commit, if it has one
    ...
    store.save_state(metadata={"epoch": epoch, "loss": loss})   # instead of accelerator.save_state()

A save commits what ``Accelerator.save_state`` writes to a folder: every prepared model's state
dict (``model``, ``model_1``, …; the first under ``model`` so ``ckstore export`` finds it), every
optimizer, scheduler and object given to ``register_for_checkpointing``, the GradScaler, the
state of stateful dataloaders and seedable samplers, the Python/NumPy/torch RNG and the
Accelerator's step and save iteration. Accelerate pickles the optimizer, scheduler and RNG files;
ckstore stores them as tensors and typed values, and ``load_state`` restores them bit for bit.

``ProjectConfiguration(total_limit=N)`` becomes ckstore retention: after each save the branch is
thinned to its N newest commits by ``gc --keep-last N --branch BRANCH`` (tags, other branches and
the reflog's undo window are kept), instead of Accelerate deleting ``checkpoint_<i>`` folders.

One process writes (the main one; the others wait for it), as Accelerate writes the weights from
the main process: that covers single-process and DDP runs, whose replicas hold the same weights.
Every process then restores the main process's RNG state. FSDP and DeepSpeed shard their state,
which one process cannot commit: save those through torch.distributed.checkpoint with
``ckstore.dcp.Writer`` (README, "Distributed training").
"""

from __future__ import annotations

import os
from typing import Any

from ckstore.errors import InvalidInputError, MissingDependencyError
from ckstore.integrations import keep_latest, open_repo, plain
from ckstore.repo import Repo
from ckstore.training.state import rng_state, set_rng_state

try:
    from accelerate import Accelerator
    from accelerate.data_loader import SeedableRandomSampler
    from accelerate.utils import DistributedType
except ImportError:  # pragma: no cover - depends on what is installed
    raise MissingDependencyError("ckstore.integrations.accelerate needs accelerate: pip install accelerate") from None

_SHARDED = (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)


def _name(kind: str, index: int) -> str:
    """Accelerate's own file naming without the extension: ``model``, ``model_1``, …"""
    return kind if index == 0 else f"{kind}_{index}"


class CkstoreState:
    """Commit an ``Accelerator``'s training state to ckstore and load it back."""

    def __init__(
        self,
        accelerator: Accelerator,
        repo: Repo | str | os.PathLike[str],
        branch: str | None = None,
        total_limit: int | None = None,
    ) -> None:
        if accelerator.distributed_type in _SHARDED:
            raise InvalidInputError(
                f"{accelerator.distributed_type.value} shards the state across processes: "
                "save it with torch.distributed.checkpoint and ckstore.dcp.Writer"
            )
        self.accelerator = accelerator
        self.repo = open_repo(repo) if accelerator.is_main_process else None
        self._path = repo
        self.branch = branch
        limit = accelerator.project_configuration.total_limit
        self.total_limit = total_limit if total_limit is not None else limit
        self.commits: list[str] = []

    def _open(self) -> Repo:
        if self.repo is None:  # the other processes only read, once the main one created it
            self.repo = self._path if isinstance(self._path, Repo) else Repo(self._path)
        return self.repo

    @property
    def target_branch(self) -> str:
        return self.branch or self._open().head_branch

    def state(self) -> dict[str, Any]:
        """What a save commits (see the module docstring), as plain nested values and tensors."""
        acc = self.accelerator
        state: dict[str, Any] = {}
        for i, model in enumerate(acc._models):
            state[_name("model", i)] = acc.get_state_dict(model, unwrap=False)
        for i, optimizer in enumerate(acc._optimizers):
            state[_name("optimizer", i)] = optimizer.state_dict()
        for i, scheduler in enumerate(acc._schedulers):
            state[_name("scheduler", i)] = plain(scheduler.state_dict())
        loaders: dict[str, Any] = {}
        for i, loader in enumerate(acc._dataloaders):
            sampler = loader.get_sampler() if hasattr(loader, "get_sampler") else None
            entry: dict[str, Any] = {}
            if isinstance(sampler, SeedableRandomSampler):
                entry["sampler"] = {"epoch": sampler.epoch, "initial_seed": sampler.initial_seed}
            if getattr(loader, "use_stateful_dataloader", False):
                entry["state"] = plain(loader.state_dict())
            if entry:
                loaders[str(i)] = entry
        if loaders:
            state["dataloaders"] = loaders
        if acc.scaler is not None:
            state["scaler"] = acc.scaler.state_dict()
        for i, obj in enumerate(acc._custom_objects):
            state[f"custom_{i}"] = plain(obj.state_dict())
        state["rng"] = rng_state()
        state["accelerator"] = {"step": acc.step, "iteration": acc.save_iteration}
        return state

    def save_state(self, metadata: dict[str, Any] | None = None, message: str | None = None) -> str | None:
        """Commit the state (what ``accelerator.save_state()`` would write) and apply ``total_limit``;
        return the commit id on the main process, None on the others."""
        acc = self.accelerator
        acc.wait_for_everyone()  # every process finished the step being saved
        oid = None
        if acc.is_main_process:
            repo = self._open()
            iteration = acc.save_iteration
            oid = repo.commit_state(
                self.state(),
                message=message or f"accelerate checkpoint_{iteration}",
                branch=self.branch,
                metadata={**(metadata or {}), "iteration": iteration},
            )
            self.commits.append(oid)
            keep_latest(repo, self.target_branch, self.total_limit)
        acc.project_configuration.iteration += 1
        acc.wait_for_everyone()  # the commit is recorded before any process loads it
        return oid

    def load_state(self, ref: str | None = None, strict: bool = True) -> str | None:
        """Load commit ``ref`` (default: the branch's newest) into the prepared objects; return its
        id, or None when ``ref`` is not given and the branch has no commit yet (a fresh start)."""
        repo = self._open()
        if ref is None:
            ref = self.target_branch
            if ref not in repo.branches():
                return None
        oid = repo.resolve(ref)
        state = repo.load_state(oid, device=str(self.accelerator.device))
        if not isinstance(state, dict) or "accelerator" not in state:
            raise InvalidInputError(f"{ref} does not hold an Accelerate state (saved by CkstoreState.save_state)")
        self._restore(state, strict)
        return oid

    def _restore(self, state: dict[str, Any], strict: bool) -> None:
        acc = self.accelerator
        parts = [
            ("model", acc._models, lambda m, s: m.load_state_dict(s, strict=strict)),
            ("optimizer", acc._optimizers, lambda o, s: o.load_state_dict(s)),
            ("scheduler", acc._schedulers, lambda o, s: o.load_state_dict(s)),
        ]
        for kind, objects, load in parts:
            for i, obj in enumerate(objects):
                key = _name(kind, i)
                if key not in state:
                    raise InvalidInputError(f"the commit holds no {key}: it was saved with fewer prepared objects")
                load(obj, state[key])
        for i, loader in enumerate(acc._dataloaders):
            entry = state.get("dataloaders", {}).get(str(i), {})
            sampler = loader.get_sampler() if hasattr(loader, "get_sampler") else None
            if "sampler" in entry and isinstance(sampler, SeedableRandomSampler):
                sampler.epoch = entry["sampler"]["epoch"]
                sampler.initial_seed = entry["sampler"]["initial_seed"]
            if "state" in entry and getattr(loader, "use_stateful_dataloader", False):
                loader.load_state_dict(entry["state"])
        if acc.scaler is not None and "scaler" in state:
            acc.scaler.load_state_dict(state["scaler"])
        for i, obj in enumerate(acc._custom_objects):
            obj.load_state_dict(state[f"custom_{i}"])
        set_rng_state(state["rng"])
        acc.step = state["accelerator"]["step"]
        acc.project_configuration.iteration = state["accelerator"]["iteration"] + 1
