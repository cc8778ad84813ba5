"""A plain training loop that resumes from its repository and saves on preemption (run as a script
by tests/integrations/test_preemption.py and scripts/bench_preemption.py).

    python preempted_loop.py REPO STEPS [--width N] [--every K] [--signal TERM] [--sleep S]
                             [--slurm-requeue]

Prints ``ready START`` once its handler is installed, then trains; every K steps it makes a
background commit; a signal makes one commit at the end of the step in progress, puts the Slurm
job back in the queue when asked (``slurm_requeue``), and exits 128 + signal.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import numpy as np
import torch

import ckstore
from ckstore.integrations.preemption import Preemption, slurm_requeue


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("repo")
    parser.add_argument("steps", type=int)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--signal", default="TERM")
    parser.add_argument("--sleep", type=float, default=0.0, help="extra seconds per step")
    parser.add_argument("--slurm-requeue", action="store_true", help="requeue this Slurm job once saved")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    random.seed(0)  # every generator ckstore.rng_state() records starts the same in each run
    np.random.seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(args.width, args.width), torch.nn.Tanh(), torch.nn.Linear(args.width, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    repo = ckstore.Repo.init(args.repo, exist_ok=True)
    start = 0
    if repo.branches():
        state = repo.load_state("main")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        ckstore.set_rng_state(state["rng"])
        start = state["step"] + 1
    with Preemption(signals=(args.signal,), on_saved=slurm_requeue if args.slurm_requeue else None) as preempt:
        print("ready", start, flush=True)
        for step in range(start, args.steps):
            x = torch.randn(32, args.width)  # the global RNG: resuming must restore it too
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin()).backward()
            opt.step()
            if args.sleep:
                time.sleep(args.sleep)

            def state(step: int = step) -> dict[str, object]:
                return {
                    "model": model.state_dict(),
                    "optimizer": opt.state_dict(),
                    "step": step,
                    "rng": ckstore.rng_state(),
                }

            preempt.safe_point(repo, state, metadata={"step": step})
            if (step + 1) % args.every == 0:
                repo.commit_state(state(), message=f"step {step}", metadata={"step": step}, background=True)
        if start < args.steps:
            repo.commit_state(state(), message="done", metadata={"step": args.steps - 1})
    repo.wait()
    print("finished", file=sys.stderr)


if __name__ == "__main__":
    main()
