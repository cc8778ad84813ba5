"""Stored bytes at rest after the README loop, ckstore beside its peers, in one run.

    python scripts/bench_at_rest.py [--work DIR] [--steps 60] [--runs fp32_full bf16 fp32_frozen]
        [--code TREE ...] [--reps 3]

For each run of scripts/bench_data.py (real all-MiniLM-L6-v2 fine-tunes + AdamW, four epochs,
``--steps`` steps apart), the four epochs' two files (model, optimizer) as a fraction of their raw
bytes:

- per file: zstd -3, ZipNN, hexz (each epoch packed against the previous one's pack), z4ai
  (``z4ai.safetensors.compress_bytes``);
- chains (epoch 1 whole, epoch k as a delta of epoch k-1): z4ai's ``model_delta`` (name-aligned,
  per tensor the smaller of its XOR delta and whole) and ZipNN on the XOR of each file against
  the previous epoch's (the files of one run share one layout, checked);
- ckstore as the README teaches it, for each ``--code`` tree (default: this one), through the
  ``ckstore`` command: a ``ckstore commit`` per epoch of a folder of files named for the epoch
  (``model_epoch_N.safetensors``), each in a process of its own, the detached compaction waited
  for before the next epoch (minutes of training separate two epochs, shorter than
  ``detached.QUIET_SECONDS``; ``--epoch-seconds E --quiet Q``: epochs E seconds apart, longer
  than a quiet period of Q seconds, so that what a detached process does once the branch is
  quiet falls inside the epoch and counts as its background work), then ``ckstore wait``:
  the stored bytes then ("at rest", no repack), after ``ckstore repack``; every commit is checked
  out and compared byte for byte with its files. Times (medians of ``--reps``, after an
  ``os.sync()``): checkout of the newest commit and of the oldest (three deltas back) with
  ``ckstore checkout``, as MB of files per CPU-second of the command (all threads: MB/s per
  core), both at rest, and of the newest before ``ckstore wait`` too (as its commit stored it);
  the CPU seconds of each epoch's detached process (its compaction, and what it settled once
  the branch was quiet; from compact.log) against safetensors ``save_file`` + fsync of the
  same epoch (CPU seconds, in this process).

Prints one markdown table per part, with the 1-minute load average beside the timed figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from bench_data import RUNS, ensure_checkpoints  # noqa: E402

FILES = ("model.safetensors", "optimizer.safetensors")
DTYPE = {"bf16": ("bfloat16", "bf16")}  # run -> (ZipNN's name, z4ai's name); float32 otherwise


def _dtypes(run: str) -> tuple[str, str]:
    return DTYPE.get(run, ("float32", "fp32"))


def _xor(new: bytes, old: bytes) -> bytes:
    """``new`` XOR ``old``, the safetensors header kept as it is (same layout, checked)."""
    import numpy as np

    header = 8 + int.from_bytes(new[:8], "little")
    if len(new) != len(old) or new[:header] != old[:header]:
        raise SystemExit("the epochs' files differ in layout: an XOR chain would align nothing")
    body = np.bitwise_xor(np.frombuffer(new, np.uint8, offset=header), np.frombuffer(old, np.uint8, offset=header))
    return new[:header] + body.tobytes()


def peers(dirs: list[Path], run: str, work: Path) -> dict[str, int]:
    """Stored bytes of every peer over the run's epochs."""
    import hexz
    import z4ai.model_delta
    import z4ai.safetensors
    import zstandard
    from zipnn import ZipNN

    zipnn_dtype, _ = _dtypes(run)
    zipnn = ZipNN(input_format="byte", bytearray_dtype=zipnn_dtype, threads=os.cpu_count() or 1)
    zstd = zstandard.ZstdCompressor(level=3, threads=-1)
    out = dict.fromkeys(("zstd -3", "ZipNN", "hexz", "z4ai", "z4ai delta chain", "ZipNN XOR chain"), 0)
    packs = work / "hexz"
    shutil.rmtree(packs, ignore_errors=True)
    packs.mkdir(parents=True)
    for f in FILES:
        previous: bytes | None = None
        previous_pack: str | None = None
        for i, d in enumerate(dirs):
            data = (d / f).read_bytes()
            whole_z4ai = len(z4ai.safetensors.compress_bytes(data))
            whole_zipnn = len(zipnn.compress((d / f).read_bytes()))  # ZipNN may write into its input
            out["zstd -3"] += len(zstd.compress(data))
            out["ZipNN"] += whole_zipnn
            out["z4ai"] += whole_z4ai
            pack = packs / f"{f}.{i}.hxz"
            hexz.pack(str(d / f), str(pack), base=previous_pack)
            out["hexz"] += pack.stat().st_size
            previous_pack = str(pack)
            if previous is None:
                out["z4ai delta chain"] += whole_z4ai
                out["ZipNN XOR chain"] += whole_zipnn
            else:
                out["z4ai delta chain"] += len(z4ai.model_delta.compress(data, previous))
                out["ZipNN XOR chain"] += len(zipnn.compress(_xor(data, previous)))
            if (d / f).read_bytes() != data:
                raise SystemExit(f"a compressor changed its input ({d / f})")
            previous = data
    shutil.rmtree(packs)
    return out


