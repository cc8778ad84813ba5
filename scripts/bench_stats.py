"""What recording per-tensor statistics (format.md 5.1) costs a commit (issue 23, point 1).

    python scripts/bench_stats.py [--runs 5] [--epochs 3] [--dtypes fp32_full bf16]
        [--work DIR] [--write-docs docs/benchmarks.md]

Commits real all-MiniLM-L6-v2 fine-tune epochs (scripts/bench_data.py: model + AdamW state, 60
steps apart, fp32 and bf16, about 271 / 136 MB) into fresh repositories, with the statistics
recorded (today's commit) and with them switched off (``ingest`` called without its ``stats``
argument: the commit of before), two ways:

- ``api``: ``Repo.commit`` of the epoch's folder in this process;
- ``cli``: the ``ckstore commit`` command as a training script runs it (a subprocess per epoch,
  start-up included; the switch is made in that process before the command runs).

Every repetition runs all four (api/cli × with/without) one after the other, the order of "with"
and "without" alternating between repetitions, so a slow moment of the shared machine hits both
alike. A repetition's figure is the mean seconds per commit of the epochs after the first (the
first has no parent to compare with), wall and CPU (user + system, every thread of the process
that commits: on a shared machine CPU time shows the work, wall time mostly the wait for a
core); the median over repetitions is reported, with the machine's load average before and
after. Compaction is off on both sides (run_cli says why).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_data import RUNS, ensure_checkpoints  # noqa: E402
from bench_env import installed_like_env  # noqa: E402
from bench_sections import write_section  # noqa: E402

import ckstore.write.commit as commit_module  # noqa: E402
from ckstore.repo import Repo  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CLI_ENV: dict[str, str] | None = None  # main sets it: bytecode compiled, as installed (bench_env.py)
_INGEST = commit_module.ingest
# The CLI with compaction off (see run_cli), and for "without" the statistics switched off the
# same way as in this process.
_NO_COMPACTION = (
    "import ckstore.write.background as b\n"
    "init = b.BackgroundWork.__init__\n"
    "def no_compaction(self):\n"
    "    init(self)\n"
    "    self.compact_after_commit = False\n"
    "b.BackgroundWork.__init__ = no_compaction\n"
)
_CLI_WITHOUT = (
    _NO_COMPACTION + "import sys\n"
    "import ckstore.write.commit as c\n"
    "real = c.ingest\n"
    "def ingest(*a, **k):\n"
    "    k.pop('stats', None)\n"
    "    return real(*a, **k)\n"
    "c.ingest = ingest\n"
    "from ckstore.cli import run\n"
    "sys.argv[0] = 'ckstore'\n"
    "run()\n"
)
# run(): what the ckstore command's entry point calls.
_CLI_WITH = (
    _NO_COMPACTION
    + "import sys\nimport ckstore.write.commit\nfrom ckstore.cli import run\nsys.argv[0] = 'ckstore'\nrun()\n"
)


def _without_stats(*args: Any, **kwargs: Any) -> Any:
    kwargs.pop("stats", None)
    return _INGEST(*args, **kwargs)


def load() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def run_api(folders: list[Path], repo_path: Path, record: bool) -> tuple[float, float]:
    """Mean wall and CPU seconds (every thread of this process) per commit after the first."""
    commit_module.ingest = _INGEST if record else _without_stats
    try:
        repo = Repo.init(repo_path)
        repo.compact_after_commit = False  # see run_cli
        times, cpus = [], []
        for folder in folders:
            start, cpu = time.perf_counter(), _cpu(resource.RUSAGE_SELF)
            repo.commit([folder], message=folder.name)
            times.append(time.perf_counter() - start)
            cpus.append(_cpu(resource.RUSAGE_SELF) - cpu)
    finally:
        commit_module.ingest = _INGEST
    return statistics.mean(times[1:]), statistics.mean(cpus[1:])


def run_cli(folders: list[Path], repo_path: Path, record: bool) -> tuple[float, float]:
    """Mean wall and CPU seconds of the command (its process) per commit after the first.

    Compaction is off on both paths: it re-encodes the parent after the commit is durable (the
    CLI's in a detached process), and the next commit computes the same with or without it
    (new chunks are stored fast and named by their bytes, the statistics compare chunk ids from
    the parent's manifest); waiting for it took minutes per repetition on the shared machine."""
    Repo.init(repo_path)
    script = _CLI_WITH if record else _CLI_WITHOUT
    times, cpus = [], []
    for folder in folders:
        start, cpu = time.perf_counter(), _cpu(resource.RUSAGE_CHILDREN)
        proc = subprocess.run(
            [sys.executable, "-c", script, "--repo", str(repo_path), "commit", str(folder), "-m", folder.name],
            env=CLI_ENV,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        times.append(time.perf_counter() - start)
        cpus.append(_cpu(resource.RUSAGE_CHILDREN) - cpu)
        if proc.returncode:
            raise SystemExit(f"ckstore commit failed: {proc.stderr.decode().strip()}")
    return statistics.mean(times[1:]), statistics.mean(cpus[1:])


def bench(folders: list[Path], work: Path, runs: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {}
    for rep in range(runs):
        order = (False, True) if rep % 2 == 0 else (True, False)
        for path, runner in (("api", run_api), ("cli", run_cli)):
            for record in order:
                repo_path = work / f"repo-{path}-{record}-{rep}"
                key = f"{path}-{'with' if record else 'without'}"
                wall, cpu = runner(folders, repo_path, record)
                samples.setdefault(key, []).append(wall)
                samples.setdefault(key + "-cpu", []).append(cpu)
                shutil.rmtree(repo_path)
        print(f"  run {rep + 1}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in samples.items()), flush=True)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=3, help="epochs committed per repository (of the 4 cached)")
    parser.add_argument("--dtypes", nargs="+", choices=list(RUNS), default=["fp32_full", "bf16"])
    parser.add_argument("--work", type=Path, default=ROOT / "bench-work")
    parser.add_argument("--write-docs", type=Path)
    args = parser.parse_args()
    runs = ensure_checkpoints(args.work / "checkpoints", epochs=4, steps=60, runs=tuple(args.dtypes))
    work = args.work / "stats"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    global CLI_ENV
    CLI_ENV = installed_like_env(args.work / "pyc")
    rows = []
    for dtype in args.dtypes:
        folders = runs[dtype][: args.epochs]
        size = sum(f.stat().st_size for f in folders[-1].iterdir()) / 1e6
        before = load()
        samples = bench(folders, work, args.runs)
        after = load()
        for path in ("api", "cli"):
            without, with_, cpu_without, cpu_with = (
                statistics.median(samples[f"{path}-{k}"]) for k in ("without", "with", "without-cpu", "with-cpu")
            )
            spread = {k: (min(samples[f"{path}-{k}"]), max(samples[f"{path}-{k}"])) for k in ("without", "with")}
            # Paired: each repetition ran both, one right after the other.
            paired = sorted(w - o for w, o in zip(samples[f"{path}-with"], samples[f"{path}-without"]))
            rows.append(
                f"| {dtype} MiniLM, {size:.0f} MB | {'`ckstore commit`' if path == 'cli' else '`Repo.commit`'} "
                f"| {without:.3f} ({spread['without'][0]:.2f}–{spread['without'][1]:.2f}) "
                f"| {with_:.3f} ({spread['with'][0]:.2f}–{spread['with'][1]:.2f}) | **{with_ / without:.2f}×** "
                f"| {' '.join(f'{d:+.2f}' for d in paired)} "
                f"| {cpu_without:.3f} | {cpu_with:.3f} | **{cpu_with / cpu_without:.2f}×** "
                f"| {before} → {after} |"
            )
            print(rows[-1], flush=True)
    shutil.rmtree(work, ignore_errors=True)
    body = "\n".join(
        [
            f"`python scripts/bench_stats.py --runs {args.runs} --epochs {args.epochs}` ({os.cpu_count()} cores,"
            " shared with other work: load average before → after each dtype). Real all-MiniLM-L6-v2 fine-tune"
            " epochs (model + AdamW state, scripts/bench_data.py); seconds per commit of epochs 2.."
            f'{args.epochs} (epoch 1 has no parent), median of {args.runs} interleaved repetitions; "without" is'
            " the same code with ingest's `stats` argument dropped (the commit of before); the CLI row times the"
            " whole `ckstore commit` process (start-up included; bytecode cached, as an installed package has it:"
            " scripts/bench_env.py). Compaction is off on both sides: it runs after the"
            " commit is durable and does not change what the next commit computes."
            " Statistics are computed on the worker that hashes each chunk, in 64K-element blocks (float32 sums"
            " added in float64; bf16 read two elements per 32-bit word, its largest magnitude from the"
            " sign-cleared bit patterns: format/tensor_stats.py); a tensor whose chunks are all its parent's"
            " takes the parent's figures; the first worker that needs numpy imports it."
            " Recording the relative change of"
            " changed tensors too would need the parent's chunks, so commit records the change only for unchanged"
            " tensors (0) and readers compute the rest (history/magnitude.py).",
            "",
            "| state | path | wall without stats s (min–max) | wall with s (min–max) | ratio | paired differences, with − without (s, sorted) "
            "| CPU without (s) | CPU with (s) | ratio | load |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    print(body)
    if args.write_docs:
        write_section(args.write_docs, "Recording tensor statistics at commit", body)


if __name__ == "__main__":
    main()
