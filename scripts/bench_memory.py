"""Bounded memory of commit and checkout (issue 2): peak RSS for a multi-GiB safetensors file.

    python scripts/bench_memory.py [--size-gib 4] [--work DIR] [--write-docs docs/benchmarks.md]

Writes a safetensors file of a few big float32 tensors piece by piece (never held in memory),
then runs ``ckstore commit`` and ``ckstore checkout`` as child processes and reads each child's
own peak RSS from ``os.wait4`` (ru_maxrss), against the same interpreter that only imports
ckstore.cli. The checked-out file is hashed against the source, so a fast wrong answer cannot
pass. Target (issue 2): under ~500 MiB above the interpreter, whatever the file size.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sections import write_section  # noqa: E402

GIB = 1 << 30
MIB = 1 << 20
BLOCK = 64 * MIB  # what the generator holds at a time
TARGET_MIB = 500
CLI = "import sys; from ckstore.cli import run; sys.argv[0] = 'ckstore'; run()"


def write_big_safetensors(path: Path, total: int, tensors: int = 4) -> None:
    """``tensors`` float32 tensors of ``total`` bytes together, written block by block."""
    per = total // tensors // 4096 * 4096  # whole rows of 1024 float32
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    for i in range(tensors):
        header[f"layer{i}.weight"] = {
            "dtype": "F32",
            "shape": [per // 4 // 1024, 1024],
            "data_offsets": [i * per, (i + 1) * per],
        }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for _ in range(tensors):
            left = per
            while left:
                n = min(BLOCK, left)
                # Trained-weight-like values: normal, small; compress a little, as real ones do.
                f.write((rng.standard_normal(n // 4, dtype=np.float32) * 0.02).tobytes())
                left -= n


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(16 * MIB):
            h.update(block)
    return h.hexdigest()


# The measured command runs under this small launcher rather than as our own child: a child's
# ru_maxrss starts from the RSS of the process it was forked from (Linux keeps the high-water mark
# across exec), and this script holds numpy and a generator block; the launcher holds ~10 MiB.
LAUNCHER = """
import os, subprocess, sys
p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)
_, status, usage = os.wait4(p.pid, 0)
print(usage.ru_maxrss, os.waitstatus_to_exitcode(status))
"""


def peak_rss(args: list[str], env: dict[str, str]) -> tuple[int, float]:
    """(peak RSS in bytes, seconds) of one command run by the launcher, from its own rusage."""
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", LAUNCHER, sys.executable, *args], env=env, check=True, capture_output=True, text=True
    ).stdout.split()
    seconds = time.perf_counter() - start
    if out[1] != "0":
        raise SystemExit(f"{args} failed with exit code {out[1]}")
    return int(out[0]) * 1024, seconds  # Linux reports KiB


# A training loop's checkpointing, in a child of its own: the state's tensors are filled from an
# epoch's files with plain reads (no mapping, so the RSS is the state and nothing else), then each
# epoch is committed and the next epoch's values are written into the same tensors at once, as
# training does, while a background commit may still be running. ru_maxrss after the state is
# loaded and at the end tells what committing held on top of the state.
STATE_CHILD = """
import json, resource, sys, time
import torch
from ckstore import Repo
from ckstore.format.torch_dtypes import FROM_ST_CODE

out, repo_path, mode, *epochs = sys.argv[1:]
state = {"model": {}, "optimizer": {}}

