"""How long `ckstore log` takes to start, against a bare interpreter (issue 10, point 8).

    python scripts/bench_startup.py [--runs 10] [--write-docs docs/benchmarks.md]

Builds a small repository (three commits of a 64 KiB safetensors file and a config), then runs,
interleaved so that load on the machine hits all alike, ``python -c pass``, ``python -c "import
numpy"`` (for scale) and ``python -m ckstore.cli log`` / ``show`` / ``branch`` as fresh processes,
and reports the median wall time of each. ``python -m ckstore.cli`` is what the ``ckstore``
console script runs, minus the launcher (a pyenv shim is a bash script and would add its own
start-up). Modules are read from cached bytecode, as in an installed package. Wall and CPU time
(user + system, from ``getrusage``) are both reported: on a busy machine wall time is mostly
waiting for a core. Target: ``ckstore log`` < 0.15 s above ``python -c pass``.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_env import installed_like_env  # noqa: E402
from bench_sections import write_section  # noqa: E402

from ckstore.repo import Repo  # noqa: E402

TARGET = 0.15


def make_repo(root: Path) -> Path:
    repo = Repo.init(root / "repo")
    rng = np.random.default_rng(0)
    for epoch in range(3):
        folder = root / f"epoch{epoch}"
        folder.mkdir()
        save_file({"w": rng.standard_normal(16384).astype(np.float32)}, str(folder / "model.safetensors"))
        (folder / "config.json").write_text('{"hidden": 16}')
        repo.commit(folder, message=f"epoch {epoch}", metadata={"epoch": epoch})
    return root / "repo"


def timed(argv: list[str], env: dict[str, str], cwd: str) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + system) of one run of ``argv``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    # Run outside any source tree: `python -m` puts the current folder first on sys.path.
    subprocess.run(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def import_seconds(argv: list[str], env: dict[str, str], cwd: str) -> float:
    """Seconds of imports of one run of ``argv``: ``-X importtime``'s self times, summed."""
    proc = subprocess.run(
        [argv[0], "-X", "importtime", *argv[1:]],
        env=env,
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        check=True,
    )
    total = 0
    for line in proc.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            self_us = line.split(":", 1)[1].split("|")[0].strip()
            if self_us.isdigit():  # skips the header line
                total += int(self_us)
    return total / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--write-docs", type=Path, metavar="BENCHMARKS_MD")
    parser.add_argument(
        "--baseline",
        type=Path,
        metavar="CHECKOUT",
        help="another ckstore source tree whose `ckstore log` is timed too (e.g. the code before a change)",
    )
    args = parser.parse_args()
    py = sys.executable
    here = str(Path(__file__).resolve().parents[1])  # this checkout's ckstore, whatever the current folder
    commands = {
        "python -c pass": ([py, "-c", "pass"], here),
        'python -c "import numpy"': ([py, "-c", "import numpy"], here),
        "ckstore log": ([py, "-m", "ckstore.cli", "log"], here),
        "ckstore log -n 1": ([py, "-m", "ckstore.cli", "log", "-n", "1"], here),
        "ckstore --help": ([py, "-m", "ckstore.cli", "--help"], here),
        "ckstore show": ([py, "-m", "ckstore.cli", "show"], here),
        "ckstore branch": ([py, "-m", "ckstore.cli", "branch"], here),
        "ckstore wait": ([py, "-m", "ckstore.cli", "wait"], here),
        "ckstore status": ([py, "-m", "ckstore.cli", "status"], here),
    }
    if args.baseline:
        for what in (["log", "-n", "1"], ["--help"], ["status"]):
            commands[f"ckstore {' '.join(what)}, baseline ({args.baseline.name})"] = (
                [py, "-m", "ckstore.cli", *what],
                str(args.baseline.resolve()),
            )
    with tempfile.TemporaryDirectory() as tmp:
        env = installed_like_env(Path(tmp, "pyc"), {**os.environ, "CKSTORE_REPO": str(make_repo(Path(tmp)))})
        envs = {name: {**env, "PYTHONPATH": path} for name, (_, path) in commands.items()}
        for name, (argv, _) in commands.items():  # warm the page cache and write the .pyc files
            timed(argv, envs[name], tmp)
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
        imports: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.runs):
            for name, (argv, _) in commands.items():
                times[name].append(timed(argv, envs[name], tmp))
                imports[name].append(import_seconds(argv, envs[name], tmp))
    wall = {name: statistics.median(w for w, _ in t) for name, t in times.items()}
    cpu = {name: statistics.median(c for _, c in t) for name, t in times.items()}
    imp = {name: statistics.median(t) for name, t in imports.items()}
    bare = "python -c pass"
    rows = [
        "| command | median wall s | above `python -c pass` | median CPU s | above `python -c pass` | "
        "imports s (`-X importtime`) | above `python -c pass` |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in commands:
        rows.append(
            f"| {name} | {wall[name]:.3f} | {wall[name] - wall[bare]:+.3f} | {cpu[name]:.3f} | "
            f"{cpu[name] - cpu[bare]:+.3f} | {imp[name]:.3f} | {imp[name] - imp[bare]:+.3f} |"
        )
    load = os.getloadavg()[0]
    verdicts = []
    for name in ("ckstore --help", "ckstore log -n 1", "ckstore status"):
        above_wall, above_cpu, above_imp = wall[name] - wall[bare], cpu[name] - cpu[bare], imp[name] - imp[bare]
        verdicts.append(
            f"`{name}` starts {above_wall:.3f} s (wall) / {above_cpu:.3f} s (CPU) / {above_imp:.3f} s "
            "(imports) above a bare interpreter "
            f"(target < {TARGET} s: {'met' if above_wall < TARGET else 'not met'} in wall time, "
            f"{'met' if above_cpu < TARGET else 'not met'} in CPU time)"
        )
    body = (
        f"Generated by `python scripts/bench_startup.py` ({platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, load average {load:.1f} while it ran): median of {args.runs} fresh "
        "processes each, run interleaved, on a three-commit repository. `ckstore X` is `python -m ckstore.cli X` "
        "(the console script's imports, without a launcher shim), reading cached bytecode as an installed "
        "package does. CPU time (user + system) is what the start costs; wall time adds waiting for a core, "
        "which on a busy machine dominates; imports are `python -X importtime`'s self times summed (wall time "
        "of the imports alone, in a separate run).\n\n" + "\n".join(rows) + "\n\n" + "; ".join(verdicts) + ". "
        "Commands that decode no chunk (log, show, branch, tag, stats, best, fsck without --read-data) import "
        "neither numpy nor torch; `--help` and usage errors load no repository code; `log`, `show` and `status` "
        "load none of the modules only writers use (thread pools, subprocess, sockets, pack ids); the group "
        "imports a command's module only when that command runs (tests/cli/test_startup.py checks all of these)."
    )
    print(body)
    if args.write_docs:
        write_section(args.write_docs, "Startup", body)


if __name__ == "__main__":
    main()
