"""Hooks into the training loops people use; each module imports its framework only when imported.

- ``ckstore.integrations.lightning``: ``CkstoreCheckpointIO``, a PyTorch Lightning CheckpointIO.
- ``ckstore.integrations.hf``: ``CkstoreCallback``, a Hugging Face ``TrainerCallback``.
- ``ckstore.integrations.accelerate``: ``CkstoreState``, ``save_state``/``load_state`` of an Accelerator.
- ``ckstore.integrations.ray``: ``report``/``restore`` for Ray Train workers.
- ``ckstore.integrations.mlflow``: ``autolog()``, commits and MLflow runs linked both ways.
- ``ckstore.integrations.preemption``: ``Preemption``, one durable commit on a scheduler's signal.
- ``ckstore.integrations.submitit``: ``CkstoreCheckpointable``, that commit before submitit's checkpoint-and-requeue.
- ``ckstore.integrations.torchtitan``: ``CkstoreCheckpointManager``, torchtitan's manager saving through ckstore.dcp.

Without either framework, the whole integration is two lines in the loop::

    repo.commit_state({"model": model.state_dict(), "optimizer": opt.state_dict(),
                       "rng": ckstore.rng_state()}, metadata={"epoch": epoch, "loss": loss})
    state = repo.load_state("main")   # resume: model.load_state_dict(state["model"]) ...
"""

from __future__ import annotations

import enum
import json
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any

from ckstore.errors import InvalidInputError

if TYPE_CHECKING:
    from ckstore.maintenance.gc import GcReport
    from ckstore.repo import Repo


def plain(value: Any) -> Any:
    """``value`` with framework containers turned into the plain types ckstore stores exactly.

    Frameworks put dict subclasses (Lightning's AttributeDict, HF's BatchEncoding), paths and
    enums into their checkpoints; ckstore refuses those on purpose (it stores no pickled types),
    so the integrations store them as dict, str and the enum's value. Everything else is left
    for commit_state to store or to refuse with a clear error naming its key path.
    """
    if isinstance(value, Mapping) and type(value) not in (dict, OrderedDict):
        return {k: plain(v) for k, v in value.items()}
    if type(value) in (dict, OrderedDict):
        out = type(value)((k, plain(v)) for k, v in value.items())
        if hasattr(value, "_metadata"):  # state_dict() versions, used by load hooks
            out._metadata = value._metadata
        return out
    if type(value) in (list, tuple):
        return type(value)(plain(v) for v in value)
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, enum.Enum):
        return plain(value.value)
    return value


POINTER_FORMAT = "ckstore-checkpoint"


def write_pointer(path: str | os.PathLike[str], repo: Repo, commit: str) -> None:
    """A small JSON file standing for ``commit``, written atomically where a manager expects a checkpoint file."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    doc = {"format": POINTER_FORMAT, "commit": commit, "repo": str(Path(repo.path).resolve()) if repo.path else None}
    tmp = target.with_name(f"{target.name}.{os.getpid()}.{threading.get_ident()}.ckstore-tmp")
    tmp.write_text(json.dumps(doc) + "\n")
    os.replace(tmp, target)


def read_pointer(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The pointer written by ``write_pointer``, or None when ``path`` is not one."""
    try:
        with open(path, "rb") as f:
            head = f.read(4097)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    try:
        doc = json.loads(head) if len(head) <= 4096 else None
    except (ValueError, UnicodeDecodeError):
        doc = None
    if not isinstance(doc, dict) or doc.get("format") != POINTER_FORMAT or not isinstance(doc.get("commit"), str):
        raise InvalidInputError(
            f"{path} is not a ckstore checkpoint pointer (a torch.save file? ckstore never unpickles)"
        )
    return doc


def open_repo(repo: Repo | str | os.PathLike[str]) -> Repo:
    """``repo`` itself, or the repository at that path, created when nothing is there yet."""
    from ckstore.repo import Repo

    if isinstance(repo, Repo):
        return repo
    return Repo(repo) if Path(repo).exists() else Repo.init(repo)


def keep_latest(
    repo: Repo, branch: str, count: int | None, metric: str | None = None, maximize: bool = False
) -> GcReport | None:
    """A training manager's "keep ``count`` checkpoints" as ckstore retention: gc with
    ``keep_last=count`` (or, given a ``metric``, ``keep_best=count`` by it) on ``branch`` alone;
    other branches, tags, the branch's newest commit and what the reflog holds are untouched.
    Runs only when the branch holds more than ``count`` commits, so a save under the limit costs
    one short log walk; ``None`` or 0 (the managers' "keep everything") does nothing."""
    if not count:
        return None
    if len(repo.log(branch, limit=count + 1)) <= count:
        return None
    if metric is not None:
        return repo.gc(keep_best=count, metric=metric, maximize=maximize, branches=[branch])
    return repo.gc(keep_last=count, branches=[branch])


def scalar_metrics(values: Mapping[str, Any]) -> dict[str, float | int]:
    """The entries of ``values`` usable as commit metadata for ``best``/``--keep-best``: numbers
    and one-element tensors, as Python numbers (NaN dropped: it ranks as nothing)."""
    out: dict[str, float | int] = {}
    for key, value in values.items():
        if not isinstance(value, (int, float)) and hasattr(value, "item"):  # tensor, numpy scalar
            try:
                value = value.item()
            except (ValueError, RuntimeError):  # more than one element
                continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if isinstance(value, float) and math.isnan(value):
            continue
        out[str(key)] = value
    return out
