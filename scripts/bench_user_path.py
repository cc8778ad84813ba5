"""Benchmark: the user's path (issue 22) — the ``ckstore`` CLI as a training script calls it.

Three parts, each printed as a markdown table (docs/benchmarks.md, "The user's path"):

``epochs``: for each state size, one fresh repository per repetition; per epoch, interleaved so a
slow moment of the shared machine hits every side alike: safetensors ``save_file`` + fsync of the
epoch's tensors (already in memory) into a folder named for the epoch, ``torch.save`` + fsync of
the same tensors, then ``ckstore commit <that folder>`` as a subprocess (the whole command as a
user sees it, start-up included, whatever it leaves running in the background), then
``ckstore checkout HEAD`` into an empty folder (subprocess). Background work the command left
(a detached compaction) is waited for, by taking the repository's compaction lock, before the
next epoch, and timed apart: it is not on the user's path. Peak RSS of each ckstore process
(``wait4``). Sizes: ``0.27`` is four real all-MiniLM-L6-v2 fine-tune epochs (scripts/bench_data.py,
60 steps apart, fp32 and bf16: model + AdamW state); ``3``, ``10`` (GB) are built from those
same tensors, each tensor repeated under new names, every copy rotated by a different offset
(values and epoch-to-epoch changes are the real ones, so it compresses like a real state; no
two chunks are equal).

``compaction``: CPU seconds of the process (every thread, ``time.process_time``) of one epoch's
compaction (``Repo.compact`` after committing epochs 1..n with compaction off), against
``save_file`` + fsync of the same state; fp32 and bf16. (DCP: scripts/bench_dcp.py.)

``scaling``: repositories of 10, 100, 1,000 small commits, and of 10^4..10^6 objects (one commit
of that many tiny files); the time of ``log``, ``log -n 10``, ``show``, ``status``, ``stats``, ``fsck``,
``gc --dry-run``, ``gc``, ``push`` (one new commit to a folder remote that has the rest) and
``fetch`` (into a clone, one new commit), each a subprocess.

    python scripts/bench_user_path.py [--parts epochs compaction scaling] [--sizes 0.27 3 10]
        [--runs 3] [--commits 10 100 1000] [--objects 10000 100000] [--work DIR]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_data import ensure_checkpoints  # noqa: E402

from ckstore import Repo  # noqa: E402
from ckstore.backend.fsio import fsync_path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FILES = ("model.safetensors", "optimizer.safetensors")
# The CLI, reporting its own peak RSS on stderr as it exits: wait4's ru_maxrss would include the
# benchmark's memory (Linux carries the high-water mark across fork and exec).
_PEAK = ("import atexit, sys\n"
         "def peak():\n"
         "    for line in open('/proc/self/status'):\n"
         "        if line.startswith('VmHWM:'):\n"
         "            sys.stderr.write('\\nPEAK ' + line.split()[1] + '\\n')\n"
         "atexit.register(peak)\n"
         "from ckstore.cli import main\n"
         "sys.argv[0] = 'ckstore'\n"
         "main()\n")
CKSTORE = [sys.executable, "-c", _PEAK]


def load() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def run_cli(args: list[str], cwd: Path | None = None) -> tuple[float, float]:
    """Run ``ckstore ARGS``; (wall seconds, peak RSS MiB of that process)."""
    started = time.perf_counter()
    proc = subprocess.run([*CKSTORE, *args], cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wall = time.perf_counter() - started
    err = proc.stderr.decode()
    if proc.returncode != 0:
        raise SystemExit(f"ckstore {' '.join(args)} failed ({proc.returncode}): {err.strip()}")
    peaks = [int(line.split()[1]) for line in err.splitlines() if line.startswith("PEAK ")]
    return wall, (peaks[-1] / 1024 if peaks else float("nan"))


def run_in_process(args: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds of ``ckstore ARGS`` run in this process (no interpreter start-up or
    imports: what the command itself costs; CPU time is what a loaded machine distorts least),
    output discarded."""
    import contextlib
    import io

    from ckstore.cli import main as cli_main

    started, cpu = time.perf_counter(), time.process_time()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            cli_main.main(args, prog_name="ckstore", standalone_mode=False)
        except SystemExit:
            pass
    return time.perf_counter() - started, time.process_time() - cpu


