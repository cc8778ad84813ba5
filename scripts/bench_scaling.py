"""Benchmark: how each command's cost grows with history and with objects (issue 22 item 4).

Repositories of 10, 100, 1,000 small commits (one tiny file each, compaction off) and of
10^4..10^6 objects (one commit of that many tiny files). For each: ``log``, ``log -n 10``,
``show``, ``stats``, ``status``, ``fsck``, ``gc --dry-run``, ``gc``, ``status`` right after it,
``gc --repack`` and ``status`` again, then ``push`` of one new commit to a folder remote that
holds all the rest and ``fetch`` of that commit into a clone (``--commands`` picks some); each as a
subprocess (what a user waits for, start-up included) and in this process (no interpreter
start-up or imports: what the command itself costs). The load average is printed with every
row: on a shared machine only rows measured at a similar load compare.

The built repositories are kept under ``--work`` (``built-<case>``) and reused by the next run
with the same case, so a profile or a second measurement does not pay the build again (copying
10^5 object files would cost more than the commands): the commands run there, ``gc`` finds
nothing to delete after the first run, and each run adds the commits it pushes and fetches.

    python scripts/bench_scaling.py [--commits 10 100 1000] [--objects 10000 100000] [--work DIR]
        [--in-process-only] [--commands stats "gc --dry-run" ...]
        [--profile CASE COMMAND] [--sort tottime]   # cProfile one in-process command (e.g. 100000o push)

The remote and the clone are built only when push or fetch are measured.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ckstore import Repo

ROOT = Path(__file__).resolve().parent.parent
CKSTORE = [sys.executable, "-m", "ckstore.cli"]
# status right after stats: it shows the figures stats measured while nothing changed (a status
# with no measurement before it measures them itself, as stats; docs/design.md). "status after
# gc": gc leaves the figures current (maintenance/sizes_cache.py), so it shows them at once.
# Each entry: (label, arguments after --repo); push and fetch are special (see measure).
COMMANDS: tuple[tuple[str, str], ...] = (
    ("log", "log"),
    ("log -n 10", "log -n 10"),
    ("show", "show"),
    ("stats", "stats"),
    ("status", "status"),
    ("fsck", "fsck"),
    ("gc --dry-run", "gc --dry-run"),
    ("gc", "gc"),
    ("status after gc", "status"),
    ("gc --repack", "gc --repack"),
    ("status after gc --repack", "status"),
    ("push", "push origin"),
    ("fetch", "fetch origin"),
)
REMOTE_COMMANDS = ("push", "fetch")


def load() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def run_cli(args: list[str]) -> float:
    """Wall seconds of ``ckstore ARGS`` as a subprocess."""
    started = time.perf_counter()
    proc = subprocess.run([*CKSTORE, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"ckstore {' '.join(args)} failed ({proc.returncode}): {proc.stderr.decode().strip()}")
    return wall


# CPU seconds (user + system, every thread) of the last in-process command: on a shared machine
# wall time moves 2-3x with the load, CPU time much less.
LAST_CPU: list[float] = [0.0]


def run_in_process(args: list[str]) -> float:
    """Seconds of ``ckstore ARGS`` run in this process, output discarded (CPU in LAST_CPU)."""
    from ckstore.cli import main as cli_main

    gc.collect()  # the previous command's garbage is not this one's cost
    started, cpu = time.perf_counter(), time.process_time()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            cli_main.main(args, prog_name="ckstore", standalone_mode=False)
        except SystemExit as exc:
            if exc.code:
                raise
    LAST_CPU[0] = time.process_time() - cpu
    return time.perf_counter() - started


def tiny_commits(repo: Path, work: Path, count: int) -> None:
    r = Repo.init(repo)
    r.compact_after_commit = False
    folder = work / "small"
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (folder / "metrics.json").write_text(f'{{"step": {i}}}')
        r.commit(folder, message=f"step {i}", metadata={"loss": 1.0 / (i + 1)})
    shutil.rmtree(folder)


def many_objects(repo: Path, work: Path, count: int) -> None:
    """One commit of ``count`` tiny files, built in memory (what ``commit`` of a folder of them
    stores, without writing and deleting ``count`` files first: that was half the build)."""
    from ckstore.write.commit import commit_sources, prepare_commit
    from ckstore.write.ingest import MemoryFile

    r = Repo.init(repo)
    files = [
        MemoryFile(f"{i // 1000:04d}/{i:07d}.txt", None, (memoryview(f"object {i}\n".encode()),)) for i in range(count)
    ]
    request = prepare_commit(f"{count} objects", None, None).on_branch(r._ctx)
    commit_sources(r._ctx, files, request)
    r.wait()


def build(work: Path, case: str, remote: bool = True) -> tuple[Path, float]:
    """The built repository for ``case`` ("1000c", "100000o") and, with ``remote``, its remote
    and a clone, made once and kept; (folder holding repo/remote/clone, seconds the repository's
    build took, 0 when reused). The remote is made on first need: at 10^6 objects pushing every
    object took 864 s and cloning 2,104 s (load 9-14), which gc, fsck and stats do not need."""
    built = work / f"built-{case}"
    seconds = 0.0
    if not (built / "done").exists():
        shutil.rmtree(built, ignore_errors=True)
        built.mkdir(parents=True)
        n, kind = int(case[:-1]), case[-1]
        started = time.perf_counter()
        (tiny_commits if kind == "c" else many_objects)(built / "repo", built, n)
        seconds = time.perf_counter() - started
        (built / "done").write_text(f"{seconds:.1f}\n")
    if remote and not (built / "cloned").exists():
        shutil.rmtree(built / "remote", ignore_errors=True)
        shutil.rmtree(built / "clone", ignore_errors=True)
        repo = Repo(built / "repo")
        if "origin" not in repo.remotes():
            repo.add_remote("origin", str(built / "remote"))
        repo.push("origin")
        Repo.clone(str(built / "remote"), built / "clone")
        (built / "cloned").write_text("")
    return built, seconds


def add_commit(repo: Path, text: str) -> None:
    folder = repo.parent / "extra"
    folder.mkdir(exist_ok=True)
    (folder / "note.txt").write_text(text)
    r = Repo(repo)
    r.compact_after_commit = False
    r.commit(folder, message=text)


def measure(
    built: Path,
    commands: list[str],
    subprocesses: bool = True,
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """(subprocess seconds, in-process seconds, in-process CPU seconds) of each of ``commands``
    (labels of COMMANDS) on ``built``; with push, each of the two passes adds one commit there,
    pushes it and fetches it into the clone. ``subprocesses=False``: the in-process pass only
    (10^6 objects: each pass is long)."""
    sub: dict[str, float] = {"start": statistics.median(run_cli(["--version"]) for _ in range(3))}
    inside: dict[str, float] = {}
    cpu: dict[str, float] = {}
    passes = ((run_cli, sub), (run_in_process, inside)) if subprocesses else ((run_in_process, inside),)
    for timer, out in passes:
        for label, args in COMMANDS:
            if label not in commands:
                continue
            target = built / ("clone" if label == "fetch" else "repo")
            if label == "push":
                add_commit(built / "repo", f"one more ({timer.__name__}, {time.time()})")
            out[label] = timer(["--repo", str(target), *args.split()])
            if timer is run_in_process:
                cpu[label] = LAST_CPU[0]
    return sub, inside, cpu


def profile(work: Path, case: str, command: str, sort: str = "cumulative") -> None:
    import cProfile
    import pstats

    built, _ = build(work, case, remote=command in REMOTE_COMMANDS)
    if command in REMOTE_COMMANDS:
        add_commit(built / "repo", f"one more ({time.time()})")
        if command == "fetch":
            Repo(built / "repo").push("origin")
    target = built / ("clone" if command == "fetch" else "repo")
    args = ["--repo", str(target), *command.split()] + (["origin"] if command in REMOTE_COMMANDS else [])
    prof = cProfile.Profile()
    prof.enable()
    seconds = run_in_process(args)
    prof.disable()
    print(f"{case} {command}: {seconds:.2f} s, {LAST_CPU[0]:.2f} CPU s (load {load()})")
    pstats.Stats(prof).sort_stats(sort).print_stats(40)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commits", nargs="*", type=int, default=[10, 100, 1000])
    parser.add_argument("--objects", nargs="*", type=int, default=[10_000, 100_000])
    parser.add_argument("--work", default=str(ROOT / "bench-work" / "scaling"))
    parser.add_argument("--profile", nargs=2, metavar=("CASE", "COMMAND"))
    parser.add_argument("--in-process-only", action="store_true", help="skip the subprocess pass")
    parser.add_argument(
        "--commands",
        nargs="*",
        default=[label for label, _ in COMMANDS],
        help="labels of the commands to run, in their fixed order (default: all)",
    )
    parser.add_argument("--sort", default="cumulative", help="the profile's sort key (cumulative, tottime)")
    args = parser.parse_args()
    unknown = set(args.commands) - {label for label, _ in COMMANDS}
    if unknown:
        parser.error(f"unknown commands: {', '.join(sorted(unknown))}")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.profile:
        profile(work, *args.profile, sort=args.sort)
        return
    commands = [label for label, _ in COMMANDS if label in args.commands]
    lines = [
        "| repository | load (1 min) | start-up (`--version`) s | " + " | ".join(f"`{c}` s" for c in commands) + " |",
        "|---|---|---|" + "---|" * len(commands),
    ]
    print(lines[0] + "\n" + lines[1], flush=True)
    cases = [(f"{n}c", f"{n:,} commits") for n in args.commits] + [(f"{n}o", f"{n:,} objects") for n in args.objects]
    for case, label in cases:
        built, seconds = build(work, case, remote=any(c in REMOTE_COMMANDS for c in commands))
        took = f" (built in {seconds:.0f} s)" if seconds else ""
        before = os.getloadavg()[0]
        sub, inside, cpu = measure(built, commands, not args.in_process_only)
        during = f"{before:.1f}–{os.getloadavg()[0]:.1f}"
        if not args.in_process_only:
            lines.append(
                f"| {label}{took} | {during} | {sub['start']:.2f} | "
                + " | ".join(f"{sub[c]:.2f}" for c in commands)
                + " |"
            )
        lines.append(
            f"| {label}, in process{took if args.in_process_only else ''} | {during if args.in_process_only else ''} | – | "
            + " | ".join(f"{inside[c]:.2f}" for c in commands)
            + " |"
        )
        lines.append(f"| {label}, in process, CPU | | – | " + " | ".join(f"{cpu[c]:.2f}" for c in commands) + " |")
        print("\n".join(lines[-3 if not args.in_process_only else -2 :]), flush=True)
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
