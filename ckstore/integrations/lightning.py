"""PyTorch Lightning: store every checkpoint the Trainer saves as a ckstore commit, without pickle.

    from ckstore.integrations.lightning import CkstoreCheckpointIO
    trainer = Trainer(plugins=[CkstoreCheckpointIO("ckpts/.ckstore", branch="run1")], ...)
    trainer.fit(model, ckpt_path="last")          # resumes from the pointer file, as usual

Lightning keeps deciding *when* to save and *which* files exist (ModelCheckpoint's top-k, "last",
``ckpt_path=``); this plugin changes *what* a checkpoint file is. ``save_checkpoint`` commits the
checkpoint dict with ``commit_state`` (metadata: ``epoch``, ``step`` = global step, and the score
of every ModelCheckpoint that monitors a metric, under the metric's name) and writes, at the path
Lightning chose, a small JSON pointer naming the commit. ``load_checkpoint`` accepts such a pointer
file or any ckstore revision (commit id, branch, tag, ``main~2``). ``remove_checkpoint`` deletes
only the pointer file: the commit stays in history, so ``ckstore best`` and retention still see
it; free disk with ``ckstore gc --keep-last N`` / ``--keep-best N --metric NAME``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ckstore.errors import InvalidInputError, MissingDependencyError
from ckstore.format.ids import ObjectId
from ckstore.integrations import open_repo, plain, read_pointer, scalar_metrics, write_pointer
from ckstore.integrations.preemption import Preemption
from ckstore.repo import CommitHandle, Repo

try:  # the unified package first, then the standalone one (each has its own CheckpointIO class)
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.pytorch.callbacks import Callback
except ImportError:  # pragma: no cover - depends on what is installed
    try:
        # The standalone package's classes: the same API under its own module names.
        from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO  # type: ignore[assignment]
        from pytorch_lightning.callbacks import Callback  # type: ignore[assignment]  # as above
    except ImportError:
        raise MissingDependencyError(
            "ckstore.integrations.lightning needs PyTorch Lightning: pip install lightning"
        ) from None


class CkstoreCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` that commits checkpoints to a ckstore repository.

    With ``background=True`` (what Lightning's ``AsyncCheckpointIO`` does for files) a save
    waits only for a copy of the checkpoint's tensors; the commit is written on a worker thread
    and the pointer file appears once it is recorded. ``teardown`` (end of fit) waits for it.
    """

    def __init__(
        self, repo: Repo | str | os.PathLike[str], branch: str | None = None, background: bool = False
    ) -> None:
        super().__init__()
        self.repo = open_repo(repo)
        self.branch = branch
        self.background = background
        self.last_commit: str | None = None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not use storage_options, got {storage_options!r}")
        metadata: dict[str, Any] = scalar_metrics(
            {"epoch": checkpoint.get("epoch"), "step": checkpoint.get("global_step")}
        )
        for state in (checkpoint.get("callbacks") or {}).values():
            # ModelCheckpoint(monitor=...) records the score this save is ranked by.
            if isinstance(state, dict) and isinstance(state.get("monitor"), str) and "current_score" in state:
                metadata.update(scalar_metrics({state["monitor"]: state["current_score"]}))
        result = self.repo.commit_state(
            plain(checkpoint),
            message=f"lightning checkpoint {Path(path).name}",
            branch=self.branch,
            metadata={**metadata, "checkpoint": Path(path).name},
            background=self.background,
        )
        if isinstance(result, CommitHandle):
            result.add_done_callback(lambda oid: self._recorded(path, oid))
        else:
            self._recorded(path, result)

    def _recorded(self, path: Any, oid: str) -> None:
        self.last_commit = oid
        write_pointer(path, self.repo, oid)

    def teardown(self) -> None:
        self.repo.wait()  # raises a background commit's error rather than losing it

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        self.repo.wait()
        # weights_only is about unpickling, which ckstore never does: every load is "weights only".
        pointer = read_pointer(path)
        ref = pointer["commit"] if pointer else str(path)
        # A device (or its name) is honoured; remapping functions and dicts are torch.load's, for
        # pickled storages, and do not apply: tensors are created on the CPU then.
        device = str(map_location) if isinstance(map_location, (str, torch.device)) else "cpu"
        state = self.repo.load_state(ref, device=device)
        if not isinstance(state, dict):
            raise InvalidInputError(f"{ref} does not hold a Lightning checkpoint")
        return state

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the pointer file only; the commit remains until ``ckstore gc`` retention drops it."""
        self.repo.wait()
        if read_pointer(path) is not None:
            os.remove(path)


class CkstorePreemption(Callback):
    """On a scheduler's signal, commit once at the end of the training batch in progress (through
    the Trainer's ``CkstoreCheckpointIO``, at ``<default_root_dir>/preempted.ckpt``) and exit
    (``ckstore.integrations.preemption``). Resume with ``trainer.fit(model, ckpt_path=that file)``."""

    def __init__(self, preemption: Preemption | None = None, filename: str = "preempted.ckpt") -> None:
        self.preemption = preemption or Preemption()
        self.filename = filename

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if not isinstance(trainer.strategy.checkpoint_io, CkstoreCheckpointIO):
            raise InvalidInputError("CkstorePreemption needs the Trainer's plugins=[CkstoreCheckpointIO(...)]")
        self.preemption.install()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.preemption.requested:
            return
        io: CkstoreCheckpointIO = trainer.strategy.checkpoint_io
        io.repo.wait()
        io.repo.compact_after_commit = False  # the job is about to be killed
        trainer.save_checkpoint(os.path.join(trainer.default_root_dir, self.filename))
        io.repo.wait()  # a background=True plugin: durable before the exit
        assert io.last_commit is not None  # the save above recorded it
        self.preemption.saved_as(io.repo, ObjectId(io.last_commit))
        self.preemption.exit()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.preemption.uninstall()
