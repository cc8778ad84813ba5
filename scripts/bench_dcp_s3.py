"""Benchmark: DCP saves straight to S3, side by side on the bundled SeaweedFS server.

The same training state is saved, at the same moments, by three storage writers, each into its
own bucket on one server (a fresh ``weed mini`` per run, loopback only):

- ``fsspec``: torch's ``FsspecWriter`` with s3fs (endpoint through ``client_kwargs``);
- ``s3tc``: ``s3torchconnector``'s ``S3StorageWriter`` (its client given the custom endpoint);
- ``ckstore``: ``ckstore.dcp.Writer("s3://bucket/prefix")``, every save one commit there.

The state: a GPT-style decoder (token and position embeddings, pre-norm blocks of causal
self-attention and a 4x MLP, untied head) sharded with FSDP2 over 2 ranks (torchrun on
127.0.0.1, gloo, CPU) with AdamW (lr 3e-4, betas 0.9/0.95, weight decay 0.1), trained
``--steps`` steps on a synthetic token stream (a fixed random Markov chain, so the loss falls)
between saves; four saves. After each training interval every writer saves once with
``dcp.save`` (the order rotates per save) and once with ``dcp.async_save`` into a second bucket
of its own (blocked = until ``async_save`` returns; total = until its future is done).

Measured per save: wall seconds (the slowest rank), bytes the server received for the bucket
(SeaweedFS's per-bucket traffic counter: what the writer uploaded, requests included) and bytes
on the bucket (its listing), for ckstore also when its remote compaction had finished after the
save returned and its CPU seconds (the script waits for it before listing the bucket and before
the next writer saves: it never runs during a save here); after the fourth save each writer's
latest checkpoint is loaded at 1, 2 and 4 ranks (fresh processes, a model and optimizer built
for that world size) and checked bit for bit against the full state gathered at save time
(``--phases save``).

``--phases rss`` saves a state of about 1 GB per rank (``--rss-dim``, ``--rss-layers``) twice
with each of ``--rss-writers`` and samples every rank's resident set every 5 ms; reported is the
peak minus the resident set right before the save (the interpreter with torch and the state
already in memory). ``--phases local`` runs the same training and saves into a local ckstore
repository, its compaction waited for, and FileSystemWriter folders: the bytes a repository on
a shared disk holds, which a remote's are compared with. Times are medians over ``--runs`` runs.

    python scripts/bench_dcp_s3.py [--phases save rss local] [--runs 3] [--steps 10] [--dim 512]
        [--layers 4] [--writers fsspec s3tc ckstore] [--rss-writers fsspec ckstore]
        [--python /work/venv-peers/bin/python] [--write-docs docs/benchmarks.md]

Each phase keeps its results in ``--work`` (saves.json, memory.json, local.json);
``--write-docs`` writes the section from whichever are there, so the phases may be run apart
(``--phases`` with no phase only writes the report).

The orchestrator runs the server with this interpreter; the ranks run with ``--python`` (an
environment that has s3fs and s3torchconnector: ``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dcp_s3_ranks import LOAD_WORLDS, REGION, WRITERS, bucket_of  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------
# The orchestrator: one server per run, the ranks launched with torchrun


def torchrun(args: argparse.Namespace, job: str, ranks: int, env: dict[str, str], **changes: Any) -> None:
    from ckstore.transport.testserver import free_ports

    (port,) = free_ports(1)
    flags = {**vars(args), "trial": 0, "out": "", **changes}
    cmd = [
        args.python,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc-per-node={ranks}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        str(Path(__file__).with_name("bench_dcp_s3_ranks.py")),
        "--job",
        job,
        *(f"--{k}={flags[k]}" for k in ("dim", "layers", "vocab", "seq", "batch", "steps", "saves", "trial", "out")),
        "--writers",
        *flags["writers"],
    ]
    subprocess.run(cmd, check=True, env=env, timeout=args.timeout)


def rank_env(server: Any, metrics_port: int, work: Path) -> dict[str, str]:
    env = {
        **os.environ,
        **server.env,
        "AWS_ENDPOINT_URL": server.endpoint,
        "AWS_REGION": REGION,
        "AWS_DEFAULT_REGION": REGION,
        "BENCH_METRICS_URL": f"http://127.0.0.1:{metrics_port}/metrics",
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "TMPDIR": str(work / "tmp"),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "PYTHONWARNINGS": "ignore",
    }
    return env


def one_run(args: argparse.Namespace, run: int, job: str) -> dict[str, Any]:
    """One fresh server: the saves and the loads (``job="save"``) or the memory phase (``"rss"``)."""
    import boto3

    from ckstore.transport.testserver import _remove_sockets, _stop, free_ports, launch

    work = Path(args.work) / f"{job}{run}"
    shutil.rmtree(work, ignore_errors=True)
    (work / "server").mkdir(parents=True)
    (work / "tmp").mkdir()
    (metrics_port,) = free_ports(1)
    proc, server = launch(work / "server", (f"-metricsPort={metrics_port}", "-metricsIp=127.0.0.1"))
    try:
        s3 = boto3.client(
            "s3",
            endpoint_url=server.endpoint,
            aws_access_key_id=server.access_key,
            aws_secret_access_key=server.secret_key,
            region_name=REGION,
        )
        for name in WRITERS:
            for mode in ("sync", "async", "rss"):
                s3.create_bucket(Bucket=bucket_of(name, mode))
        env = rank_env(server, metrics_port, work)
        result: dict[str, Any] = {"load_before": os.getloadavg()}
        if job == "local":
            import ckstore

            ckstore.Repo.init(work / "repo")
            torchrun(args, "local", 2, env, out=work)
            result["local"] = json.loads((work / "local.json").read_text())
        elif job == "rss":
            torchrun(args, "rss", 2, env, out=work, dim=args.rss_dim, layers=args.rss_layers, writers=args.rss_writers)
            result["rss"] = json.loads((work / "rss.json").read_text())
        else:
            torchrun(args, "save", 2, env, trial=run, out=work)
            result["save"] = json.loads((work / "save.json").read_text())
            for ranks in LOAD_WORLDS:
                torchrun(args, "load", ranks, env, trial=run, out=work)
                result[f"load{ranks}"] = json.loads((work / f"load{ranks}.json").read_text())
        result["load_after"] = os.getloadavg()
        return result
    finally:
        _stop(proc)
        _remove_sockets(work / "server", server.ports)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# The report

MB, MIB = 1e6, 2**20


def med(values: list[float]) -> float:
    return statistics.median(values)


def save_figure(runs: list[dict[str, Any]], step: int, key: str, field: str) -> float:
    return med([r["save"]["rows"][step][key][field] for r in runs])


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "–"


def save_tables(runs: list[dict[str, Any]], writers: list[str]) -> list[str]:
    saves = len(runs[0]["save"]["rows"])
    head = (
        "| save | "
        + " | ".join(f"{w} s" for w in writers)
        + " | "
        + " | ".join(f"{w} / fsspec" for w in writers[1:])
        + " |"
    )
    lines = [
        "Synchronous `dcp.save`, wall seconds (slowest rank):",
        "",
        head,
        "|---" * (1 + 2 * len(writers) - 1) + "|",
    ]
    for s in range(saves):
        walls = [save_figure(runs, s, f"{w}.sync", "wall") for w in writers]
        lines.append(
            f"| {s + 1} | "
            + " | ".join(f"{t:.2f}" for t in walls)
            + " | "
            + " | ".join(ratio(t, walls[0]) for t in walls[1:])
            + " |"
        )
    totals = [sum(save_figure(runs, s, f"{w}.sync", "wall") for s in range(saves)) for w in writers]
    lines.append(
        "| all | "
        + " | ".join(f"{t:.2f}" for t in totals)
        + " | "
        + " | ".join(f"**{ratio(t, totals[0])}**" for t in totals[1:])
        + " |"
    )
    lines += compaction_table(runs, writers, saves)
    lines += ["", "Bytes the server received for each save, and on the bucket after it (MB; the last run):", ""]
    lines.append(
        "| save | "
        + " | ".join(f"{w} uploaded | {w} on bucket" for w in writers)
        + " | "
        + " | ".join(f"{w} / fsspec on bucket" for w in writers[1:])
        + " |"
    )
    lines.append("|---" * (1 + 2 * len(writers) + len(writers) - 1) + "|")
    last = runs[-1]["save"]["rows"]
    for s in range(saves):
        cells = [(last[s][f"{w}.sync"]["uploaded"], last[s][f"{w}.sync"]["on_bucket"]) for w in writers]
        ratios = [ratio(c[1], cells[0][1]) for c in cells[1:]]
        if s == saves - 1:
            ratios = [f"**{r}**" for r in ratios]
        lines.append(
            f"| {s + 1} | "
            + " | ".join(f"{u / MB:.1f} | {b / MB:.1f}" for u, b in cells)
            + " | "
            + " | ".join(ratios)
            + " |"
        )
    lines += [
        "",
        "`dcp.async_save`: seconds training is blocked (until it returns) / until its future is done, and blocked / the same writer's synchronous save:",
        "",
    ]
    lines.append("| save | " + " | ".join(f"{w} blocked / total s | {w} blocked / sync" for w in writers) + " |")
    lines.append("|---" * (1 + 2 * len(writers)) + "|")
    for s in range(saves):
        cells = []
        for w in writers:
            blocked, total = save_figure(runs, s, f"{w}.async", "blocked"), save_figure(runs, s, f"{w}.async", "total")
            cells.append(f"{blocked:.2f} / {total:.2f} | {ratio(blocked, save_figure(runs, s, f'{w}.sync', 'wall'))}")
        lines.append(f"| {s + 1} | " + " | ".join(cells) + " |")
    return lines


def compaction_table(runs: list[dict[str, Any]], writers: list[str], saves: int) -> list[str]:
    """When ckstore's compaction after each save finished, beside the save's own wall time: the
    script waits for it before the bucket is listed and the next writer saves, so it never runs
    during another save here (in a training loop it runs during the next steps)."""
    if "ckstore" not in writers or "compacted_after" not in runs[0]["save"]["rows"][0]["ckstore.sync"]:
        return []
    lines = [
        "",
        "ckstore's remote compaction after each save (a detached process at the lowest priority): seconds from the"
        " save's return (synchronous) or its future's end (async) until the compaction had finished, and its CPU"
        " seconds; the save's wall time and FsspecWriter's beside (medians):",
        "",
        "| save | ckstore sync wall s | compaction done after s | its CPU s | fsspec sync wall s | async: compaction done after s | its CPU s |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in range(saves):
        fs = f"{save_figure(runs, s, 'fsspec.sync', 'wall'):.2f}" if "fsspec" in writers else "–"
        cells = [
            f"{save_figure(runs, s, 'ckstore.sync', 'wall'):.2f}",
            f"{save_figure(runs, s, 'ckstore.sync', 'compacted_after'):.2f}",
            f"{save_figure(runs, s, 'ckstore.sync', 'compaction_cpu'):.1f}",
            fs,
            f"{save_figure(runs, s, 'ckstore.async', 'compacted_after'):.2f}",
            f"{save_figure(runs, s, 'ckstore.async', 'compaction_cpu'):.1f}",
        ]
        lines.append(f"| {s + 1} | " + " | ".join(cells) + " |")
    return lines


def load_table(runs: list[dict[str, Any]], writers: list[str]) -> list[str]:
    lines = [
        "Loading the fourth save into a model and optimizer built for 1, 2 and 4 ranks (seconds of `dcp.load`, slowest rank; bytes the server sent):",
        "",
        "| ranks | "
        + " | ".join(f"{w} s" for w in writers)
        + " | "
        + " | ".join(f"{w} / fsspec" for w in writers[1:])
        + " | MB downloaded ("
        + " / ".join(writers)
        + ") | bit-identical |",
        "|---" * (3 + 2 * len(writers) - 1) + "|",
    ]
    for ranks in LOAD_WORLDS:
        times = [med([r[f"load{ranks}"][w]["load_s"] for r in runs]) for w in writers]
        down = " / ".join(f"{runs[-1][f'load{ranks}'][w]['downloaded'] / MB:.0f}" for w in writers)
        ok = all(not r[f"load{ranks}"][w]["differs"] for r in runs for w in writers)
        lines.append(
            f"| {ranks} | "
            + " | ".join(f"{t:.2f}" for t in times)
            + " | "
            + " | ".join(ratio(t, times[0]) for t in times[1:])
            + f" | {down} | {'yes, every writer, every run' if ok else 'NO'} |"
        )
    return lines


def rss_table(result: dict[str, Any], writers: list[str]) -> list[str]:
    shard = result[f"{writers[0]}.0"]["shard"]
    lines = [
        f"Resident set during `dcp.save` of a {shard / MB:.0f} MB per-rank shard (the largest rank; the interpreter with torch and no state: {result['interpreter'] / MIB:.0f} MiB):",
        "",
        "| writer | save 1: RSS before MiB | peak above it MiB | save 2: before | peak above it MiB |",
        "|---|---|---|---|---|",
    ]
    for w in writers:
        a, b = result[f"{w}.0"], result[f"{w}.1"]
        lines.append(
            f"| {w} | {a['before'] / MIB:.0f} | **{a['above'] / MIB:.0f}** | {b['before'] / MIB:.0f} | **{b['above'] / MIB:.0f}** |"
        )
    return lines


def _loads(runs: list[dict[str, Any]]) -> str:
    return "; ".join(
        f"{' / '.join(f'{x:.1f}' for x in r['load_before'])} → {' / '.join(f'{x:.1f}' for x in r['load_after'])}"
        for r in runs
    )


def _verdict(ok: bool) -> str:
    return "met" if ok else "**not met**"


def _run_total(run: dict[str, Any], writer: str) -> float:
    return sum(row[f"{writer}.sync"]["wall"] for row in run["save"]["rows"])


def targets(saves: dict[str, Any] | None, memory: dict[str, Any] | None) -> list[str]:
    """ckstore's figures against the targets, from the tables' own numbers."""
    rows = []
    if saves is not None and "ckstore" in saves["args"]["writers"] and "fsspec" in saves["args"]["writers"]:
        runs, n = saves["runs"], saves["args"]["saves"]
        last = runs[-1]["save"]["rows"][-1]
        on = last["ckstore.sync"]["on_bucket"] / last["fsspec.sync"]["on_bucket"]
        rows.append(
            f"| bytes on the bucket after {n} saves, ckstore / fsspec | ≤ 0.45 | {on:.3f} | {_verdict(on <= 0.45)} |"
        )
        walls = {w: sum(save_figure(runs, s, f"{w}.sync", "wall") for s in range(n)) for w in ("ckstore", "fsspec")}
        wall = walls["ckstore"] / walls["fsspec"]
        each = ", ".join(f"{_run_total(r, 'ckstore') / _run_total(r, 'fsspec'):.2f}" for r in runs)
        rows.append(
            f"| save wall time over the {n} saves, ckstore / fsspec | ≤ 1.0 | {wall:.2f} (runs: {each}) "
            f"| {_verdict(wall <= 1.0)} |"
        )
        blocked = max(
            save_figure(runs, s, "ckstore.async", "blocked") / save_figure(runs, s, "ckstore.sync", "wall")
            for s in range(n)
        )
        rows.append(
            f"| `async_save` blocked / synchronous save, ckstore, worst save | ≤ 0.5 | {blocked:.2f} | {_verdict(blocked <= 0.5)} |"
        )
        ok = all(not r[f"load{k}"][w]["differs"] for r in runs for k in LOAD_WORLDS for w in saves["args"]["writers"])
        rows.append(
            f"| loads bit-identical at 1, 2 and 4 ranks | all | {'all' if ok else 'not all'} | {_verdict(ok)} |"
        )
    if memory is not None and "ckstore" in memory["args"]["rss_writers"]:
        above = max(memory["run"]["rss"][f"ckstore.{i}"]["above"] for i in (0, 1)) / MIB
        rows.append(
            f"| peak RSS above the rank before the save, ckstore, 1 GB shard | < 500 MiB | {above:.0f} MiB | {_verdict(above < 500)} |"
        )
    if not rows:
        return []
    return ["| target | bound | measured | |", "|---|---|---|---|", *rows]


def report(saves: dict[str, Any] | None, memory: dict[str, Any] | None, local: dict[str, Any] | None = None) -> str:
    lines: list[str] = targets(saves, memory)
    if saves is not None:
        a, runs = saves["args"], saves["runs"]
        writers = list(a["writers"])
        lines += [
            "",
            f"`python scripts/bench_dcp_s3.py --phases save --runs {len(runs)} --steps {a['steps']}`"
            f" ({os.cpu_count()} cores shared with other work; `uptime` load average 1/5/15 min before → after"
            f" each run: {_loads(runs)}). 2 ranks, FSDP2 GPT-style decoder ({a['layers']} blocks, width"
            f" {a['dim']}, vocabulary {a['vocab']}, context {a['seq']}) + AdamW: {runs[0]['save']['state_bytes'] / MB:.0f}"
            f" MB of state, {a['steps']} training steps (batch {a['batch']}) between saves, {a['saves']} saves."
            f" Times are medians of {len(runs)} runs, each on a fresh server; writers: {', '.join(writers)}.",
            "",
            *save_tables(runs, writers),
            "",
            *load_table(runs, writers),
        ]
    if memory is not None:
        a, run = memory["args"], memory["run"]
        lines += [
            "",
            f"`python scripts/bench_dcp_s3.py --phases rss` (width {a['rss_dim']}, {a['rss_layers']} blocks;"
            f" load average {_loads([run])}).",
            "",
            *rss_table(run["rss"], list(a["rss_writers"])),
        ]
    if local is not None:
        a, rows = local["args"], local["run"]["local"]
        lines += [
            "",
            f"`python scripts/bench_dcp_s3.py --phases local --steps {a['steps']}`: the same training and saves into a local"
            " ckstore repository (its compaction after each save waited for) and FileSystemWriter folders, bytes on disk"
            f" (load average {_loads([local['run']])}):",
            "",
            "| save | FileSystemWriter MB | local ckstore repository MB | ratio |",
            "|---|---|---|---|",
            *(
                f"| {i + 1} | {r['fs'] / MB:.1f} | {r['ckstore'] / MB:.1f} | {r['ckstore'] / r['fs']:.3f} |"
                for i, r in enumerate(rows)
            ),
        ]
    return "\n".join(lines).strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    peers = Path("/work/venv-peers/bin/python")
    parser.add_argument(
        "--phases",
        nargs="*",
        choices=["save", "rss", "local"],
        default=["save", "rss", "local"],
        help="what to run (none: only write the report from the results in --work)",
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="training steps between saves")
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--writers", nargs="+", choices=WRITERS, default=list(WRITERS))
    parser.add_argument("--rss-dim", type=int, default=1024, help="the memory phase's model: 1 GB of state per rank")
    parser.add_argument("--rss-layers", type=int, default=12)
    parser.add_argument("--rss-writers", nargs="+", choices=WRITERS, default=["fsspec", "ckstore"])
    parser.add_argument(
        "--python", default=str(peers) if peers.exists() else sys.executable, help="the ranks' interpreter"
    )
    parser.add_argument("--work", default=str(ROOT / "bench-work" / "dcp-s3"))
    parser.add_argument("--keep", action="store_true", help="keep each run's server data")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds one torchrun launch may take")
    parser.add_argument("--write-docs", type=Path, help="write the section from this and earlier phases' results")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    recorded = {k: v for k, v in vars(args).items() if k not in ("write_docs",)}
    if "save" in args.phases:
        runs: list[dict[str, Any]] = []
        for run in range(args.runs):
            runs.append(one_run(args, run, "save"))
            (work / "saves.json").write_text(json.dumps({"args": recorded, "runs": runs}))
    for phase, name in (("rss", "memory.json"), ("local", "local.json")):
        if phase in args.phases:
            (work / name).write_text(json.dumps({"args": recorded, "run": one_run(args, 0, phase)}))
    names = ("saves.json", "memory.json", "local.json")
    found = [json.loads((work / n).read_text()) if (work / n).exists() else None for n in names]
    body = report(*found)
    print(body)
    if args.write_docs:
        from bench_sections import write_section

        write_section(args.write_docs, "DCP straight to S3: FsspecWriter, s3torchconnector and ckstore", body)


if __name__ == "__main__":
    main()
