"""Checkout of the newest commit, its tip settled (``ckstore wait``) against as its commit left it.

    python scripts/bench_tip_checkout.py [--work DIR] [--steps 60] [--runs fp32_full bf16]
        [--reps 7] [--code TREE ...] [--stages]

For each run of scripts/bench_data.py (real all-MiniLM-L6-v2 fine-tunes + AdamW, four epochs),
the README loop through the ``ckstore`` command with this tree's code: a ``ckstore commit`` per
epoch of a folder of files named for the epoch, its detached compaction finished before the next
epoch. The repository is then copied (the tip as its commit left it: fast zstd or raw, the parent
made deltas of it) and ``ckstore wait`` settles the original's tip (its best whole encodings).

Timed: ``ckstore checkout HEAD`` of each form, in a process of its own with the bytecode cached
as an installed package's is (bench_env.py), each run after an ``os.sync()`` into an emptied
folder; wall and CPU seconds (all threads) of the command, medians of ``--reps``, the two forms
alternating so that a change of the machine's load falls on both; each ``--code`` tree reads both
repositories (the stored form does not depend on which tree reads it), the trees interleaved with
the forms (each round runs every tree on every form), so that the trees compare as fairly as the
forms: each tree's settled checkout is also given against the first tree's committed one. Each
tree's first checkout of each form is compared byte for byte with the epoch's files. Printed as a markdown table with the ratios settled
/ committed, the stored bytes of both repositories and the 1-minute load beside the times.

``--stages``: where the time of the settled and the committed checkout goes, one thread in this
process over the tip's chunks: reading the stored bytes, decoding them (split for byte-grouped
chunks into their zstd frames and the join of the planes), the blake3 verification and the
write to a file (pwrite at the chunk's offset, page cache).
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
from collections import Counter
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from bench_at_rest import FILES, _compaction_done, _same_files, _stored  # noqa: E402
from bench_data import RUNS, ensure_checkpoints  # noqa: E402
from bench_env import installed_like_env  # noqa: E402

CLOCK = time.thread_time  # stages: CPU of this thread, so that a loaded machine inflates nothing


def _command(code: Path, env: dict[str, str], args: list[str], cwd: Path) -> tuple[float, float]:
    """Wall and CPU seconds (every thread) of ``ckstore ARGS`` with ``code`` on PYTHONPATH."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", "from ckstore.cli import run; run()", *args],
        cwd=cwd,
        env={**env, "PYTHONPATH": str(code)},
        capture_output=True,
    )
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"ckstore {' '.join(args)} failed: {proc.stderr.decode().strip()}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def readme_loop(code: Path, env: dict[str, str], dirs: list[Path], root: Path) -> Path:
    """The repository after the README loop, every epoch's compaction done, not yet waited for."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    repo = root / "repo"
    _command(code, env, ["init", str(repo)], root)
    for n, d in enumerate(dirs, 1):
        folder = root / f"epoch_{n}"
        folder.mkdir()
        for f in FILES:
            shutil.copyfile(d / f, folder / f.replace(".safetensors", f"_epoch_{n}.safetensors"))
        _command(code, env, ["--repo", str(repo), "commit", str(folder), "-m", f"epoch {n}"], root)
        _compaction_done(repo)
        shutil.rmtree(folder)
    return repo


def tip_encodings(repo: Path) -> tuple[Counter[str], int]:
    """How many of the tip's chunks are stored in each encoding, and their stored bytes."""
    from ckstore import Repo
    from ckstore.codecs.objects import parse_header

    opened = Repo(repo)
    tip = opened.read_commit(opened.resolve("HEAD"))
    counts: Counter[str] = Counter()
    stored = 0
    for oid in dict.fromkeys(c.id for c in tip.all_chunks()):
        data = opened.store.read_local(oid)
        assert data is not None
        counts[parse_header(data).encoding.name.lower()] += 1
        stored += len(data)
    return counts, stored


def timed_checkouts(
    codes: list[Path], env: dict[str, str], repos: dict[str, Path], out: Path, reps: int, check: Callable[[], bool]
) -> dict[tuple[Path, str], tuple[float, float, bool]]:
    """Median (wall, CPU) seconds of ``ckstore checkout HEAD`` of each repository by each tree,
    and whether its first checkout wrote the epoch's bytes (``check``). Every (tree, repository)
    pair runs once per round, the order reversed every other round: a change of the machine's
    load falls on all of them, so that the trees compare as fairly as the two forms."""
    pairs = [(code, name) for code in codes for name in repos]
    walls: dict[tuple[Path, str], list[float]] = {pair: [] for pair in pairs}
    cpus: dict[tuple[Path, str], list[float]] = {pair: [] for pair in pairs}
    exact: dict[tuple[Path, str], bool] = {}
    for rep in range(reps):
        for code, name in pairs if rep % 2 == 0 else pairs[::-1]:
            shutil.rmtree(out, ignore_errors=True)
            os.sync()
            wall, cpu = _command(
                code, env, ["--repo", str(repos[name]), "checkout", "HEAD", "-o", str(out)], out.parent
            )
            walls[code, name].append(wall)
            cpus[code, name].append(cpu)
            if rep == 0:
                exact[code, name] = check()
    return {p: (statistics.median(walls[p]), statistics.median(cpus[p]), exact[p]) for p in pairs}


