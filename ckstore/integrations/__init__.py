"""Hooks into the training loops people use; each module imports its framework only when imported.

- ``ckstore.integrations.lightning``: ``CkstoreCheckpointIO``, a PyTorch Lightning CheckpointIO.
- ``ckstore.integrations.hf``: ``CkstoreCallback``, a Hugging Face ``TrainerCallback``.
- ``ckstore.integrations.mlflow``: ``autolog()``, commits and MLflow runs linked both ways.
- ``ckstore.integrations.preemption``: ``Preemption``, one durable commit on a scheduler's signal.

Without either framework, the whole integration is two lines in the loop::

    repo.commit_state({"model": model.state_dict(), "optimizer": opt.state_dict(),
                       "rng": ckstore.rng_state()}, metadata={"epoch": epoch, "loss": loss})
    state = repo.load_state("main")   # resume: model.load_state_dict(state["model"]) ...
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any


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
            out._metadata = value._metadata  # type: ignore[attr-defined]
        return out
    if type(value) in (list, tuple):
        return type(value)(plain(v) for v in value)
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, enum.Enum):
        return plain(value.value)
    return value


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