def wait_background(repo: Path) -> float:
    """Seconds until no compaction holds the repository (a detached one the CLI left)."""
    started = time.perf_counter()
    with Repo(repo).backend.compaction_lock(3600.0):
        pass
    return time.perf_counter() - started


def save_synced(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file(tensors, str(path))
    fsync_path(path)


def torch_synced(tensors: dict[str, torch.Tensor], path: Path) -> None:
    torch.save(tensors, path)
    fsync_path(path)


def enlarge(state: dict[str, dict[str, torch.Tensor]], target: int) -> dict[str, dict[str, torch.Tensor]]:
    """The state repeated under new names up to ``target`` bytes, copy k of each tensor rotated by
    k * 4099 elements (real values and real changes between epochs; no chunk repeats)."""
    size = sum(t.numel() * t.element_size() for f in state.values() for t in f.values())
    copies = max(1, round(target / size))
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensors in state.items():
        out[name] = {}
        for k in range(copies):
            for key, t in tensors.items():
                flat = t.reshape(-1)
                out[name][f"{key}.copy{k}" if k else key] = torch.roll(flat, k * 4099).reshape(t.shape) if k else t
    return out


def epochs_of(dirs: list[Path], size_gb: float) -> list[dict[str, dict[str, torch.Tensor]]]:
    states = [{f: load_file(str(d / f)) for f in FILES} for d in dirs]
    return states if size_gb < 1 else [enlarge(s, int(size_gb * 1e9)) for s in states]


def bench_epochs(states: list[dict[str, dict[str, torch.Tensor]]], work: Path, runs: int) -> dict[str, list[float]]:
    """Per measurement, the per-epoch medians over the runs (epoch 1 first)."""
    samples: dict[str, list[list[float]]] = {}

    def add(key: str, epoch: int, value: float) -> None:
        samples.setdefault(key, [[] for _ in states])[epoch].append(value)

    for _ in range(runs):
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        repo = work / "repo"
        Repo.init(repo)
        for n, state in enumerate(states):
            folder = work / "ckpt" / f"epoch_{n + 1}"
            folder.mkdir(parents=True)
            gc.collect()
            started = time.perf_counter()
            for f, tensors in state.items():
                save_synced(tensors, folder / f.replace(".safetensors", f"_epoch_{n + 1}.safetensors"))
            fsync_path(folder)
            add("save_file", n, time.perf_counter() - started)
            pt = work / "pt"
            pt.mkdir(exist_ok=True)
            started = time.perf_counter()
            torch_synced({f"{f}/{k}": v for f, t in state.items() for k, v in t.items()}, pt / f"epoch_{n + 1}.pt")
            fsync_path(pt)
            add("torch.save", n, time.perf_counter() - started)
            (pt / f"epoch_{n + 1}.pt").unlink()
            wall, rss = run_cli(["--repo", str(repo), "commit", str(folder), "-m", f"epoch {n + 1}"])
            add("commit", n, wall)
            add("commit rss", n, rss)
            add("background", n, wait_background(repo))
            out = work / "out"
            wall, rss = run_cli(["--repo", str(repo), "checkout", "HEAD", "-o", str(out)])
            add("checkout", n, wall)
            add("checkout rss", n, rss)
            shutil.rmtree(out)
            if n > 0:  # keep the disk to two epochs' files (the repository keeps them all)
                shutil.rmtree(work / "ckpt" / f"epoch_{n}")
        add_stored = Repo(repo).stats().stored_bytes
        samples.setdefault("stored", [[] for _ in states])[-1].append(add_stored)
    shutil.rmtree(work, ignore_errors=True)
    return {k: [statistics.median(v) if v else float("nan") for v in per] for k, per in samples.items()}


def epochs_table(results: dict[str, dict[str, list[float]]], sizes: dict[str, int], runs: int) -> str:
    lines = [
        f"Medians of {runs} runs; load average (1/5/15 min) {load()} at the end (2 cores shared).",
        "",
        "| state | epoch | save_file + fsync s | torch.save + fsync s | `ckstore commit` s | ratio to save_file "
        "| checkout s | ratio | peak RSS commit / checkout MiB | background after commit s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, r in results.items():
        for n in range(len(r["save_file"])):
            s = r["save_file"][n]
            lines.append(
                f"| {label} ({sizes[label] / 1e9:.2f} GB) | {n + 1} | {s:.2f} | {r['torch.save'][n]:.2f} | {r['commit'][n]:.2f} "
                f"| {r['commit'][n] / s:.2f}× | {r['checkout'][n]:.2f} | {r['checkout'][n] / s:.2f}× "
                f"| {r['commit rss'][n]:.0f} / {r['checkout rss'][n]:.0f} | {r['background'][n]:.2f} |")
    return "\n".join(lines)


def bench_compaction(states: list[dict[str, dict[str, torch.Tensor]]], work: Path, runs: int) -> tuple[float, float, float]:
    """(save_file + fsync s, its CPU s, compaction CPU s) of the last epoch, medians over runs."""
    save, save_cpu, compact = [], [], []
    for _ in range(runs):
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        repo = Repo.init(work / "repo")
        repo.compact_after_commit = False
        for n, state in enumerate(states):
            folder = work / f"epoch_{n + 1}"
            folder.mkdir()
            gc.collect()
            started, cpu = time.perf_counter(), time.process_time()
            for f, tensors in state.items():
                save_synced(tensors, folder / f.replace(".safetensors", f"_epoch_{n + 1}.safetensors"))
            fsync_path(folder)
            wall, cpu = time.perf_counter() - started, time.process_time() - cpu
            repo.commit(folder, message=f"epoch {n + 1}")
            if n < len(states) - 1:
                repo.compact()  # every earlier epoch as it would be
                shutil.rmtree(folder)
                continue
            cpu_before = time.process_time()
            repo.compact()
            compact.append(time.process_time() - cpu_before)
            save.append(wall)
            save_cpu.append(cpu)
    shutil.rmtree(work, ignore_errors=True)
    return statistics.median(save), statistics.median(save_cpu), statistics.median(compact)


def _tiny_commits(repo: Path, work: Path, count: int) -> None:
    r = Repo.init(repo)
    r.compact_after_commit = False
    for i in range(count):
        f = work / "small" / "metrics.json"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(f'{{"step": {i}}}')
        r.commit(f.parent, message=f"step {i}", metadata={"loss": 1.0 / (i + 1)})


def _many_objects(repo: Path, work: Path, count: int) -> None:
    r = Repo.init(repo)
    folder = work / "objects"
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (folder / f"{i:07d}.txt").write_text(f"object {i}\n")
    r.commit(folder, message=f"{count} objects")
    r.wait()
    shutil.rmtree(folder)


COMMANDS = ("log", "log -n 10", "show", "status", "stats", "fsck", "gc --dry-run", "gc", "push", "fetch")


def bench_scaling(work: Path, commits: list[int], objects: list[int]) -> str:
    lines = [f"Load average {load()} at the start.", "",
             "| repository | start-up (`--version`) s | " + " | ".join(f"`{c}` s" for c in COMMANDS) + " |",
             "|---|---|" + "---|" * len(COMMANDS)]
    cases = [(f"{n:,} commits", n, _tiny_commits) for n in commits] + [(f"{n:,} objects", n, _many_objects) for n in objects]
    for label, n, build in cases:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        repo = work / "repo"
        started = time.perf_counter()
        build(repo, work, n)
        built = time.perf_counter() - started
        Repo(repo).add_remote("origin", str(work / "remote"))
        run_cli(["--repo", str(repo), "push", "origin"])
        run_cli(["clone", str(work / "remote"), str(work / "clone")])
        times = {"start": statistics.median(run_cli(["--version"])[0] for _ in range(3))}
        inside: dict[str, tuple[float, float]] = {}
        for cmd in COMMANDS[:-2]:
            times[cmd] = run_cli(["--repo", str(repo), *cmd.split()])[0]
            inside[cmd] = run_in_process(["--repo", str(repo), *cmd.split()])
        f = work / "small2" / "note.txt"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("one more commit")
        Repo(repo).commit(f.parent, message="one more")
        times["push"] = run_cli(["--repo", str(repo), "push", "origin"])[0]
        times["fetch"] = run_cli(["--repo", str(work / "clone"), "fetch", "origin"])[0]
        Repo(repo).commit(f.parent, message="and one more", metadata={"n": 2})
        inside["push"] = run_in_process(["--repo", str(repo), "push", "origin"])
        inside["fetch"] = run_in_process(["--repo", str(work / "clone"), "fetch", "origin"])
        lines.append(f"| {label} (built in {built:.0f} s) | {times['start']:.2f} | " + " | ".join(f"{times[c]:.2f}" for c in COMMANDS) + " |")
        lines.append(f"| {label}, in process | – | " + " | ".join(f"{inside[c][0]:.2f}" for c in COMMANDS) + " |")
        lines.append(f"| {label}, in process, CPU | – | " + " | ".join(f"{inside[c][1]:.2f}" for c in COMMANDS) + " |")
        print("\n".join(lines[-2:]), flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["epochs", "compaction", "scaling"],
                        choices=["epochs", "compaction", "scaling"])
    parser.add_argument("--sizes", nargs="+", type=float, default=[0.27])
    parser.add_argument("--dtypes", nargs="+", default=["fp32_full", "bf16"])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--commits", nargs="*", type=int, default=[10, 100, 1000])
    parser.add_argument("--objects", nargs="*", type=int, default=[10_000, 100_000])
    parser.add_argument("--work", default=str(ROOT / "bench-work"))
    args = parser.parse_args()
    work = Path(args.work)
    print(f"load average at start {load()}", flush=True)
    if "epochs" in args.parts or "compaction" in args.parts:
        runs = ensure_checkpoints(work / "checkpoints", epochs=4, steps=60, runs=tuple(args.dtypes))
    if "epochs" in args.parts:
        results, sizes = {}, {}
        for size in args.sizes:
            for dtype in args.dtypes:
                label = f"{dtype} {size:g} GB" if size >= 1 else f"{dtype} MiniLM"
                states = epochs_of(runs[dtype], size)
                sizes[label] = sum(t.numel() * t.element_size() for f in states[-1].values() for t in f.values())
                results[label] = bench_epochs(states, work / "user_path", args.runs)
                del states
                print(epochs_table({label: results[label]}, sizes, args.runs), flush=True)
        print("\n" + epochs_table(results, sizes, args.runs), flush=True)
    if "compaction" in args.parts:
        lines = ["| state | save_file + fsync s (CPU s) | compaction CPU s | ratio to save_file wall |", "|---|---|---|---|"]
        for dtype in args.dtypes:
            save, save_cpu, cpu = bench_compaction(epochs_of(runs[dtype], 0.27), work / "compaction", args.runs)
            lines.append(f"| {dtype} MiniLM epoch 4 | {save:.2f} ({save_cpu:.2f}) | {cpu:.2f} | {cpu / save:.1f}× |")
            print(lines[-1], flush=True)
        print(f"\nload average {load()}\n" + "\n".join(lines), flush=True)
    if "scaling" in args.parts:
        print("\n" + bench_scaling(work / "scaling", args.commits, args.objects), flush=True)


if __name__ == "__main__":
    main()
