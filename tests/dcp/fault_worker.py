"""A torchrun worker for tests/dcp/test_hold.py: DCP's failure matrix on one process group.

``python -m torch.distributed.run --nproc-per-node 2 fault_worker.py REPO OUT``. For each step
of ``dcp.save`` and ``dcp.load`` and each rank that runs it, the step fails on that rank only;
then every rank checks that it got ``CheckpointException``, rank 0 checks that no branch moved
and that gc runs at once (the save's lock is gone), and a save and a bit-exact load work. Rank 0
writes the problems it found to OUT/report.json; the test knows nothing of the process group.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from worker import finish  # beside this script (torchrun puts its folder on sys.path)

import ckstore
import ckstore.backend.base
import ckstore.dcp
import ckstore.dcp.storage
from ckstore.dcp import Reader, Writer

GC_WAIT = 3.0  # seconds gc may wait for the lock: far below the save's lock_hold bound

# (step, object whose attribute fails, attribute, ranks it runs on: None = every rank)
SAVE_STEPS: list[tuple[str, Any, str, int | None]] = [
    ("set_up_storage_writer", Writer, "set_up_storage_writer", None),
    ("prepare_local_plan", Writer, "prepare_local_plan", None),
    ("create_local_plan", DefaultSavePlanner, "create_local_plan", None),
    ("create_global_plan", DefaultSavePlanner, "create_global_plan", 0),
    ("prepare_global_plan", Writer, "prepare_global_plan", 0),
    ("finish_plan", DefaultSavePlanner, "finish_plan", None),
    ("resolve_data", DefaultSavePlanner, "resolve_data", None),
    ("store_pieces", ckstore.dcp.storage, "store_pieces", None),
    ("finish", Writer, "finish", 0),
]
LOAD_STEPS: list[tuple[str, Any, str, int | None]] = [
    ("read_metadata", Reader, "read_metadata", None),
    ("set_up_storage_reader", Reader, "set_up_storage_reader", None),
    ("prepare_local_plan", Reader, "prepare_local_plan", None),
    ("create_global_plan", DefaultLoadPlanner, "create_global_plan", 0),
    ("prepare_global_plan", Reader, "prepare_global_plan", 0),
    ("finish_plan", DefaultLoadPlanner, "finish_plan", None),
    ("read_data", Reader, "read_data", None),
    ("resolve_tensor", DefaultLoadPlanner, "resolve_tensor", None),
    ("commit_tensor", DefaultLoadPlanner, "commit_tensor", None),
]


class InjectedFault(RuntimeError):
    pass


@contextmanager
def failing(owner: Any, attribute: str, active: bool) -> Iterator[None]:
    """``owner.attribute`` raises while inside, on this rank when ``active``."""
    if not active:
        yield
        return
    original = getattr(owner, attribute)

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise InjectedFault(attribute)

    setattr(owner, attribute, fail)
    try:
        yield
    finally:
        setattr(owner, attribute, original)


def make_state(step: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(step)
    return {
        "w": distribute_tensor(torch.randn(16, 8, generator=g), mesh, [Shard(0)]),
        "b": torch.randn(5, generator=g),
        "step": step,
    }


def local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


def save(repo: str, step: int) -> dict[str, Any]:
    sd = make_state(step)
    dcp.save(sd, storage_writer=Writer(repo, branch="main", message=f"step {step}"))
    return sd


def load_and_compare(repo: str, expected: dict[str, Any]) -> list[str]:
    target = make_state(-1)
    target["step"] = -1
    dcp.load(target, storage_reader=Reader(repo, ref="main"))
    wrong = [k for k in ("w", "b") if not torch.equal(local(target[k]), local(expected[k]))]
    return wrong + (["step"] if target["step"] != expected["step"] else [])


def expect_failure(run: Callable[[], Any]) -> str | None:
    try:
        run()
    except CheckpointException:
        return None
    except Exception as exc:  # noqa: BLE001 - reported as a problem, not raised
        return f"{type(exc).__name__} instead of CheckpointException: {exc}"
    return "no exception"


def check_repository(repo: str, before: dict[str, str]) -> list[str]:
    """Rank 0: the branch did not move, and gc gets the exclusive lock at once."""
    problems = []
    handle = ckstore.Repo(repo)
    if handle.branches() != before:
        problems.append(f"branches moved: {before} -> {handle.branches()}")
    ckstore.backend.base.REPO_LOCK_TIMEOUT = GC_WAIT
    started = time.monotonic()
    try:
        handle.gc()
    except ckstore.errors.LockedError:
        problems.append(f"gc blocked for {GC_WAIT:.0f} s: the failed save still holds the lock")
    else:
        if time.monotonic() - started > GC_WAIT / 2:
            problems.append(f"gc waited {time.monotonic() - started:.1f} s for the lock")
    return problems


def main() -> None:
    repo, out = sys.argv[1:3]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    step = 0
    expected = save(repo, step)
    report: list[dict[str, Any]] = []
    cases = [("save", *s) for s in SAVE_STEPS] + [("load", *s) for s in LOAD_STEPS]
    for kind, name, owner, attribute, runs_on in cases:
        for target in [0, 1] if runs_on is None else [runs_on]:
            ckstore.dcp.wait_compaction()
            before = ckstore.Repo(repo).branches()
            dist.barrier()
            with failing(owner, attribute, rank == target):
                if kind == "save":
                    problem = expect_failure(lambda: save(repo, 1000 + step))
                else:
                    problem = expect_failure(lambda: load_and_compare(repo, expected))
            problems = [] if problem is None else [f"rank {rank}: {problem}"]
            dist.barrier()
            if rank == 0:
                problems += check_repository(repo, before)
            dist.barrier()
            step += 1
            try:
                expected = save(repo, step)  # the next save works, and loads back bit-exact
                problems += [f"rank {rank}: {k} differs after the next save" for k in load_and_compare(repo, expected)]
            except Exception as exc:  # noqa: BLE001 - reported
                problems.append(f"rank {rank}: the next save or load failed: {type(exc).__name__}: {exc}")
            everyone: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, problems)
            report.append({"case": f"{kind} {name} on rank {target}", "problems": sum(everyone, [])})
    finish(report, out)


if __name__ == "__main__":
    main()
