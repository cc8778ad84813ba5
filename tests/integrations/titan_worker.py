"""A torchrun worker for tests/integrations/test_torchtitan.py: torchtitan's own optimizer, LR schedule
and CheckpointManager (ckstore's subclass) around an FSDP2 model on CPU (gloo).

``python -m torch.distributed.run --nproc-per-node 2 titan_worker.py FOLDER OUT STOP ASYNC_MODE``
resumes from FOLDER if it holds a checkpoint, trains to step STOP (of TOTAL), saving every
INTERVAL steps with keep_latest_k=KEEP, and writes the full weights and optimizer state to OUT
(safetensors, by rank 0) for the test to compare.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

from ckstore.integrations.torchtitan import CkstoreCheckpointManager

TOTAL, INTERVAL, KEEP = 8, 2, 2


class TrainState:
    """What torchtitan's Trainer registers as ``train_state``: the step counter."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's share of the step's batch, the same in every run."""
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x = torch.randn(8, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def full(tensors: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in tensors.items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if isinstance(value, torch.Tensor):
            out[key] = value.detach().clone().contiguous()
    return out


def main(folder: str, out: str, stop: int, async_mode: str) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})],
        implementation="for-loop",
    ).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=TOTAL)
    train_state = TrainState()
    config = CkstoreCheckpointManager.Config(
        enable=True,
        folder=folder,
        interval=INTERVAL,
        keep_latest_k=KEEP,
        last_save_model_only=False,
        async_mode=async_mode,
    )
    manager = config.build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
    )
    resumed = manager.load()
    start = train_state.step
    for step in range(start + 1, stop + 1):
        x, y = batch(step)
        loss = (model(x) - y).square().mean()
        optimizers.zero_grad()
        loss.backward()
        optimizers.step()
        schedulers.step()
        train_state.step = step
        manager.save(step, last_step=step == TOTAL)
    manager.close()  # waits for an async save still in flight
    weights = full(model.state_dict())
    moments = {f"optimizer.{k}": v for k, v in full(optimizers.state_dict()).items()}
    if dist.get_rank() == 0:
        info = {"resumed": resumed, "start": start, "lr": schedulers.schedulers[0].get_last_lr()[0]}
        save_file({**weights, **moments}, out, metadata={"info": json.dumps(info)})
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
