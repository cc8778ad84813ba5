"""Benchmark: the compaction of one DCP step, repeated on copies of one repository snapshot.

``bench_dcp.py`` measures the whole path (2 ranks, four writers); this script isolates the
compaction after a save so that code changes can be compared back to back on the same bytes. It
saves an MLP of ``--layers`` x Linear(``--width``) + AdamW (lr 1e-4, random batches, as
bench_dcp.py) with ``dcp.save`` to a ckstore repository in one process, ``--steps`` times, with
compaction after commits switched off; steps 1..N-1 are compacted as they would have been, step
N is left as its save stored it (fast). Each run copies that snapshot and compacts it once;
reported per run: CPU seconds of the process (every thread; user + system from ``getrusage``),
wall seconds, stored bytes after, and the save's wall time (``dcp.save``, then fsync of the
FileSystemWriter's folder for the same state: the reference the issue's bound is taken against).

    python scripts/bench_dcp_compaction.py [--layers 12] [--width 2048] [--runs 3] [--profile OUT]

``--profile OUT`` also writes a per-thread CPU profile (cProfile with ``time.thread_time`` in
every compaction thread, merged) of one more run to OUT (read it with ``python -m pstats``).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import resource
import shutil
import statistics
import threading
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def fsync_tree(path: Path) -> None:
    for f in sorted(path.rglob("*")):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def build(snapshot: Path, layers: int, width: int, steps: int) -> dict[str, float]:
    """The snapshot repository (steps 1..N-1 compacted, step N not) and the FS save's times."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import ckstore.dcp
    import ckstore.write.background as background
    from ckstore.repo import Repo

    init = background.BackgroundWork.__init__

    def no_compaction(self: background.BackgroundWork) -> None:
        init(self)
        self.compact_after_commit = False

    background.BackgroundWork.__init__ = no_compaction  # type: ignore[method-assign]
    shutil.rmtree(snapshot, ignore_errors=True)
    snapshot.mkdir(parents=True)
    Repo.init(snapshot / "repo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    saves = []
    for step in range(steps):
        model(torch.randn(16, width)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        msd, osd = get_state_dict(model, opt)  # optimizer state by parameter name, as bench_dcp.py
        sd = {"model": msd, "optim": osd}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fs = snapshot / "fs"
            shutil.rmtree(fs, ignore_errors=True)
            os.sync()
            started = time.perf_counter()
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(fs)))
            fsync_tree(fs)
            saves.append(time.perf_counter() - started)
            shutil.rmtree(fs)
            dcp.save(sd, storage_writer=ckstore.dcp.Writer(snapshot / "repo", message=f"step {step}"))
        if step < steps - 1:
            Repo(snapshot / "repo").compact()
    background.BackgroundWork.__init__ = init  # type: ignore[method-assign]
    info = {"save": statistics.median(saves), "saves": saves}
    (snapshot / "info.json").write_text(json.dumps(info))
    return info


class _ThreadProfiles:
    """cProfile in every thread started while active (thread CPU time), merged at the end."""

    def __init__(self) -> None:
        self.profiles: list[cProfile.Profile] = []
        self._original = threading.Thread.run

    def __enter__(self) -> _ThreadProfiles:
        profiles, original = self.profiles, self._original

        def run(thread: threading.Thread) -> None:
            p = cProfile.Profile(time.thread_time)
            profiles.append(p)
            p.runcall(original, thread)

        threading.Thread.run = run  # type: ignore[method-assign]
        main = cProfile.Profile(time.thread_time)
        self.profiles.append(main)
        main.enable()
        return self

    def __exit__(self, *exc: object) -> None:
        self.profiles[0].disable()
        threading.Thread.run = self._original  # type: ignore[method-assign]

    def save(self, out: Path) -> None:
        stats = pstats.Stats(self.profiles[0])
        for p in self.profiles[1:]:
            stats.add(p)
        stats.dump_stats(str(out))


def compact_once(snapshot: Path, work: Path, profile: Path | None = None) -> dict[str, float]:
    from ckstore.repo import Repo

    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(snapshot / "repo", work)
    os.sync()
    repo = Repo(work)
    before_stored = repo.stats().stored_bytes
    usage, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    if profile is not None:
        with _ThreadProfiles() as profiles:
            report = repo.compact()
        profiles.save(profile)
    else:
        report = repo.compact()
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    user, system = after.ru_utime - usage.ru_utime, after.ru_stime - usage.ru_stime
    stored = repo.stats().stored_bytes
    shutil.rmtree(work, ignore_errors=True)
    return {
        "cpu": user + system,
        "user": user,
        "sys": system,
        "wall": wall,
        "stored_before": before_stored,
        "stored": stored,
        "deltas": report.deltas,
        "predicted": report.predicted,
        "recompressed": report.recompressed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--work", default=str(ROOT / "bench-work" / "dcp-compaction"))
    parser.add_argument("--rebuild", action="store_true", help="save the snapshot again even if one exists")
    parser.add_argument("--profile", help="write a merged per-thread CPU profile of one more run here")
    args = parser.parse_args()
    work = Path(args.work)
    snapshot = work / f"snapshot-{args.layers}x{args.width}-{args.steps}"
    if args.rebuild or not (snapshot / "info.json").exists():
        build(snapshot, args.layers, args.width, args.steps)
    info = json.loads((snapshot / "info.json").read_text())
    print(f"load average at start {os.getloadavg()}", flush=True)
    rows = [compact_once(snapshot, work / "run") for _ in range(args.runs)]
    for r in rows:
        print(json.dumps({k: round(v, 3) for k, v in r.items()}), flush=True)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(
        f"step {args.steps} compaction: CPU {med['cpu']:.2f} s (user {med['user']:.2f} + sys {med['sys']:.2f}), "
        f"wall {med['wall']:.2f} s; FS save + fsync {info['save']:.2f} s -> {med['cpu'] / info['save']:.1f}x; "
        f"stored {med['stored_before'] / 1e6:.1f} -> {med['stored'] / 1e6:.1f} MB; "
        f"load average at end {os.getloadavg()}"
    )
    if args.profile:
        compact_once(snapshot, work / "run", Path(args.profile))
        pstats.Stats(args.profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
