#!/usr/bin/env python
"""Train a small model, commit the full training state to ckstore every epoch, resume bit-exact.

    python scripts/train_example.py --repo /tmp/ck --epochs 3             # epochs 1-3, one commit each
    python scripts/train_example.py --repo /tmp/ck --epochs 5 --resume    # continues with epochs 4-5

Each commit holds model, AdamW and LR-scheduler state, the epoch and the RNG states, and records
``epoch``, ``step`` and ``loss`` as metadata (so ``ckstore best loss`` and ``ckstore gc
--keep-best 2 --metric loss`` work). ``--resume`` starts from the newest commit of ``--branch``;
the run it produces is identical, bit for bit, to one that never stopped (``--print-digest``
prints a hash of the final weights to check that).
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

import ckstore
from ckstore.repo import Repo

STEPS_PER_EPOCH = 20


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.2), nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10 * STEPS_PER_EPOCH)
    return model, opt, sched


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    # Synthetic data drawn from the RNGs, as a shuffling data loader would: resume must restore them.
    x = torch.randn(32, 16)
    y = torch.sin(x[:, :1] * 3) + 0.1 * torch.from_numpy(np.random.standard_normal((32, 1))).float()
    return x, y


def train_epoch(model: nn.Module, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler) -> float:
    model.train()
    total = 0.0
    for _ in range(STEPS_PER_EPOCH):
        x, y = batch()
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        total += loss.item()
    return total / STEPS_PER_EPOCH


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", required=True, type=Path, help="ckstore repository (created if missing)")
    p.add_argument("--branch", default="main")
    p.add_argument("--epochs", type=int, default=3, help="train until this many epochs are done")
    p.add_argument("--resume", action="store_true", help="continue from the branch's newest commit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--print-digest", action="store_true", help="print sha256 of the final weights")
    args = p.parse_args(argv)

    repo = Repo(args.repo) if args.repo.exists() else Repo.init(args.repo)
    model, opt, sched = build(args.seed)
    start = 0
    if args.resume:
        state = repo.load_state(args.branch)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        ckstore.set_rng_state(state["rng"])
        start = state["epoch"]
        print(f"resumed from {repo.resolve(args.branch)[:12]} after epoch {start}", file=sys.stderr)
    else:
        random.seed(args.seed)
        np.random.seed(args.seed)

    for epoch in range(start + 1, args.epochs + 1):
        loss = train_epoch(model, opt, sched)
        oid = repo.commit_state(
            {
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(),
                "epoch": epoch,
                "rng": ckstore.rng_state(),
            },
            message=f"epoch {epoch}",
            branch=args.branch,
            metadata={"epoch": epoch, "step": epoch * STEPS_PER_EPOCH, "loss": loss},
        )
        print(f"epoch {epoch}: loss {loss:.6f}  commit {oid[:12]}", file=sys.stderr)
    if args.print_digest:
        print(digest(model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