def _cli(code: Path, args: list[str], cwd: Path) -> float:
    """Run ``ckstore ARGS`` with ``code`` on PYTHONPATH; CPU seconds of the command (every thread)."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(
        [sys.executable, "-c", "from ckstore.cli import run; run()", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"ckstore {' '.join(args)} failed: {proc.stderr.decode().strip()}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _stored(code: Path, repo: Path) -> int:
    env = {**os.environ, "PYTHONPATH": str(code)}
    proc = subprocess.run(
        [sys.executable, "-c", "from ckstore.cli import run; run()", "--repo", str(repo), "stats", "--json"],
        env=env,
        capture_output=True,
        check=True,
    )
    return int(json.loads(proc.stdout)["stored_bytes"])


def _save_cpu(folder: Path, out: Path) -> float:
    """CPU seconds of safetensors ``save_file`` + fsync of the epoch's files (tensors in memory)."""
    from safetensors.torch import load_file, save_file

    from ckstore.backend.fsio import fsync_path

    total = 0.0
    for f in FILES:
        tensors = load_file(str(folder / f))
        os.sync()
        started = time.process_time()
        save_file(tensors, str(out / f))
        fsync_path(out / f)
        total += time.process_time() - started
    return total


def _background_cpu(log: Path, start: int) -> float:
    """CPU seconds of the detached processes that logged past byte ``start`` of compact.log (each
    logs its own CPU so far after every run: its last figure is its total)."""
    text = log.read_bytes()[start:].decode() if log.exists() else ""
    last: dict[str, float] = {}
    for pid, cpu in re.findall(r"pid (\d+): compacted .*?\(([0-9.]+) CPU s\)", text):
        last[pid] = max(last.get(pid, 0.0), float(cpu))
    return sum(last.values()) if last else float("nan")


def _log_size(log: Path) -> int:
    return log.stat().st_size if log.exists() else 0


def _compaction_done(repo: Path) -> None:
    """Until no compaction of ``repo`` runs or waits (what ``ckstore wait`` waits for, without
    settling the tip: training goes on, the next commit comes minutes later)."""
    from ckstore import Repo

    opened = Repo(repo)
    while opened.background_work().compaction_pending:
        time.sleep(0.1)


def _checkout_rate(code: Path, repo: Path, ref: str, folder: Path, size: int, reps: int) -> float:
    """MB of files per CPU-second of ``ckstore checkout REF`` (median of ``reps``)."""
    rates = []
    for _ in range(reps):
        shutil.rmtree(folder, ignore_errors=True)
        os.sync()
        rates.append(size / 1e6 / _cli(code, ["--repo", str(repo), "checkout", ref, "-o", str(folder)], repo.parent))
    return statistics.median(rates)


def _same_files(folder: Path, epoch: Path, n: int) -> bool:
    return all(
        (folder / f.replace(".safetensors", f"_epoch_{n}.safetensors")).read_bytes() == (epoch / f).read_bytes()
        for f in FILES
    )


