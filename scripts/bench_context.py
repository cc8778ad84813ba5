"""Per-chunk cost of the context-sorted delta (issue 24): bytes and decode speed against a plain delta.

On the checkpoints scripts/bench.py trains, every 1 MiB chunk of every tensor of epoch 2 is
encoded against the same chunk of epoch 3 (compaction stores an older epoch as a delta of the
newer one) as a plain delta (encoding 3) and as a context-sorted delta (encoding 5, planes sorted
only where that saves SORT_GAIN bytes an element), and each is decoded (median of 3, CPU time of
this single thread: MB/s per core). Printed: one markdown row per run, bytes as fractions of
raw, the share of planes stored sorted, and the decode rates.

    python scripts/bench_context.py [--runs bf16 fp32_full] [--steps 60] [--chunks 60]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_data import RUNS, STEPS, cached_checkpoints

from ckstore.codecs.objects import HEADER_SIZE, Encoding, Kind, decode_view, encode_chunk, parse_header
from ckstore.codecs.planes import PLANE, PlaneMode

CHUNK = 1 << 20


def chunks(folder: Path) -> dict[tuple[str, int], tuple[bytes, int]]:
    """Every 1 MiB chunk of every tensor of at least 16 KiB and 2-byte or wider elements."""
    out = {}
    for name in ("model.safetensors", "optimizer.safetensors"):
        with safe_open(str(folder / name), "pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                if t.element_size() < 2 or t.numel() * t.element_size() < 16384:
                    continue
                data = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()
                for i in range(0, len(data), CHUNK):
                    out[(f"{name}:{key}", i)] = (data[i : i + CHUNK], t.element_size())
    return out


def decode_rate(data: bytes, base: bytes, repeats: int = 3) -> float:
    """Seconds of CPU to decode ``data`` once (median of ``repeats``, after one warm-up)."""
    out = np.empty(len(base), np.uint8)
    times = []
    for _ in range(repeats + 1):
        started = time.process_time()
        decode_view(data, Kind.CHUNK, 1 << 28, len(base), lambda oid, n: base, out=out)
        times.append(time.process_time() - started)
    return statistics.median(times[1:])


def sorted_planes(data: bytes) -> tuple[int, int]:
    """(planes stored sorted, planes) of a delta."""
    if parse_header(data).encoding not in (Encoding.DELTA, Encoding.CONTEXT):
        return 0, 0
    width = data[HEADER_SIZE + 33]
    modes = [PLANE.unpack_from(data, HEADER_SIZE + 34 + i * PLANE.size)[0] for i in range(width)]
    return sum(bool(m & PlaneMode.SORTED) for m in modes), width


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=Path("bench-work"))
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=["bf16", "fp32_full"])
    parser.add_argument("--steps", nargs="+", type=int, choices=list(STEPS), default=[60])
    parser.add_argument("--chunks", type=int, default=60, help="chunks sampled per run (seeded)")
    args = parser.parse_args()
    print(
        "| steps | run | chunks | plain delta / raw | context-sorted / raw | planes sorted | "
        "decode plain, MB/s per core | decode context-sorted, MB/s per core | load |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for steps in args.steps:
        for run in args.runs:
            dirs = cached_checkpoints(args.work / "checkpoints", steps=steps).get(run)
            if dirs is None:
                print(f"{run}, {steps} steps: not cached under {args.work}", file=sys.stderr)
                continue
            older, newer = chunks(dirs[1]), chunks(dirs[2])
            keys = sorted(k for k in older if k in newer and len(older[k][0]) == len(newer[k][0]))
            keys = random.Random(1).sample(keys, min(args.chunks, len(keys)))
            raw = plain_bytes = context_bytes = 0
            plain_cpu = context_cpu = 0.0
            planes = [0, 0]
            for key in keys:
                (data, width), (base, _) = older[key], newer[key]
                plain = encode_chunk(data, 1, width, "ab" * 32, base, allowed=frozenset({Encoding.DELTA}))
                ctx = encode_chunk(
                    data, 1, width, "ab" * 32, base, allowed=frozenset({Encoding.DELTA, Encoding.CONTEXT})
                )
                raw += len(data)
                plain_bytes += len(plain)
                context_bytes += len(ctx)
                plain_cpu += decode_rate(plain, base)
                context_cpu += decode_rate(ctx, base)
                found, total = sorted_planes(ctx)
                planes[0] += found
                planes[1] += total
            print(
                f"| {steps} | {run} | {len(keys)} | {plain_bytes / raw:.4f} | {context_bytes / raw:.4f} | "
                f"{planes[0]}/{planes[1]} | {raw / 1e6 / plain_cpu:.0f} | {raw / 1e6 / context_cpu:.0f} | "
                f"{os.getloadavg()[0]:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
