"""Ray Train: ``ray.train.report(..., checkpoint=...)`` saves as ckstore commits, without pickle.

In the training function every worker calls, instead of writing a checkpoint folder::

    from ckstore.integrations.ray import report, restore
    state = restore()                      # the run's latest checkpoint (after a restart), or None
    if state is not None:
        model.load_state_dict(state["model"]); opt.load_state_dict(state["optimizer"])
    ...
    report({"loss": loss, "epoch": epoch}, {"model": model.state_dict(), "optimizer": opt.state_dict()},
           repo="/shared/ckpts/.ckstore", branch="run1")

``report`` is a barrier like ``ray.train.report``. The rank-0 worker commits ``state`` (metadata:
the reported metrics that are numbers) together with every worker's RNG state (Python, NumPy and
torch CPU, gathered as tensors), then reports to Ray a checkpoint that is a small pointer folder
naming the commit; the other workers report none. Ray keeps tracking its checkpoints as usual
(``Result.checkpoint``, ``get_checkpoint()`` after a worker-group restart, resuming a run by its
name), and ``restore`` reads the commit the pointer names, restoring each worker's own RNG.

The run's ``CheckpointConfig(num_to_keep=N)`` becomes ckstore retention on the branch: the N
newest commits (``gc --keep-last N --branch B``), or with ``checkpoint_score_attribute`` the N best
by that metric (``--keep-best N --metric M``, ``--max`` when the order is "max"); the branch's
newest commit stays either way. Ray deletes only the pointer folders it drops. The repository
must be on a file system every worker and the driver see (as ``storage_path`` must be).
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckstore.errors import InvalidInputError, MissingDependencyError
from ckstore.integrations import keep_latest, open_repo, read_pointer, scalar_metrics, write_pointer
from ckstore.repo import Repo

try:
    import ray.train
    from ray.train import Checkpoint, CheckpointConfig
except ImportError:  # pragma: no cover - depends on what is installed
    raise MissingDependencyError('ckstore.integrations.ray needs Ray Train: pip install "ray[train]"') from None

POINTER_NAME = "ckstore.json"
RNG_KEY = "ray_worker_rng"  # [world size, packed RNG state] int64, one row per worker
_TORCH_RNG = torch.get_rng_state().numel()  # bytes of the CPU generator's state
_MT_WORDS = 624  # Mersenne Twister state words (NumPy's legacy generator and Python's random)


def _pack_rng() -> torch.Tensor:
    """This process's Python, NumPy and torch CPU RNG states as one int64 vector of fixed length,
    so workers can all-gather them as a tensor (no pickle between processes either)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    if kind != "MT19937":
        raise InvalidInputError(f"NumPy's global generator is {kind}, not MT19937")
    version, words, gauss = random.getstate()
    if gauss is not None or version != 3:
        raise InvalidInputError("Python's random state has an unexpected form")
    parts = [
        torch.get_rng_state().to(torch.int64),
        torch.from_numpy(np.asarray(keys).astype(np.int64)),
        torch.tensor([pos, has_gauss], dtype=torch.int64),
        torch.from_numpy(np.array([cached], dtype=np.float64).view(np.int64)),
        torch.tensor(words, dtype=torch.int64),
    ]
    return torch.cat(parts)


def _unpack_rng(row: torch.Tensor) -> None:
    torch_state, rest = row[:_TORCH_RNG], row[_TORCH_RNG:].numpy()
    keys, (pos, has_gauss), cached = (
        rest[:_MT_WORDS],
        rest[_MT_WORDS : _MT_WORDS + 2],
        rest[_MT_WORDS + 2 : _MT_WORDS + 3],
    )
    words = rest[_MT_WORDS + 3 :]
    torch.set_rng_state(torch_state.to(torch.uint8))
    np.random.set_state(
        ("MT19937", keys.astype(np.uint32), int(pos), int(has_gauss), float(cached.view(np.float64)[0]))
    )
    random.setstate((3, tuple(int(w) for w in words), None))


def _gathered_rng() -> torch.Tensor:
    """Every worker's packed RNG state, one row per world rank (all workers take part)."""
    mine = _pack_rng()
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return mine.unsqueeze(0)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return torch.stack(rows)


def _run_checkpoint_config() -> CheckpointConfig | None:
    """The ``CheckpointConfig`` of the run this worker belongs to (Ray Train's run context)."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        # Ray Train v2 keeps its own CheckpointConfig class, with the fields read here.
        return get_train_context().train_run_context.run_config.checkpoint_config  # type: ignore[return-value]
    except (ImportError, AttributeError, RuntimeError):  # an older Ray or outside a run
        return None


def report(
    metrics: dict[str, Any],
    state: dict[str, Any],
    repo: Repo | str | os.PathLike[str],
    branch: str | None = None,
    message: str | None = None,
    checkpoint_config: CheckpointConfig | None = None,
) -> str | None:
    """Commit ``state`` on the rank-0 worker and report ``metrics`` with a checkpoint naming the
    commit; call it on every worker. Returns the commit id on rank 0, None on the others.
    ``branch`` defaults to the run's name; ``checkpoint_config`` to the run's own."""
    context = ray.train.get_context()
    rng = _gathered_rng()
    if context.get_world_rank() != 0:
        ray.train.report(metrics, checkpoint=None)
        return None
    store = open_repo(repo)
    branch = branch or context.get_experiment_name()
    oid = store.commit_state(
        {**state, RNG_KEY: rng},
        message=message or f"ray train report ({branch})",
        branch=branch,
        metadata=scalar_metrics(metrics),
    )
    config = checkpoint_config or _run_checkpoint_config()
    if config is not None:
        metric = config.checkpoint_score_attribute
        keep_latest(store, branch, config.num_to_keep, metric, config.checkpoint_score_order == "max")
    with tempfile.TemporaryDirectory() as folder:
        write_pointer(Path(folder) / POINTER_NAME, store, oid)
        ray.train.report(
            metrics, checkpoint=Checkpoint.from_directory(folder), checkpoint_dir_name=f"ckstore-{oid[:12]}"
        )
    return oid


def checkpoint_commit(checkpoint: Checkpoint) -> tuple[Repo, str]:
    """The repository and commit a checkpoint ``report`` made names (``Result.checkpoint`` on the driver)."""
    with checkpoint.as_directory() as folder:
        pointer = read_pointer(Path(folder) / POINTER_NAME)
    if pointer is None or not pointer.get("repo"):
        raise InvalidInputError(f"{checkpoint.path} is not a checkpoint made by ckstore.integrations.ray.report")
    return Repo(pointer["repo"]), pointer["commit"]


def restore(checkpoint: Checkpoint | None = None, device: str = "cpu", rng: bool = True) -> dict[str, Any] | None:
    """The state of ``checkpoint`` (default: ``ray.train.get_checkpoint()``, the run's latest),
    or None when there is none; in a worker, also restores its own RNG state (``rng``)."""
    checkpoint = checkpoint or ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    store, oid = checkpoint_commit(checkpoint)
    state = store.load_state(oid, device=device)
    if not isinstance(state, dict) or RNG_KEY not in state:
        raise InvalidInputError(f"commit {oid[:12]} was not made by ckstore.integrations.ray.report")
    rows = state.pop(RNG_KEY)
    if rng:
        rank = ray.train.get_context().get_world_rank()
        if rank >= rows.shape[0]:
            raise InvalidInputError(
                f"commit {oid[:12]} holds the RNG of {rows.shape[0]} worker(s), not of rank {rank}: "
                "restore with rng=False to resume at another world size"
            )
        _unpack_rng(rows[rank])
    return state
