"""A torchrun worker for tests/dcp/test_storage.py: FSDP2 training on CPU (gloo) saved with ckstore's DCP
Writer and loaded with its Reader. ``python -m torch.distributed.run --nproc-per-node N worker.py
SCENARIO REPO OUT [ARGS…]``; results go to OUT (JSON written by rank 0, safetensors of full
tensors), checked by the test, which knows nothing of the process group.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

import ckstore.dcp

STEPS_SEED = 1234


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(128, 32)
        self.embed.weight.requires_grad_(False)  # frozen: unchanged between saves
        self.l1 = torch.nn.Linear(32, 64)
        self.l2 = torch.nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(self.embed(x).mean(1))))


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    for layer in (model.l1, model.l2):
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step, the same whatever the world size; each rank takes its share."""
    g = torch.Generator().manual_seed(STEPS_SEED + step)
    x = torch.randint(0, 128, (8, 5), generator=g)
    y = torch.randn(8, 8, generator=g)
    world, rank = dist.get_world_size(), dist.get_rank()
    share = 8 // world
    return x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    x, y = batch(step)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item()


def state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    msd, osd = get_state_dict(model, opt)
    # A plain tensor replicated on every rank, and the same bytes under a second name: stored once.
    table = torch.Generator().manual_seed(7)
    replicated = torch.randn(64, 256, generator=table)
    # A tensor-parallel style weight split on its second dimension (pieces are not whole rows).
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    columns = torch.arange(24 * 16, dtype=torch.float64).reshape(24, 16) * (step + 1)
    return {
        "model": msd,
        "optim": osd,
        "step": step,
        "run": {"name": "test", "lr": 1e-3, "betas": (0.9, 0.999)},
        "replicated": replicated,
        "replicated_copy": replicated.clone(),
        "tp": distribute_tensor(columns, mesh, [Shard(1)]),
    }


def apply(model: torch.nn.Module, opt: torch.optim.Optimizer, sd: dict) -> None:
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def full_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer, tp: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every tensor of the state, unsharded, under its DCP name (rank 0 writes them out)."""
    msd, osd = get_state_dict(model, opt)
    out = {"tp": tp.full_tensor()}
    for prefix, sd in (("model", msd), ("optim.state", osd["state"])):
        stack = [(prefix, sd)]
        while stack:
            name, node = stack.pop()
            if isinstance(node, dict):
                stack.extend((f"{name}.{k}", v) for k, v in node.items())
            elif isinstance(node, torch.Tensor):
                full = node.full_tensor() if hasattr(node, "full_tensor") else node
                out[name] = full.detach().clone().contiguous()
    return out


def load(repo: str, ref: str, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    model, opt = build(seed)
    train_step(model, opt, -1)  # creates the optimizer state that the load overwrites
    sd = state(model, opt, -1)
    sd["step"], sd["run"] = -1, {"name": "", "lr": 0.0, "betas": ()}
    dcp.load(sd, storage_reader=ckstore.dcp.Reader(repo, ref=ref))
    apply(model, opt, sd)
    return model, opt, sd


def main() -> None:
    faulthandler.enable(all_threads=True)  # an abort in native code names every thread's Python stack
    scenario, repo, out = sys.argv[1:4]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report: dict = {"world": dist.get_world_size()}
    if scenario == "train":  # save every step; then resume from step 1 in a fresh model, same world
        branch = sys.argv[4]
        model, opt = build(0)
        losses, commits = [], []
        for step in range(3):
            losses.append(train_step(model, opt, step))
            writer = ckstore.dcp.Writer(repo, branch=branch, message=f"step {step}", metadata={"step": step})
            if step == 2:  # async: training may go on while the save runs
                started = time.perf_counter()
                future = dcp.async_save(state(model, opt, step), storage_writer=writer)
                report["async_blocked_s"] = time.perf_counter() - started
                metadata = future.result()
            else:
                metadata = dcp.save(state(model, opt, step), storage_writer=writer)
            commits.append(ckstore.dcp.saved_commit(metadata))
        full = full_tensors(model, opt, state(model, opt, 2)["tp"])  # a collective: every rank takes part
        if rank == 0:
            save_file(full, os.path.join(out, "full.safetensors"))
        model, opt, sd = load(repo, commits[0], seed=99)
        resumed = [train_step(model, opt, step) for step in (1, 2)]
        report.update(losses=losses, resumed=resumed, commits=commits, step=sd["step"], run=list(sd["run"].items()))
    elif scenario == "load":  # load REF at this world size, write the full tensors, save again
        ref, branch = sys.argv[4], sys.argv[5]
        model, opt, sd = load(repo, ref, seed=5)
        full = full_tensors(model, opt, sd["tp"])
        if rank == 0:
            save_file(full, os.path.join(out, "full.safetensors"))
        report.update(step=sd["step"], run=list(sd["run"].items()), replicated=sd["replicated"].sum().item())
        writer = ckstore.dcp.Writer(repo, branch=branch, message="resaved")
        report["commit"] = ckstore.dcp.saved_commit(dcp.save(state(model, opt, sd["step"]), storage_writer=writer))
    elif scenario == "kill":  # rank 1 dies after storing some of its chunks
        model, opt = build(0)
        train_step(model, opt, 0)
        if rank == 1:
            from ckstore.repository.store import ObjectStore

            original, calls = ObjectStore.put_chunk, []

            def dying(self, *args, **kwargs):  # type: ignore[no-untyped-def]
                calls.append(1)
                if len(calls) == 3:
                    os.kill(os.getpid(), signal.SIGKILL)
                return original(self, *args, **kwargs)

            ObjectStore.put_chunk = dying  # type: ignore[method-assign]
        dcp.save(state(model, opt, 0), storage_writer=ckstore.dcp.Writer(repo, branch=sys.argv[4]))
    elif scenario == "kill-upload":  # a save to a remote: rank 1 dies once its first pack is up
        model, opt = build(0)
        train_step(model, opt, 0)
        if rank == 1:
            from ckstore.remote.layout import RemoteRepo

            upload = RemoteRepo.upload_pack

            def dying_upload(self, *args, **kwargs):  # type: ignore[no-untyped-def]
                upload(self, *args, **kwargs)
                os.kill(os.getpid(), signal.SIGKILL)

            RemoteRepo.upload_pack = dying_upload  # type: ignore[method-assign]
        dcp.save(state(model, opt, 0), storage_writer=ckstore.dcp.Writer(repo, branch=sys.argv[4]))
    finish(report, out)


def finish(report: object, out: str) -> None:
    """Rank 0 writes ``report`` to OUT/report.json; then every rank leaves.

    Every rank leaves together, and then leaves at once: twice in CI (never in 60 local runs, idle
    or loaded) a rank aborted in native code as the process wound down ("terminate called
    without an active exception", std::terminate from torch/gloo's teardown). Everything the
    tests check is on disk by now; what the interpreter's finalization does to torch's native
    threads is not ckstore's behaviour, and exiting without it keeps a teardown race in torch
    from failing the suite. faulthandler names every thread's stack if it happens before.
    """
    ckstore.dcp.wait_compaction()  # the coordinator's background compaction, before anything is torn down
    if dist.get_rank() == 0:
        with open(os.path.join(out, "report.json"), "w") as f:
            json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
