"""Benchmark: the least CPU a verified compaction of one epoch can cost with ckstore's codecs.

For the real MiniLM fine-tune (scripts/bench_data.py, 60 steps an epoch, 0.27 GB fp32 or 0.14 GB
bf16: model + AdamW state), epoch 4 against epoch 3, chunk by chunk (1 MiB pieces of each
tensor, as a commit cuts them), on one thread, only the codec work a compaction cannot skip
without giving up what it guarantees:

- ``read``: both chunks decoded from their fast commit encoding (``encode_sampled``);
- ``verify``: both re-hashed against their names (blake3), as every read is;
- ``encode``: the parent's chunk as a delta (byte planes of the XOR with the child's), the
  encoding compaction stores at most positions, and no other candidate tried;
- ``check``: the new encoding decoded and compared with the chunk, as compaction checks it.

No Python orchestration, no file I/O, no second candidate, no change record: so a measured
compaction's CPU (scripts/bench_user_path.py ``--parts compaction``) can only be above the sum.
Printed beside ``save_file`` + fsync of the same state (wall, median of ``--runs``), as the
ratio issue 22 bounds (compaction CPU ≤ 5× the save).

    python scripts/bench_compaction_floor.py [--runs 5] [--work DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_data import ensure_checkpoints  # noqa: E402

from ckstore.backend.fsio import fsync_path  # noqa: E402
from ckstore.codecs.objects import Kind, decode_view, encode_delta, encode_sampled  # noqa: E402
from ckstore.format.ids import chunk_id  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FILES = ("model.safetensors", "optimizer.safetensors")
CHUNK = 1 << 20
LEVEL = 1  # a new repository's zstd level


def pieces(folder: Path) -> dict[tuple[str, str, int], tuple[bytes, int]]:
    """Every tensor's 1 MiB pieces by (file, tensor, index): (bytes, element width)."""
    out = {}
    for f in FILES:
        for name, t in load_file(str(folder / f)).items():
            data = t.contiguous().view(-1).view(dtype=torch.uint8).numpy().tobytes()
            for i in range(0, len(data), CHUNK):
                out[(f, name, i)] = (data[i : i + CHUNK], t.element_size())
    return out


def floor(parent: Path, child: Path) -> dict[str, float]:
    """CPU seconds of each step over every position that changed (module docstring)."""
    old, new = pieces(parent), pieces(child)
    spent = dict.fromkeys(("read", "verify", "encode", "check"), 0.0)
    for key, (raw_new, width) in new.items():
        raw_old = old[key][0]
        if raw_old == raw_new:
            continue  # the same chunk: nothing to compact
        stored = [encode_sampled(raw, Kind.CHUNK, LEVEL) for raw in (raw_old, raw_new)]
        started = time.process_time()
        decoded = [
            bytes(decode_view(s, Kind.CHUNK, len(r), expected_len=len(r))) for s, r in zip(stored, (raw_old, raw_new))
        ]
        spent["read"] += time.process_time() - started
        started = time.process_time()
        base_id = chunk_id(decoded[1])
        chunk_id(decoded[0])
        spent["verify"] += time.process_time() - started
        started = time.process_time()
        delta = encode_delta(decoded[0], LEVEL, width, base_id, decoded[1], len(stored[0]) * 2, sample_test=False)
        spent["encode"] += time.process_time() - started
        if delta is None:
            continue
        started = time.process_time()
        back = decode_view(
            delta, Kind.CHUNK, len(raw_old), expected_len=len(raw_old), fetch_base=lambda _, n: decoded[1]
        )
        assert bytes(back) == raw_old
        spent["check"] += time.process_time() - started
    return spent


def save_seconds(folder: Path, work: Path, runs: int) -> float:
    """Median wall seconds of save_file + fsync of the state in ``folder``."""
    state = {f: load_file(str(folder / f)) for f in FILES}
    times = []
    for n in range(runs):
        out = work / f"save{n}"
        out.mkdir()
        os.sync()
        started = time.perf_counter()
        for f, tensors in state.items():
            save_file(tensors, str(out / f))
            fsync_path(out / f)
        fsync_path(out)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--work", default=str(ROOT / "bench-work"))
    args = parser.parse_args()
    runs = ensure_checkpoints(Path(args.work) / "checkpoints", epochs=4, steps=60, runs=("fp32_full", "bf16"))
    print(f"load {os.getloadavg()[0]:.1f}; CPU s of one epoch's compaction work, one thread, medians of {args.runs}\n")
    print("| state | read | verify | encode | check | sum | save_file + fsync s | sum / save |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype, dirs in runs.items():
        samples = [floor(dirs[2], dirs[3]) for _ in range(args.runs)]
        steps = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
        total = statistics.median(sum(s.values()) for s in samples)
        with tempfile.TemporaryDirectory(dir=args.work) as tmp:
            save = save_seconds(dirs[3], Path(tmp), args.runs)
        print(
            f"| {dtype} MiniLM epoch 4 | "
            + " | ".join(f"{steps[k]:.3f}" for k in steps)
            + f" | {total:.3f} | {save:.3f} | {total / save:.1f}× |",
            flush=True,
        )
    print(f"\nload {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
