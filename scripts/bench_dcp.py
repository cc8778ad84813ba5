"""Benchmark: DCP's FileSystemWriter vs ckstore's DCP Writer, side by side in one run.

2 ranks (torchrun, gloo on CPU), a model of a few hundred MB sharded with FSDP2 plus its AdamW
state, 4 training steps. After each step the same state is saved four ways: ``dcp.save`` to a
FileSystemWriter folder, ``dcp.save`` to a ckstore repository, and the same two with
``dcp.async_save`` (into a second folder and repository). Reported per step: rank-0 wall time of
the synchronous saves and the CPU time of rank 0's process during them, the compaction ckstore
runs after a save on a background thread (re-encoding the previous step's chunks as deltas; waited
for and timed separately, so that it does not overlap the next measurement), time training is
blocked by ``async_save`` (until it returns), and bytes on disk after 4 steps and for step 4
alone, counted after the compaction. The whole run is repeated
``--runs`` times (fresh folders); times are the medians over the runs.

    python scripts/bench_dcp.py [--layers 12] [--width 2048] [--runs 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    import ckstore.dcp

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(args.out)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rows: list[dict[str, float]] = []
    sizes: dict[str, list[int]] = {k: [] for k in ("fs", "ck", "fs_async", "ck_async")}
    for step in range(4):
        x = torch.randn(16, args.width)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd, "step": step}
        row: dict[str, float] = {}
        for name in ("fs", "ck"):
            dist.barrier()
            writer = (
                dcp.FileSystemWriter(str(out / "fs" / f"step{step}"))
                if name == "fs"
                else ckstore.dcp.Writer(out / "ck", message=f"step {step}")
            )
            started, cpu = time.perf_counter(), time.process_time()
            dcp.save(sd, storage_writer=writer)
            row[name] = time.perf_counter() - started
            row[name + "_cpu"] = time.process_time() - cpu  # rank 0's process, every thread
            if name == "ck":
                cpu = time.process_time()
                ckstore.dcp.wait_compaction()
                # CPU seconds of the compaction (rank 0 coordinates and compacts; nothing else runs)
                row["ck_compact_cpu"] = time.process_time() - cpu
                dist.barrier()  # the coordinator compacts
                row["ck_compact"] = time.perf_counter() - started - row[name]
        for name in ("fs_async", "ck_async"):
            dist.barrier()
            writer = (
                dcp.FileSystemWriter(str(out / "fs_async" / f"step{step}"))
                if name == "fs_async"
                else ckstore.dcp.Writer(out / "ck_async", message=f"step {step}")
            )
            started = time.perf_counter()
            future = dcp.async_save(sd, storage_writer=writer)
            row[name] = time.perf_counter() - started  # training is blocked until here
            future.result()
            ckstore.dcp.wait_compaction()
            row[name + "_total"] = time.perf_counter() - started
        dist.barrier()
        if rank == 0:
            for name in sizes:
                sizes[name].append(du(out / name))
        rows.append(row)
    if rank == 0:
        logical = (
            sum(t.numel() * t.element_size() for t in list(model.parameters())) * 3
        )  # DTensor numel is global: model + exp_avg + exp_avg_sq
        (out / "result.json").write_text(json.dumps({"rows": rows, "sizes": sizes, "approx_state_bytes": logical}))
    dist.destroy_process_group()


def medians(results: list[dict]) -> list[dict[str, float]]:
    """Per step, the median of each figure over the runs."""
    return [
        {k: statistics.median(r["rows"][i][k] for r in results) for k in results[0]["rows"][i]}
        for i in range(len(results[0]["rows"]))
    ]


def table(results: list[dict], args: argparse.Namespace) -> str:
    rows, sizes = medians(results), results[-1]["sizes"]
    mb = 1e6
    lines = [
        f"2 ranks (torchrun, gloo, CPU), FSDP2 MLP of {args.layers} × Linear({args.width}, {args.width}) "
        f"+ AdamW: state ≈ {results[0]['approx_state_bytes'] / mb:.0f} MB, 4 steps, each saved four ways; "
        f"times are medians of {len(results)} runs; load average {os.getloadavg()[0]:.1f} at the end.",
        "",
        (
            "| step | FileSystemWriter save s | ckstore save s | ratio | CPU s of a rank (FS / ckstore) "
            "| ckstore compaction after the save s | its CPU s (rank 0) | / FS save | async blocked s (FS / ckstore) | ratio "
            "| async total s (FS / ckstore, with compaction) |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows, 1):
        lines.append(
            f"| {i} | {r['fs']:.2f} | {r['ck']:.2f} | {r['ck'] / r['fs']:.2f} | "
            f"{r['fs_cpu']:.2f} / {r['ck_cpu']:.2f} | {r['ck_compact']:.2f} | {r['ck_compact_cpu']:.2f} | "
            f"{r['ck_compact_cpu'] / r['fs']:.1f}× | "
            f"{r['fs_async']:.2f} / {r['ck_async']:.2f} | {r['ck_async'] / r['fs_async']:.2f} | "
            f"{r['fs_async_total']:.2f} / {r['ck_async_total']:.2f} |"
        )
    fs, ck = sizes["fs"], sizes["ck"]
    lines += [
        "",
        "| bytes on disk | FileSystemWriter | ckstore | ratio |",
        "|---|---|---|---|",
        f"| after 4 steps | {fs[-1] / mb:.1f} MB | {ck[-1] / mb:.1f} MB | {ck[-1] / fs[-1]:.3f} |",
        f"| step 4 alone | {(fs[-1] - fs[-2]) / mb:.1f} MB | {(ck[-1] - ck[-2]) / mb:.1f} MB | "
        f"{(ck[-1] - ck[-2]) / (fs[-1] - fs[-2]):.3f} |",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    import ckstore

    out = Path(args.out or tempfile.mkdtemp(prefix="bench_dcp_"))
    results = []
    for _ in range(args.runs):
        for name in ("fs", "ck", "fs_async", "ck_async"):
            shutil.rmtree(out / name, ignore_errors=True)
        ckstore.Repo.init(out / "ck")
        ckstore.Repo.init(out / "ck_async")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node=2",
                __file__,
                "--worker",
                "--layers",
                str(args.layers),
                "--width",
                str(args.width),
                "--out",
                str(out),
            ],
            check=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        results.append(json.loads((out / "result.json").read_text()))
    (out / "results.json").write_text(json.dumps(results))
    print(table(results, args))


if __name__ == "__main__":
    main()