def fill(folder):
    for part in state:
        with open(f"{folder}/{part}.safetensors", "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                t = state[part].get(name)
                if t is None:
                    t = state[part][name] = torch.empty(info["shape"], dtype=FROM_ST_CODE[info["dtype"]])
                f.seek(8 + n + info["data_offsets"][0])
                f.readinto(t.reshape(-1).view(torch.uint8).numpy())

def rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

fill(epochs[0])
repo = Repo.init(repo_path)
before = rss()
started = time.perf_counter()
blocked = 0.0
for i, folder in enumerate(epochs):
    if i:
        fill(folder)
    t = time.perf_counter()
    repo.commit_state(state, metadata={"epoch": i + 1}, background=mode == "background")
    blocked += time.perf_counter() - t
repo.wait()
size = sum(t.numel() * t.element_size() for part in state.values() for t in part.values())
json.dump({"state": size, "before": before, "peak": rss(), "seconds": time.perf_counter() - started,
           "blocked": blocked, "in_flight": repo.commits_in_flight}, open(out, "w"))
"""


def state_rss(epochs: list[Path], work: Path) -> dict[str, dict[str, float]]:
    """Peak RSS above the loaded state while committing ``epochs`` in turn, synchronously and in
    the background (back to back: the next epoch is written into the state while the previous
    commit may still run)."""
    result = {}
    for mode in ("sync", "background"):
        repo, out = work / f"repo-{mode}", work / f"rss-{mode}.json"
        shutil.rmtree(repo, ignore_errors=True)
        peak_rss(["-c", STATE_CHILD, str(out), str(repo), mode, *map(str, epochs)], dict(os.environ))
        result[mode] = json.loads(out.read_text())
        shutil.rmtree(repo, ignore_errors=True)
    return result


def state_report(r: dict[str, dict[str, float]]) -> str:
    size = r["sync"]["state"]
    lines = [
        f"Peak RSS of a training process holding a {size / MIB:.0f} MiB state (model + AdamW) that commits 4 epochs "
        "with `commit_state`, above the RSS it had once the state was loaded (`ru_maxrss` inside the child; "
        "each next epoch is written into the same tensors right after the call returns, as training would). "
        f"A background commit holds one snapshot (a private copy of the state) per commit in flight "
        f"(`Repo.commits_in_flight`, here {r['background']['in_flight']}).",
        "",
        "| commits | peak above the state MiB | in snapshots of the state | blocked s (4 commits) | total s |",
        "|---|---|---|---|---|",
    ]
    for mode, label in (("sync", "synchronous"), ("background", "background")):
        above = r[mode]["peak"] - r[mode]["before"]
        lines.append(
            f"| {label} | {above / MIB:.0f} | {above / size:.2f} | {r[mode]['blocked']:.1f} "
            f"| {r[mode]['seconds']:.1f} |"
        )
    return "\n".join(lines)


def run(size: int, work: Path) -> dict[str, float]:
    src, repo, out = work / "src", work / "repo", work / "out"
    src.mkdir(parents=True, exist_ok=True)
    big = src / "model.safetensors"
    if not big.exists() or big.stat().st_size < size:
        print(f"writing {size / GIB:.1f} GiB to {big} ...", flush=True)
        write_big_safetensors(big, size)
    shutil.rmtree(repo, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "CKSTORE_REPO": str(repo)}
    baseline, _ = peak_rss(["-c", "import ckstore.cli"], env)
    peak_rss(["-c", CLI, "init", str(repo)], env)
    print("commit ...", flush=True)
    commit_rss, commit_s = peak_rss(["-c", CLI, "commit", str(src), "-m", "big"], env)
    print("checkout ...", flush=True)
    checkout_rss, checkout_s = peak_rss(["-c", CLI, "checkout", "HEAD", "-o", str(out)], env)
    if sha256(out / "model.safetensors") != sha256(big):
        raise SystemExit("checkout is not byte-identical to the source")
    return {
        "file": big.stat().st_size,
        "baseline": baseline,
        "commit": commit_rss,
        "commit_s": commit_s,
        "checkout": checkout_rss,
        "checkout_s": checkout_s,
    }


def report(r: dict[str, float]) -> str:
    def row(name: str, key: str) -> str:
        above = (r[key] - r["baseline"]) / MIB
        verdict = "yes" if above < TARGET_MIB else "**no**"
        return (
            f"| {name} | {r[key] / MIB:.0f} | {above:.0f} | {verdict} | {r[key + '_s']:.0f} "
            f"| {r['file'] / MIB / r[key + '_s']:.0f} |"
        )

    return "\n".join(
        [
            f"Generated by `python scripts/bench_memory.py` on {platform.machine()}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}. One {r['file'] / GIB:.2f} GiB safetensors file (4 float32 "
            "tensors), committed to an empty repository and checked out again as child processes; peak RSS "
            "is each child's own `ru_maxrss` (`os.wait4` in a small launcher). Baseline: the same interpreter running "
            f"`import ckstore.cli`, {r['baseline'] / MIB:.0f} MiB. The checkout's sha256 equals the source's.",
            "",
            f"| command | peak RSS MiB | above baseline MiB | < {TARGET_MIB} MiB | seconds | MiB/s |",
            "|---|---|---|---|---|---|",
            row("ckstore commit", "commit"),
            row("ckstore checkout", "checkout"),
        ]
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-gib", type=float, default=4.0)
    p.add_argument("--work", type=Path, help="working folder (default: a temporary one, removed after)")
    p.add_argument("--write-docs", type=Path, metavar="FILE", help="replace the 'Memory' section of FILE")
    args = p.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="ckstore-mem-"))
    try:
        result = run(int(args.size_gib * GIB), work)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    text = report(result)
    print(text)
    if args.write_docs:
        write_section(args.write_docs, "Memory", text)
    ok = all(result[k] - result["baseline"] < TARGET_MIB * MIB for k in ("commit", "checkout"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
