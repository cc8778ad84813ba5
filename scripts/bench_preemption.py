"""Time from a scheduler's signal to a durable preemption commit (docs/benchmarks.md, "Preemption").

    python scripts/bench_preemption.py [--sizes 0.27 3] [--runs 3]

Each run is a real training process holding a state of the given size (fp32 weights + AdamW's
two moments, one third each), which has committed once already and has changed every tensor
since (as after a few steps): it gets SIGTERM mid-step and reports the time from the signal to
``commit_state`` returning (chunks and manifest synced, ref moved), plus the step it finished
first. Prints one line per size: median and range, with the machine's load.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import sys, time, torch, ckstore
from ckstore.integrations.preemption import Preemption
repo_path, nbytes = sys.argv[1], float(sys.argv[2])
torch.manual_seed(0)
n = int(nbytes / 4 / 3 / 16)  # 16 tensors per part
state = {part: {f"{part}.{i}": torch.randn(n) for i in range(16)} for part in ("model", "exp_avg", "exp_avg_sq")}
repo = ckstore.Repo.init(repo_path)
repo.commit_state(state, message="periodic")
repo.wait()
took = {}
def saved(oid):
    took["s"] = time.monotonic() - preempt.received_at
with Preemption(signals=("TERM",), on_saved=saved) as preempt:
    print("ready", flush=True)
    while True:
        for part in state.values():
            for t in part.values():
                t.mul_(0.999).add_(1e-4)   # one "step": every tensor changes
        try:
            preempt.safe_point(repo, state)
        except SystemExit:
            print(f"{took['s']:.3f}", file=sys.stderr, flush=True)
            raise
"""


def one_run(gigabytes: float, root: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(root / "repo"), str(gigabytes * 1e9)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    time.sleep(1.0)
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=900)
    if proc.returncode != 128 + signal.SIGTERM:
        raise SystemExit(f"child exited {proc.returncode}: {err}")
    return float(err.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.27, 3.0], help="state sizes in GB")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    for gigabytes in args.sizes:
        times = []
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
                times.append(one_run(gigabytes, Path(tmp)))
        load = os.getloadavg()[0]
        print(
            f"{gigabytes:g} GB: signal -> durable commit median {statistics.median(times):.2f} s "
            f"(range {min(times):.2f}-{max(times):.2f} s, {args.runs} runs; load {load:.1f})",
            flush=True,
        )


if __name__ == "__main__":
    main()