def readme_loop(code: Path, dirs: list[Path], work: Path, reps: int, epoch_seconds: float = 0.0) -> dict[str, float]:
    """ckstore through its command, as the README teaches it (module docstring); ``epoch_seconds``:
    each epoch's commit that long after the one before (0: once its compaction is done)."""
    root = work / "readme"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    repo = root / "repo"
    _cli(code, ["init", str(repo)], root)
    saves, compactions = [], []
    for n, d in enumerate(dirs, 1):
        folder = root / f"epoch_{n}"
        folder.mkdir()
        for f in FILES:
            shutil.copyfile(d / f, folder / f.replace(".safetensors", f"_epoch_{n}.safetensors"))
        at, started = _log_size(repo / "compact.log"), time.monotonic()
        _cli(code, ["--repo", str(repo), "commit", str(folder), "-m", f"epoch {n}"], root)
        _compaction_done(repo)  # the next epoch's training: its compaction ends meanwhile
        time.sleep(max(0.0, started + epoch_seconds - time.monotonic()))
        compactions.append(_background_cpu(repo / "compact.log", at))
        saves.append(_save_cpu(d, folder))
        shutil.rmtree(folder)
    size = sum((dirs[-1] / f).stat().st_size for f in FILES)
    before = _checkout_rate(code, repo, "HEAD", root / "out", size, reps)
    result = {"wait CPU s": _cli(code, ["--repo", str(repo), "wait"], root), "newest before wait": before}
    result.update({"at rest": _stored(code, repo), "load": os.getloadavg()[0]})
    out = root / "out"
    exact = True
    for n, d in enumerate(dirs, 1):
        shutil.rmtree(out, ignore_errors=True)
        _cli(code, ["--repo", str(repo), "checkout", f"HEAD~{len(dirs) - n}", "-o", str(out)], root)
        exact = exact and _same_files(out, d, n)
    result["newest MB/s per core"] = _checkout_rate(code, repo, "HEAD", out, size, reps)
    result["oldest MB/s per core"] = _checkout_rate(code, repo, f"HEAD~{len(dirs) - 1}", out, size, reps)
    # Epoch 1 compacts nothing against a parent: the bound is about epochs 2..n.
    ratios = [c / s for c, s in zip(compactions[1:], saves[1:])]
    result["compaction / save"] = statistics.median(ratios) if ratios else float("nan")
    _cli(code, ["--repo", str(repo), "repack"], root)
    result["after repack"] = _stored(code, repo)
    for n, d in enumerate(dirs, 1):
        shutil.rmtree(out, ignore_errors=True)
        _cli(code, ["--repo", str(repo), "checkout", f"HEAD~{len(dirs) - n}", "-o", str(out)], root)
        exact = exact and _same_files(out, d, n)
    result["bit-exact"] = float(exact)
    shutil.rmtree(root)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default=str(ROOT / "bench-work"))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    parser.add_argument("--code", nargs="+", default=[str(ROOT)], help="ckstore source trees to measure")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-peers", action="store_true", help="ckstore only")
    parser.add_argument("--epoch-seconds", type=float, default=0.0, help="seconds from one epoch's commit to the next")
    parser.add_argument("--quiet", type=float, help="CKSTORE_QUIET_SECONDS for the commands")
    args = parser.parse_args()
    if args.quiet is not None:
        os.environ["CKSTORE_QUIET_SECONDS"] = str(args.quiet)
    work = Path(args.work)
    data = ensure_checkpoints(work / "checkpoints", steps=args.steps, runs=tuple(args.runs))
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    peer_rows, ck_rows = [], []
    for run in args.runs:
        dirs = data[run]
        raw = sum((d / f).stat().st_size for d in dirs for f in FILES)
        others = {} if args.no_peers else peers(dirs, run, work)
        chain = min((others[k] for k in ("z4ai delta chain", "ZipNN XOR chain") if k in others), default=0)
        for code in args.code:
            print(f"{run}: ckstore of {code} ...", flush=True)
            ck = readme_loop(Path(code), dirs, work, args.reps, args.epoch_seconds)
            vs = f"{ck['at rest'] / chain:.3f}×" if chain else "–"
            ck_rows.append(
                f"| {run} | {Path(code).name} | {ck['at rest'] / raw:.3f} | {vs} | {ck['after repack'] / raw:.3f} | "
                f"{ck['newest before wait']:.0f} | {ck['newest MB/s per core']:.0f} | {ck['oldest MB/s per core']:.0f} | "
                f"{ck['compaction / save']:.2f}× | {ck['wait CPU s']:.1f} | {'yes' if ck['bit-exact'] else 'NO'} | {ck['load']:.1f} |"
            )
            print(ck_rows[-1], flush=True)
        if others:
            peer_rows.append(
                f"| {run} | {raw / 1e6:.0f} | " + " | ".join(f"{v / raw:.3f}" for v in others.values()) + " |"
            )
            print(peer_rows[-1], flush=True)
    quiet = os.environ.get("CKSTORE_QUIET_SECONDS", "default")
    print(
        f"\nbench_at_rest.py, {args.steps} steps/epoch, epochs {args.epoch_seconds:g} s apart, quiet {quiet}, started {started}\n"
    )
    if peer_rows:
        print("| run | raw MB | zstd -3 | ZipNN | hexz | z4ai | z4ai delta chain | ZipNN XOR chain |")
        print("|---|---|---|---|---|---|---|---|")
        print("\n".join(peer_rows) + "\n")
    print(
        "| run | code | ckstore at rest (README loop, wait) | / smaller chain | after repack | "
        "checkout newest before `wait` MB/s per core | checkout newest MB/s per core | checkout 3 back MB/s per core | "
        "background of an epoch / save_file + fsync (CPU) | final `ckstore wait` CPU s | bit-exact | load |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(ck_rows))


if __name__ == "__main__":
    main()
