"""Benchmark: the user's path (issue 22) — the ``ckstore`` CLI as a training script calls it.

Two parts, each printed as a markdown table (docs/benchmarks.md, "The user's path"):

``epochs``: for each state size, one fresh repository per repetition; per epoch, interleaved so a
slow moment of the shared machine hits every side alike: safetensors ``save_file`` + fsync of the
epoch's tensors (already in memory) into a folder named for the epoch, then ``ckstore commit
<that folder>`` as a subprocess, as a training script runs it right after its save (the whole
command as a user sees it, start-up included, whatever it leaves running in the background), then
``torch.save`` + fsync of the same tensors (for comparison; after the command, so its writes do
not evict the checkpoint the command reads), then ``ckstore checkout HEAD`` into an empty folder (subprocess), and again with ``--fsync`` (durable
files, as the save is; without it the files are written as cp writes them). Background work the command left
(a detached compaction) is waited for, by taking the repository's compaction lock, before the
next epoch, and timed apart: it is not on the user's path. Peak RSS of each ckstore process
(``wait4``). Sizes: ``0.27`` is four real all-MiniLM-L6-v2 fine-tune epochs (scripts/bench_data.py,
60 steps apart, fp32 and bf16: model + AdamW state); ``3``, ``10`` (GB) are built from those
same tensors, each tensor repeated under new names, every copy rotated by a different offset
(values and epoch-to-epoch changes are the real ones, so it compresses like a real state; no
two chunks are equal).

``compaction``: CPU seconds of the compaction of the last epoch as ``ckstore commit`` leaves it
running: a fork of the command (compaction/detached.py), which logs its own CPU seconds to
compact.log; beside it, the same compaction of a copy of the same repository in a new
interpreter (``python -m ckstore.compaction.detached``, start-up and imports included: how a command
that cannot fork runs it), against ``save_file`` + fsync of the same state (wall and CPU), both
after an ``os.sync()``. Epochs 1..n-1 are committed with compaction off, each compacted in this
process; epoch n by the command. Also the stored bytes after the compaction and after ``repack``;
fp32 and bf16, files named per epoch and files keeping one name (``--names``: then the parent
has each tensor under the same path, and compaction writes the change record, format.md 5.2).
(DCP: scripts/bench_dcp.py.)

The scaling table (how each command's cost grows with history and objects) is
scripts/bench_scaling.py.

    python scripts/bench_user_path.py [--parts epochs compaction] [--sizes 0.27 3 10]
        [--runs 3] [--names epoch same] [--work DIR]
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_data import RUNS, ensure_checkpoints  # noqa: E402
from bench_env import installed_like_env  # noqa: E402

from ckstore import Repo  # noqa: E402
from ckstore.backend.fsio import fsync_path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FILES = ("model.safetensors", "optimizer.safetensors")
# The CLI, reporting its own peak RSS on stderr as it exits: wait4's ru_maxrss would include the
# benchmark's memory (Linux carries the high-water mark across fork and exec). It also reports
# the bytes its threads made the kernel read from the disk (/proc/self/io read_bytes): what the
# page cache did not hold.
_PEAK = (
    "import atexit, sys\n"
    "def peak():\n"
    "    for line in open('/proc/self/status'):\n"
    "        if line.startswith('VmHWM:'):\n"
    "            sys.stderr.write('\\nPEAK ' + line.split()[1] + '\\n')\n"
    "    for line in open('/proc/self/io'):\n"
    "        if line.startswith('read_bytes:'):\n"
    "            sys.stderr.write('\\nDISKREAD ' + line.split()[1] + '\\n')\n"
    "atexit.register(peak)\n"
    "from ckstore.cli import run\n"  # what the ckstore command's entry point calls
    "sys.argv[0] = 'ckstore'\n"
    "run()\n"
)
CKSTORE = [sys.executable, "-c", _PEAK]
CLI_ENV: dict[str, str] | None = None  # main sets it: bytecode compiled, as installed (bench_env.py)


def load() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def run_cli(args: list[str], cwd: Path | None = None) -> tuple[float, float, float]:
    """Run ``ckstore ARGS``; (wall seconds, peak RSS MiB of that process, MB it read from disk)."""
    started = time.perf_counter()
    proc = subprocess.run([*CKSTORE, *args], cwd=cwd, env=CLI_ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wall = time.perf_counter() - started
    err = proc.stderr.decode()
    if proc.returncode != 0:
        raise SystemExit(f"ckstore {' '.join(args)} failed ({proc.returncode}): {err.strip()}")
    peaks = [int(line.split()[1]) for line in err.splitlines() if line.startswith("PEAK ")]
    reads = [int(line.split()[1]) for line in err.splitlines() if line.startswith("DISKREAD ")]
    return wall, (peaks[-1] / 1024 if peaks else float("nan")), (reads[-1] / 1e6 if reads else float("nan"))


def wait_background(repo: Path) -> float:
    """Seconds until no compaction of the repository runs or waits (a detached one the CLI left;
    its place in line is taken before the command exits, so it cannot be missed)."""
    started = time.perf_counter()
    Repo(repo).wait_background()
    return time.perf_counter() - started


def release_memory() -> float:
    """Hand freed heap memory back to the kernel (glibc keeps what a freed state's tensors used,
    and a process that kept 4 GB more than its state left the page cache that much smaller than a
    training process of that state would); this process's resident MiB after."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def save_synced(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file(tensors, str(path))
    fsync_path(path)