def stages(repo: Path, scratch: Path) -> dict[str, float]:
    """Seconds of each stage of reading the tip's chunks, one thread (module docstring)."""
    import numpy as np

    from ckstore import Repo
    from ckstore.codecs import planes
    from ckstore.codecs.objects import HEADER_SIZE, Encoding, Kind, decode_view, parse_header
    from ckstore.format.ids import chunk_id

    opened = Repo(repo)
    tip = opened.read_commit(opened.resolve("HEAD"))
    spent: Counter[str] = Counter()
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    offset = 0
    try:
        for ref in tip.all_chunks():
            started = CLOCK()
            data = opened.store.read_local(ref.id)
            assert data is not None
            spent["read stored bytes"] += CLOCK() - started
            header = parse_header(data)
            out = np.empty(ref.size, np.uint8)
            out[:] = 0  # faulted in beforehand: checkout reuses its decode buffers
            started = CLOCK()
            if header.encoding == Encoding.GROUPED:
                body = memoryview(data)[HEADER_SIZE:]
                width, entries = planes.plane_table(body, ref.size)
                n = ref.size // width
                got = [planes.decode_plane(i, mode, frame, n) for i, (mode, frame) in enumerate(entries)]
                spent["grouped: zstd frames"] += CLOCK() - started
                started = CLOCK()
                raw: bytes | memoryview = planes.decode_grouped(body, ref.size, out).data
                spent["grouped: decode whole (frames + join)"] += CLOCK() - started
                del got
            else:
                raw = decode_view(data, Kind.CHUNK, ref.size, ref.size, None, out)  # the tip is whole
                spent[f"decode {header.encoding.name.lower()}"] += CLOCK() - started
            started = CLOCK()
            assert chunk_id(raw) == ref.id
            spent["blake3 verification"] += CLOCK() - started
            started = CLOCK()
            os.pwrite(fd, raw, offset)
            spent["pwrite"] += CLOCK() - started
            offset += ref.size
    finally:
        os.close(fd)
        os.unlink(scratch)
    if spent["grouped: decode whole (frames + join)"]:
        spent["grouped: join (whole - frames)"] = (
            spent["grouped: decode whole (frames + join)"] - spent["grouped: zstd frames"]
        )
    return dict(spent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default=str(ROOT / "bench-work"))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=["fp32_full", "bf16"])
    parser.add_argument("--code", nargs="+", default=[str(ROOT)], help="ckstore source trees that check out")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--stages", action="store_true", help="also time each stage in this process")
    args = parser.parse_args()
    work = Path(args.work)
    data = ensure_checkpoints(work / "checkpoints", steps=args.steps, runs=tuple(args.runs))
    env = installed_like_env(work / "pycache")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows, stage_rows, across = [], [], []
    for run in args.runs:
        dirs = data[run]
        root = work / "tip-checkout" / run
        repo = readme_loop(ROOT, env, dirs, root)
        committed = root / "committed"
        shutil.copytree(repo, committed, symlinks=True)
        _command(ROOT, env, ["--repo", str(repo), "wait"], root)
        repos = {"committed": committed, "settled": repo}
        size = sum((dirs[-1] / f).stat().st_size for f in FILES)
        forms = {name: tip_encodings(path) for name, path in repos.items()}
        stored = {name: _stored(ROOT, path) for name, path in repos.items()}
        for name, (counts, tip_bytes) in forms.items():
            print(
                f"{run} {name}: tip {tip_bytes:,} B stored ({dict(counts)}), repository {stored[name]:,} B", flush=True
            )
        load = os.getloadavg()[0]
        codes = [Path(code) for code in args.code]
        times = timed_checkouts(
            codes, env, repos, root / "out", args.reps, lambda: _same_files(root / "out", dirs[-1], len(dirs))
        )
        for code in codes:
            (cw, cc, c_exact), (sw, sc, s_exact) = times[code, "committed"], times[code, "settled"]
            rows.append(
                f"| {run} | {code.name} | {size / 1e6:.0f} | {forms['committed'][1] / size:.3f} | "
                f"{forms['settled'][1] / size:.3f} | {stored['settled'] / stored['committed']:.4f} | "
                f"{cw * 1e3:.0f} | {sw * 1e3:.0f} | **{sw / cw:.3f}** | {cc * 1e3:.0f} | {sc * 1e3:.0f} | "
                f"**{sc / cc:.3f}** | {'yes' if c_exact and s_exact else 'NO'} | {load:.1f}–{os.getloadavg()[0]:.1f} |"
            )
            print(rows[-1], flush=True)
        first_wall, first_cpu, _ = times[codes[0], "committed"]
        for code in codes:
            sw, sc, _ = times[code, "settled"]
            across.append(
                f"| {run} | {code.name} settled / {codes[0].name} committed | {sw / first_wall:.3f} | {sc / first_cpu:.3f} |"
            )
            print(across[-1], flush=True)
        if args.stages:
            for name, path in repos.items():
                spent = stages(path, root / "stage.bin")
                stage_rows.append(
                    f"| {run} | {name} | " + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in sorted(spent.items())) + " |"
                )
                print(stage_rows[-1], flush=True)
        shutil.rmtree(root)
    print(f"\nbench_tip_checkout.py, {args.steps} steps/epoch, {args.reps} runs each, started {started}\n")
    print(
        "| run | code | MB checked out | tip stored / raw, committed | settled | repository stored, settled / "
        "committed | wall ms, committed | settled | settled / committed | CPU ms, committed | settled | "
        "settled / committed | bit-exact | load |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print("\n| run | trees | wall ratio | CPU ratio |\n|---|---|---|---|")
    print("\n".join(across))
    if stage_rows:
        print("\n| run | tip | ms per stage, one thread |\n|---|---|---|")
        print("\n".join(stage_rows))


if __name__ == "__main__":
    main()
