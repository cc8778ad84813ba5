"""torchtitan: its ``CheckpointManager`` saving to ckstore, ``keep_latest_k`` as ckstore retention.

The Trainer builds its checkpoint manager from ``config.checkpoint``; naming this manager's
Config there is the whole change (its fields are torchtitan's, plus ``branch``)::

    from ckstore.integrations.torchtitan import CkstoreCheckpointManager

    config.checkpoint = CkstoreCheckpointManager.Config(enable=True, folder="checkpoint", interval=500,
                                                         keep_latest_k=3, branch="run1")

The checkpoint folder (``dump_folder``/``folder``) is a ckstore repository, created on first use
when nothing is there, or ``<repo>/<run>`` inside an existing one. Every save torchtitan makes to
``<folder>/step-N`` goes through ``ckstore.dcp.Writer`` as one commit on ``branch`` (default:
``<run>`` when the folder names one, else the repository's current branch) with ``step`` in
its metadata, and tag ``step-N`` (``<run>/step-N``) names it, as the checkpoint path reads
(ckstore.dcp, location.py). Every rank writes its own shards; unchanged pieces cost nothing.

A resume (``load()``, ``load(step)``) finds the newest ``step-N`` tag instead of listing step
folders and reads it through ``ckstore.dcp.Reader``; with no tag yet, torchtitan's own path runs
(``initial_load_path``, Hugging Face weights, or a fresh start). ``keep_latest_k`` stops being
folder deletion: once a save is durable (at once for synchronous saves; for async ones when
torchtitan waits for it), torchtitan's purge thread drops the ``step-N`` tags beyond the newest
``k`` and thins the branch to its ``k`` newest commits with ``gc --keep-last k --branch BRANCH``
(other branches, other tags and the reflog's undo window are kept); ``close()`` waits for an
async save still in flight. ``async_mode="async_with_pinned_mem"`` goes to DCP's process-based
async save unchanged. torchtitan's stager pins host memory and copies without blocking, which
needs an accelerator; on a machine without one the manager stages into shared memory in a
background thread instead, so the mode works (and is tested) on CPU. A final save with
``last_save_in_hf`` is a Hugging Face export, not a checkpoint: torchtitan writes it as the
plain folder it always does.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckstore.dcp import Reader, Writer, checkpoint_path
from ckstore.errors import MissingDependencyError, RefNotFoundError
from ckstore.integrations import keep_latest
from ckstore.repo import Repo

try:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torchtitan.components.checkpoint import MODEL, AsyncMode, CheckpointManager
    from torchtitan.components.checkpointer.base import purge_thread
except ImportError:  # pragma: no cover - depends on what is installed
    raise MissingDependencyError(
        "ckstore.integrations.torchtitan needs torchtitan: pip install --no-deps torchtitan==0.3.0 (README)"
    ) from None

_STEP = re.compile(r"step-(\d+)")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class CkstoreCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` with its checkpoints as ckstore commits (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        branch: str | None = None
        """The ckstore branch the saves commit on; default: the run the folder names, else the current branch."""

    purge_thread: threading.Thread | None  # torchtitan's, replaced by one that applies ckstore retention

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        if not self.enable:
            return
        self.repo_path, self.run = self._repository()
        self.branch = config.branch or self.run
        if self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM and not torch.accelerator.is_available():
            # torchtitan makes its own stager only while none is set; its options need an accelerator.
            self.stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=False, use_shared_memory=True, use_async_staging=True, use_non_blocking_copy=False
                )
            )
        if self.purge_thread is not None:  # torchtitan's deletes folders; this one applies retention
            self.purge_queue.put(None)
            self.purge_thread.join()
            self.purge_thread = threading.Thread(
                target=purge_thread, args=(self.purge_queue, self._retain), daemon=True
            )
            self.purge_thread.start()

    def _repository(self) -> tuple[Path, str | None]:
        """The repository the folder is (created by rank 0 when nothing is there) and the run it names."""
        if _rank() == 0 and checkpoint_path(self.folder) is None:
            Repo.init(self.folder, exist_ok=True)
        _barrier()  # every rank, so none reads the folder before rank 0 has made it a repository
        found = checkpoint_path(self.folder)
        assert found is not None
        return found.repo, found.name

    # ---- step tags -------------------------------------------------------------------------------

    def step_tags(self, repo: Repo | None = None) -> dict[int, str]:
        """The saved steps: step -> the tag naming its commit (``step-N``, or ``<run>/step-N``)."""
        repo = repo or Repo(self.repo_path)
        prefix = f"{self.run}/" if self.run else ""
        steps: dict[int, str] = {}
        for name in repo.tags():
            if name.startswith(prefix) and (match := _STEP.fullmatch(name[len(prefix) :])):
                steps[int(match.group(1))] = name
        return steps

    def _find_load_step(self, folder: str = "") -> int:
        if folder and folder != self.folder:
            return super()._find_load_step(folder)
        return max(self.step_tags(), default=-1)

    # ---- saves -----------------------------------------------------------------------------------

    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Any:
        if to_hf:  # a Hugging Face export of the final weights: torchtitan's own plain folder
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        match = _STEP.fullmatch(Path(checkpoint_id).name)
        metadata = {"step": int(match.group(1))} if match else {}
        writer = Writer(branch=self.branch, message=f"torchtitan {Path(checkpoint_id).name}", metadata=metadata)
        if async_mode == AsyncMode.ASYNC:
            return dcp.async_save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id, process_group=self.pg)
        if async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            return dcp.async_save(
                state_dict,
                storage_writer=writer,
                checkpoint_id=checkpoint_id,
                process_group=self.pg,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                async_stager=self.stager,
            )
        dcp.save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id)
        return None

    # ---- loads -----------------------------------------------------------------------------------

    def _load(self, step: int = -1) -> bool:
        steps = self.step_tags()
        if step == -1 and not steps:
            return super()._load(step)  # initial_load_path, Hugging Face weights, or a fresh start
        load_step = max(steps) if step == -1 else step
        if load_step not in steps:
            raise RefNotFoundError(
                f"no checkpoint of step {load_step} in {self.folder} (saved steps: {sorted(steps) or 'none'})"
            )
        states = self._states_to_load(model_only=load_step == 0)  # torchtitan's seed checkpoint: model only
        self.dcp_load(states, self._create_checkpoint_id(load_step), from_hf=False, from_quantized=False)
        return True

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        if from_hf or checkpoint_path(checkpoint_id) is None:  # a folder outside the repository
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        dcp.load(state_dict, checkpoint_id=checkpoint_id, storage_reader=Reader())
        if MODEL in self.states:  # the model's entries are flattened into the state dict
            self.states[MODEL].load_state_dict(state_dict)
        return None

    # ---- retention -------------------------------------------------------------------------------

    def _purge_stale_checkpoints(self) -> None:
        if self.async_mode == AsyncMode.DISABLED:
            self._queue_retention()  # the save is durable: dcp.save has returned

    def _wait_for_saving(self) -> None:
        super()._wait_for_saving()
        self._queue_retention()  # the async save has landed

    def _close(self) -> None:
        self.maybe_wait_for_saving()  # an async save in flight lands (and counts for retention) first
        super()._close()

    def _queue_retention(self) -> None:
        if self.keep_latest_k > 0 and _rank() == 0:
            self.purge_queue.put(self.folder)

    def _retain(self, _folder: str) -> None:
        """On the purge thread: keep the newest ``keep_latest_k`` step tags and branch commits."""
        repo = Repo(self.repo_path)
        steps = self.step_tags(repo)
        for step in sorted(steps)[: -self.keep_latest_k]:
            repo.delete_tag(steps[step])
        keep_latest(repo, self.branch or repo.head_branch, self.keep_latest_k)