def save_state(state: State, folder: Path, epoch: int | None, synced: bool = True) -> None:
    """Each file of ``state`` into ``folder`` (named for ``epoch`` unless None), then the folder
    synced. A function, so that no loop variable keeps a file's tensors alive into the next
    epoch: the loop's ``tensors`` held the last file (the optimizer's, 2/3 of the state) until
    session 9, and the benchmark process held 16 GB at 10 GB, not 10."""
    for f, tensors in state.items():
        path = folder / (f if epoch is None else f.replace(".safetensors", f"_epoch_{epoch}.safetensors"))
        (save_synced if synced else lambda t, p: save_file(t, str(p)))(tensors, path)
    if synced:
        fsync_path(folder)


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


State = dict[str, dict[str, torch.Tensor]]


def epochs_of(dirs: list[Path], size_gb: float) -> list[Callable[[], State]]:
    """Each epoch's state, made when asked: a multi-GB state is built one epoch at a time, so the
    benchmark holds one epoch, not four."""

    def make(d: Path) -> Callable[[], State]:
        def build() -> State:
            state = {f: load_file(str(d / f)) for f in FILES}
            return state if size_gb < 1 else enlarge(state, int(size_gb * 1e9))

        return build

    if size_gb < 1:  # small enough to keep: every run reuses the same tensors
        states = [make(d)() for d in dirs]
        return [lambda s=s: s for s in states]
    return [make(d) for d in dirs]


def state_bytes(state: State) -> int:
    return sum(t.numel() * t.element_size() for f in state.values() for t in f.values())


def bench_epochs(
    epochs: list[Callable[[], State]],
    work: Path,
    runs: int,
    readme_path: bool = False,
) -> dict[str, list[float]]:
    """Per measurement, the per-epoch medians over the runs (epoch 1 first)."""
    samples: dict[str, list[list[float]]] = {}

    def add(key: str, epoch: int, value: float) -> None:
        samples.setdefault(key, [[] for _ in epochs])[epoch].append(value)

    for _ in range(runs):
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        repo = work / "repo"
        Repo.init(repo)
        if readme_path:
            Repo.init(work / "repo_unsynced")
        for n, make_state in enumerate(epochs):
            state = None
            release_memory()
            state = make_state()
            folder = work / "ckpt" / f"epoch_{n + 1}"
            folder.mkdir(parents=True)
            add("bytes", n, state_bytes(state))
            add("own rss", n, release_memory())
            started = time.perf_counter()
            save_state(state, folder, n + 1)
            add("save_file", n, time.perf_counter() - started)
            wall, rss, read = run_cli(["--repo", str(repo), "commit", str(folder), "-m", f"epoch {n + 1}"])
            add("commit", n, wall)
            add("commit rss", n, rss)
            add("commit read", n, read)
            add("background", n, wait_background(repo))
            out = work / "out"
            wall, rss, read = run_cli(["--repo", str(repo), "checkout", "HEAD", "-o", str(out)])
            add("checkout", n, wall)
            add("checkout rss", n, rss)
            add("checkout read", n, read)
            shutil.rmtree(out)
            os.sync()  # the next checkout's fsync waits only for its own files
            wall, _, _ = run_cli(["--repo", str(repo), "checkout", "HEAD", "-o", str(out), "--fsync"])
            add("checkout fsync", n, wall)
            shutil.rmtree(out)
            # torch.save last, as a comparison only: between the save and the command (as until
            # session 6) its writes evicted the checkpoint the command reads, and between the
            # commit and the checkout (until session 8) the pack the checkout reads, at 10 GB
            # most of either, which a training script's own path does not do.
            pt = work / "pt"
            pt.mkdir(exist_ok=True)
            started = time.perf_counter()
            torch_synced({f"{f}/{k}": v for f, t in state.items() for k, v in t.items()}, pt / f"epoch_{n + 1}.pt")
            fsync_path(pt)
            add("torch.save", n, time.perf_counter() - started)
            (pt / f"epoch_{n + 1}.pt").unlink()
            if readme_path:
                # As the README's training script does it: save_file without fsync, then the
                # command at once (a second repository, same history), so the commit's durability
                # barrier meets the checkpoint's dirty pages.
                loose = work / "ckpt_unsynced" / f"epoch_{n + 1}"
                loose.mkdir(parents=True)
                save_state(state, loose, n + 1, synced=False)
                wall, _, _ = run_cli(
                    ["--repo", str(work / "repo_unsynced"), "commit", str(loose), "-m", f"epoch {n + 1}"]
                )
                add("commit unsynced", n, wall)
                wait_background(work / "repo_unsynced")
                shutil.rmtree(loose)
            if n > 0:  # keep the disk to two epochs' files (the repository keeps them all)
                shutil.rmtree(work / "ckpt" / f"epoch_{n}")
        add_stored = Repo(repo).stats().stored_bytes
        samples.setdefault("stored", [[] for _ in epochs])[-1].append(add_stored)
    shutil.rmtree(work, ignore_errors=True)
    return {k: [statistics.median(v) if v else float("nan") for v in per] for k, per in samples.items()}


