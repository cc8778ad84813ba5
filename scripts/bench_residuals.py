"""How small lossless coding can make four epochs of a fine-tune: the stored-bytes limit of issue 11.

Issue 11 asks for ckstore's stored bytes over 4 epochs at or below 0.55x ZipNN's for a bf16 run
and 0.45x for a partly frozen fp32 run. This measures, on the very checkpoints scripts/bench.py
uses, what the best per-tensor coding we know of reaches, independently of ckstore's encoder:

- epoch 1: every tensor whole; epochs 2-4: every tensor whole, or its XOR residual, or its
  zig-zag integer difference against the same tensor of the previous epoch, whichever is
  smallest (ckstore's delta candidates);
- each candidate cut into byte planes (byte i of every little-endian element), every plane coded
  on its own by the better of zstd (level 3, and level 19 with ``--level19``) and its order-0
  entropy: n * H(plane) / 8 bytes, what an ideal coder of independent bytes would store.

The order-0 figure is not a bound on every coder (a context model can beat it, and zstd beats it
on runs of zeros, which is why each plane takes the better of the two), but it is what any coder
that treats a plane's bytes as independent symbols can reach, and no coder we tried came within
a few percent of it on the residuals (docs/benchmarks.md). Printed: one markdown row per run and
step count, sizes as fractions of ZipNN's bytes for the same 4 epochs (each file compressed on its
own, as scripts/bench.py measures it).

Issue 24 adds the **conditional-entropy limit** and, beside it, what ckstore stores. The limit
codes the epochs the way ckstore keeps them: the newest whole (best of zstd and order-0 per
plane, as above), every older epoch given the next one, per 1 MiB chunk and byte plane, at
H(byte | the same byte of the next epoch) (the empirical conditional entropy of a 256 x 256 table,
with no cost for the table: a lower bound for any coder that conditions each byte on the other
epoch's byte alone), or the plane coded whole when that is smaller. ckstore's figure commits the
4 epochs (files under one name, under epoch names, and ``commit_state``) and waits for each
compaction. Also printed: compaction of an epoch (mean of epochs 2-4, worst naming) against
``save_file`` + fsync of it, and checkout of epoch 1 (the newest is whole, so epoch 1's chunks
that changed are three deltas deep) as MB of files per CPU-second of the process (all its
threads: MB/s per core) and per wall second, median of 3, with the 1-minute load average: after
compaction (plain deltas) and after repack (which alone writes context-sorted deltas).

    python scripts/bench_residuals.py [--runs bf16 fp32_frozen] [--steps 25 60] [--level19]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
import zstandard
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import zipnn_files
from bench_data import RUNS, STEPS, cached_checkpoints
from bench_epochs import FILES, LAYOUTS, stage, timed
from safetensors.torch import load_file, save_file

from ckstore import Repo
from ckstore.backend.fsio import fsync_path

CHUNK = 1 << 20  # ckstore's default chunk size: the conditional limit is taken per chunk, like its deltas

TARGETS = {"fp32_full": 0.72, "bf16": 0.50, "fp32_frozen": 0.45}  # issue 24
WIDTH = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
Tensors = dict[str, tuple[np.ndarray, int]]  # name -> (bytes as uint8, element width)


def load_epoch(folder: Path) -> Tensors:
    out: Tensors = {}
    for f in FILES:
        with safe_open(str(folder / f), framework="pt") as st:
            for name in st.keys():
                t = st.get_tensor(name).contiguous()
                width = WIDTH.get(t.dtype, 1)
                out[f"{f}:{name}"] = (t.reshape(-1).view(torch.uint8).numpy().copy(), width)
    return out


def zigzag(x: np.ndarray, base: np.ndarray, width: int) -> np.ndarray:
    unsigned, signed = f"<u{width}", f"<i{width}"
    d = (x.view(unsigned) - base.view(unsigned)).view(signed)
    return ((d << 1) ^ (d >> (8 * width - 1))).view(np.uint8)


def order0(plane: np.ndarray) -> float:
    counts = np.bincount(plane, minlength=256)
    p = counts[counts > 0] / plane.size
    return float(-(p * np.log2(p)).sum() * plane.size / 8)


def plane_cost(data: np.ndarray, width: int, compressors: list[zstandard.ZstdCompressor]) -> tuple[float, float]:
    """(zstd bytes, best of zstd and order-0 per plane) of ``data`` split into byte planes."""
    if data.size < 64 or data.size % width:
        n = len(compressors[0].compress(data.tobytes()))
        return n, n
    planes = data.reshape(-1, width).T
    z = best = 0.0
    for plane in planes:
        plane = np.ascontiguousarray(plane)
        coded = min(len(c.compress(plane)) for c in compressors)
        z += coded
        best += min(coded, order0(plane))
    return z, best


def tensor_cost(
    x: np.ndarray, base: np.ndarray | None, width: int, compressors: list[zstandard.ZstdCompressor]
) -> tuple[float, float, str]:
    """The smallest (zstd, best-per-plane) over the candidates, and which candidate won."""
    candidates = {"whole": x}
    if base is not None and base.size == x.size and width in (2, 4) and x.size % width == 0:
        if np.array_equal(x, base):
            return 0.0, 0.0, "unchanged"
        candidates["xor"] = np.bitwise_xor(x, base)
        candidates["difference"] = zigzag(x, base, width)
    costs = {k: plane_cost(v, width, compressors) for k, v in candidates.items()}
    winner = min(costs, key=lambda k: costs[k][1])
    return min(c[0] for c in costs.values()), costs[winner][1], winner


def conditional(x: np.ndarray, given: np.ndarray, width: int) -> float:
    """Bytes at H(byte | the same byte of ``given``) per chunk and plane (no cost for the model)."""
    total = 0.0
    for start in range(0, x.size, CHUNK):
        xc, gc = x[start : start + CHUNK], given[start : start + CHUNK]
        if np.array_equal(xc, gc):
            continue  # the same chunk: stored once
        for plane, context in zip(xc.reshape(-1, width).T, gc.reshape(-1, width).T):
            joint = np.bincount(context.astype(np.int64) * 256 + plane, minlength=65536).reshape(256, 256)
            rows = joint.sum(axis=1, keepdims=True)
            nz = joint > 0
            bits = -(joint[nz] * np.log2((joint / np.maximum(rows, 1))[nz])).sum()
            total += min(bits / 8, order0(plane))
    return total


def conditional_limit(dirs: list[Path], compressors: list[zstandard.ZstdCompressor]) -> float:
    """The newest epoch whole, each older one given the next (how ckstore keeps them)."""
    newer = load_epoch(dirs[-1])
    total = sum(plane_cost(x, w, compressors)[1] for x, w in newer.values())
    for folder in reversed(dirs[:-1]):
        older = load_epoch(folder)
        for name, (x, width) in older.items():
            given = newer.get(name)
            whole = plane_cost(x, width, compressors)[1]
            if given is None or given[0].size != x.size or x.size % width or width == 1:
                total += whole
            else:
                total += min(whole, conditional(x, given[0], width))
        newer = older
    return total


def checkout_rates(repo: Repo, commit: str, out: Path, size: int, repeats: int = 3) -> tuple[float, float, float]:
    """Checkout of ``commit`` (``size`` bytes of files): MB per CPU-second of the process (all
    threads), MB per wall second (medians of ``repeats``) and the 1-minute load average after."""
    cpu, wall = [], []
    for _ in range(repeats):
        shutil.rmtree(out, ignore_errors=True)
        os.sync()
        started_cpu, started = time.process_time(), time.perf_counter()
        repo.checkout(commit, out)
        cpu.append(time.process_time() - started_cpu)
        wall.append(time.perf_counter() - started)
    shutil.rmtree(out)
    return size / 1e6 / statistics.median(cpu), size / 1e6 / statistics.median(wall), os.getloadavg()[0]


Rates = tuple[float, float, float]


def ckstore_stored(dirs: list[Path], work: Path) -> tuple[dict[str, int], float, Rates, Rates]:
    """Stored bytes over the epochs by naming; compaction of an epoch / save_file + fsync (worst
    naming, means of epochs 2 to 4); checkout of the oldest epoch (3 links behind the newest),
    ``checkout_rates``, after compaction (plain deltas) and after repack (context-sorted ones)."""
    stored: dict[str, int] = {}
    compaction: dict[str, float] = {}
    plain = checkout = (0.0, 0.0, 0.0)
    for layout, name in LAYOUTS.items():
        folders = stage(dirs, work / "staged", name)
        shutil.rmtree(work / "repo", ignore_errors=True)
        repo = Repo.init(work / "repo")
        waits = []
        for f in folders:
            repo.commit(str(f), message=f.name)
            waits.append(timed(repo.wait, settle=False))
        stored[layout] = repo.stats().stored_bytes
        compaction[layout] = statistics.mean(waits[1:])
        size = sum((dirs[0] / f).stat().st_size for f in FILES)
        if layout == "one name":  # three links of plain deltas (compaction writes no context-sorted ones)
            plain = checkout_rates(repo, repo.log()[-1].id, work / "out", size)
        # Context-sorted deltas are written by repack only (compaction stays cheap beside training).
        repo.repack()
        stored[f"{layout}, repacked"] = repo.stats().stored_bytes
        if layout == "one name":  # decoding three links of repacked deltas, context-sorted ones included
            checkout = checkout_rates(repo, repo.log()[-1].id, work / "out", size)
    shutil.rmtree(work / "repo", ignore_errors=True)
    repo = Repo.init(work / "repo")
    saves = []
    for n, d in enumerate(dirs, start=1):
        state = {"model": load_file(str(d / FILES[0])), "optimizer": load_file(str(d / FILES[1]))}
        repo.commit_state(state, metadata={"epoch": n})
        repo.wait()
        out = work / "saved"
        out.mkdir(exist_ok=True)

        def save(state: dict = state, out: Path = out) -> None:
            for f, part in zip(FILES, ("model", "optimizer")):
                save_file(state[part], str(out / f))
                fsync_path(out / f)
            fsync_path(out)

        saves.append(timed(save))
    stored["state"] = repo.stats().stored_bytes
    shutil.rmtree(work, ignore_errors=True)
    return stored, max(compaction.values()) / statistics.mean(saves[1:]), plain, checkout


def kind_of(name: str) -> str:
    for kind in ("exp_avg_sq", "exp_avg", "step"):
        if name.endswith(kind) or f".{kind}" in name or f"{kind}." in name:
            return kind
    return "weights" if name.startswith("model") else "other"


def measure(dirs: list[Path], level19: bool) -> dict[str, float]:
    compressors = [zstandard.ZstdCompressor(level=3)] + ([zstandard.ZstdCompressor(level=19)] if level19 else [])
    totals: dict[str, float] = defaultdict(float)
    previous: Tensors | None = None
    for n, folder in enumerate(dirs, start=1):
        tensors = load_epoch(folder)
        for name, (x, width) in tensors.items():
            base = previous[name][0] if previous is not None and name in previous else None
            z, best, _ = tensor_cost(x, base, width, compressors)
            totals["raw"] += x.size
            totals["zstd"] += z
            totals["best"] += best
            totals[f"best {kind_of(name)}"] += best
            totals[f"epoch {n}"] += best
        previous = tensors
    return dict(totals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=Path("bench-work"))
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=["bf16", "fp32_frozen", "fp32_full"])
    parser.add_argument("--steps", nargs="+", type=int, choices=list(STEPS), default=list(STEPS))
    parser.add_argument("--level19", action="store_true", help="also try zstd level 19 on every plane (slow)")
    args = parser.parse_args()
    print(
        "| steps/epoch | run | raw MB | ZipNN MB | best zstd per tensor / ZipNN | best of zstd and order-0 "
        "entropy per plane / ZipNN | epochs 1 / 2 / 3 / 4 MB | weights / exp_avg / exp_avg_sq MB | "
        "conditional-entropy limit / ZipNN | ckstore one name / epoch names / state / ZipNN (after repack) | "
        "compaction / save_file + fsync | checkout of epoch 1 after compaction: MB/s per core / wall (load) | "
        "after repack | target |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for steps in args.steps:
        for run in args.runs:
            dirs = cached_checkpoints(args.work / "checkpoints", steps=steps).get(run)
            if dirs is None:
                print(
                    f"{run}, {steps} steps: not cached under {args.work} (python scripts/bench.py trains it)",
                    file=sys.stderr,
                )
                continue
            started = time.perf_counter()
            t = measure(dirs, args.level19)
            compressors = [zstandard.ZstdCompressor(level=3)] + (
                [zstandard.ZstdCompressor(level=19)] if args.level19 else []
            )
            limit = conditional_limit(dirs, compressors)
            stored, compaction, plain, (per_core, per_wall, load) = ckstore_stored(
                dirs, Path(tempfile.mkdtemp(prefix="ckstore-residuals-", dir=args.work))
            )
            zipnn, _ = zipnn_files(dirs, "bfloat16" if run == "bf16" else "float32")
            mb = 1e6
            epochs = " / ".join(f"{t[f'epoch {n}'] / mb:.0f}" for n in range(1, len(dirs) + 1))
            kinds = " / ".join(f"{t.get(f'best {k}', 0) / mb:.0f}" for k in ("weights", "exp_avg", "exp_avg_sq"))
            ours = " / ".join(
                f"{stored[k] / zipnn:.3f} ({stored[k + ', repacked'] / zipnn:.3f})"
                if k != "state"
                else f"{stored[k] / zipnn:.3f}"
                for k in ("one name", "epoch names", "state")
            )
            print(
                f"| {steps} | {run} | {t['raw'] / mb:.0f} | {zipnn / mb:.0f} | {t['zstd'] / zipnn:.3f} | "
                f"{t['best'] / zipnn:.3f} | {epochs} | {kinds} | {limit / zipnn:.3f} | {ours} | {compaction:.2f}x | "
                f"{plain[0]:.0f} / {plain[1]:.0f} ({plain[2]:.1f}) | {per_core:.0f} / {per_wall:.0f} ({load:.1f}) | "
                f"≤ {TARGETS[run]:.2f} |",
                flush=True,
            )
            print(f"({run}, {steps} steps: {time.perf_counter() - started:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