def epochs_table(results: dict[str, dict[str, list[float]]], sizes: dict[str, int], runs: int) -> str:
    lines = [
        f"Medians of {runs} runs; load average (1/5/15 min) {load()} at the end (2 cores shared).",
        "",
        "| state | epoch | save_file + fsync s | torch.save + fsync s | `ckstore commit` s | ratio to save_file "
        "| checkout s | ratio | `checkout --fsync` s | ratio | peak RSS commit / checkout MiB "
        "| read from disk commit / checkout MB | background after commit s "
        "| `ckstore commit` after an unsynced save_file s | benchmark process RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, r in results.items():
        for n in range(len(r["save_file"])):
            s = r["save_file"][n]
            lines.append(
                f"| {label} ({sizes[label] / 1e9:.2f} GB) | {n + 1} | {s:.2f} | {r['torch.save'][n]:.2f} | {r['commit'][n]:.2f} "
                f"| {r['commit'][n] / s:.2f}× | {r['checkout'][n]:.2f} | {r['checkout'][n] / s:.2f}× "
                f"| {r['checkout fsync'][n]:.2f} | {r['checkout fsync'][n] / s:.2f}× "
                f"| {r['commit rss'][n]:.0f} / {r['checkout rss'][n]:.0f} "
                f"| {r['commit read'][n]:.0f} / {r['checkout read'][n]:.0f} | {r['background'][n]:.2f} "
                f"| {r['commit unsynced'][n] if 'commit unsynced' in r else float('nan'):.2f} | {r['own rss'][n]:.0f} |"
            )
    return "\n".join(lines)


def bench_compaction(
    epochs: list[Callable[[], State]], work: Path, runs: int, same_names: bool = False
) -> dict[str, float]:
    """Medians over runs, for the last epoch: ``save`` (save_file + fsync wall s) and ``save_cpu``;
    its compaction as ``ckstore commit`` leaves it running (a fork of the command, which logs its
    CPU s to compact.log): ``cpu`` and ``wall``; the same compaction in a new interpreter, as
    a command that cannot fork runs it (``spawn_cpu``, ``spawn_wall``: the same state, copied
    while the fork waited for the compaction lock); the repository's stored bytes after it
    (``stored``: the newest epoch as its commit stored it) and after ``repack`` (``repacked``).
    ``same_names``: every epoch's files keep one name (the change record is written: format.md
    5.2), not one per epoch."""
    samples: dict[str, list[float]] = {}
    for _ in range(runs):
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        repo = Repo.init(work / "repo")
        repo.compact_after_commit = False
        for n, make_state in enumerate(epochs):
            state = make_state()
            folder = work / f"epoch_{n + 1}"
            folder.mkdir()
            gc.collect()
            os.sync()
            started, cpu = time.perf_counter(), time.process_time()
            save_state(state, folder, None if same_names else n + 1)
            wall, cpu = time.perf_counter() - started, time.process_time() - cpu
            if n < len(epochs) - 1:
                repo.commit(folder, message=f"epoch {n + 1}")
                shutil.rmtree(folder)
                repo.compact()  # every earlier epoch as it would be
                continue
            copy = work / "spawned"
            with repo.backend.compaction_lock(60):  # the command's compaction waits for it
                run_cli(["--repo", str(repo.path), "commit", str(folder), "-m", f"epoch {n + 1}"])
                shutil.copytree(repo.path, copy)
                shutil.rmtree(folder)
                os.sync()
                for repository in (repo.path, copy):  # the copy is cached whole: so is the original
                    read_all(repository / "objects")
            wait_background(repo.path)
            forked_cpu, forked_wall = logged_compaction(repo.path)
            os.sync()
            spawn_cpu, spawn_wall = compact_spawned(Repo(copy))
            for key, value in (
                ("save", wall),
                ("save_cpu", cpu),
                ("cpu", forked_cpu),
                ("wall", forked_wall),
                ("spawn_cpu", spawn_cpu),
                ("spawn_wall", spawn_wall),
                ("stored", repo.stats().stored_bytes),
            ):
                samples.setdefault(key, []).append(value)
            repo.repack()
            samples.setdefault("repacked", []).append(repo.stats().stored_bytes)
    shutil.rmtree(work, ignore_errors=True)
    return {k: statistics.median(v) for k, v in samples.items()}


def read_all(folder: Path) -> None:
    """Read every file below ``folder`` (into the page cache)."""
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb", buffering=0) as f:
                while f.read(1 << 24):
                    pass


_COMPACTED = re.compile(r"compacted '[^']*' in ([\d.]+) s \(([\d.]+) CPU s\)")


def logged_compaction(repo: Path) -> tuple[float, float]:
    """(CPU s, wall s) of the last compaction a detached process logged in ``repo``'s compact.log."""
    found = _COMPACTED.findall((repo / "compact.log").read_text())
    if not found:
        raise SystemExit(f"no finished compaction in {repo / 'compact.log'}")
    wall, cpu = found[-1]
    return float(cpu), float(wall)


def compact_spawned(repo: Repo) -> tuple[float, float]:
    """Compact ``repo``'s branch in a new interpreter, ``python -m ckstore.compaction.detached`` (with
    no place in line to give up); its CPU seconds (``getrusage`` of the child, start-up and
    imports included) and wall seconds."""
    env = {**(CLI_ENV or os.environ), "OPENBLAS_NUM_THREADS": "1"}  # as detached.start sets it
    before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "ckstore.compaction.detached", str(repo.path), repo.head_branch, "-1"],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["epochs", "compaction"], choices=["epochs", "compaction"])
    parser.add_argument("--sizes", nargs="+", type=float, default=[0.27])
    parser.add_argument("--dtypes", nargs="+", choices=list(RUNS), default=["fp32_full", "bf16"])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--names",
        nargs="+",
        default=["epoch", "same"],
        choices=["epoch", "same"],
        help="compaction: files named per epoch, or one name (relative change recorded)",
    )
    parser.add_argument("--work", default=str(ROOT / "bench-work"))
    parser.add_argument("--epochs", type=int, default=4, help="epochs per run (at most 4: the real fine-tune's)")
    parser.add_argument(
        "--readme-path",
        action="store_true",
        help="also time `ckstore commit` right after a save_file without fsync, as the README's script runs it",
    )
    args = parser.parse_args()
    work = Path(args.work)
    global CLI_ENV
    CLI_ENV = installed_like_env(work / "pyc")
    print(f"load average at start {load()}", flush=True)
    if "epochs" in args.parts or "compaction" in args.parts:
        runs = ensure_checkpoints(work / "checkpoints", epochs=4, steps=60, runs=tuple(args.dtypes))
    if "epochs" in args.parts:
        results, sizes = {}, {}
        for size in args.sizes:
            for dtype in args.dtypes:
                label = f"{dtype} {size:g} GB" if size >= 1 else f"{dtype} MiniLM"
                results[label] = bench_epochs(
                    epochs_of(runs[dtype][: args.epochs], size), work / "user_path", args.runs, args.readme_path
                )
                sizes[label] = int(results[label]["bytes"][-1])
                print(epochs_table({label: results[label]}, sizes, args.runs), flush=True)
        print("\n" + epochs_table(results, sizes, args.runs), flush=True)
    if "compaction" in args.parts:
        lines = [
            "| state | save_file + fsync s (its CPU s) | compaction CPU s: forked by the command / new interpreter "
            "| ratio to save wall: forked / new | ratio to save CPU: forked / new | stored MB after compaction / after repack "
            "| load |",
            "|---|---|---|---|---|---|---|",
        ]
        for dtype, names in ((d, n) for d in args.dtypes for n in args.names):
            before = load()
            r = bench_compaction(
                epochs_of(runs[dtype], 0.27), work / "compaction", args.runs, same_names=names == "same"
            )
            label = "files named per epoch" if names == "epoch" else "one name, change recorded"
            lines.append(
                f"| {dtype} MiniLM epoch 4, {label} ({args.runs} runs) | {r['save']:.2f} ({r['save_cpu']:.2f}) "
                f"| {r['cpu']:.2f} / {r['spawn_cpu']:.2f} | {r['cpu'] / r['save']:.1f}× / {r['spawn_cpu'] / r['save']:.1f}× "
                f"| {r['cpu'] / r['save_cpu']:.0f}× / {r['spawn_cpu'] / r['save_cpu']:.0f}× "
                f"| {r['stored'] / 1e6:.1f} / {r['repacked'] / 1e6:.1f} "
                f"| {before} → {load()} |"
            )
            print(lines[-1], flush=True)
        print("\n" + "\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
