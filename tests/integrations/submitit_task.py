"""The submitit task of tests/integrations/test_submitit.py: a small training loop (dropout, AdamW, the
global RNG) that resumes from ckstore and saves through CkstoreCheckpointable's preemption.

It lives in an importable module so submitit pickles the class by reference; the job process
imports it from the checkout (PYTHONPATH)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

import ckstore
from ckstore.integrations.submitit import CkstoreCheckpointable


class Train(CkstoreCheckpointable):
    """Train ``steps`` steps; each attempt appends a line to ``progress`` (pid, start, resume commit)
    and rewrites ``step`` after every step, so the test knows where the job is."""

    def __call__(self, repo_path: str, steps: int, folder: str, sleep: float) -> dict[str, Any]:
        torch.set_num_threads(1)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        repo = ckstore.Repo.init(repo_path, exist_ok=True)
        start = 0
        state = self.resume_state(repo)
        if state is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            ckstore.set_rng_state(state["rng"])
            start = state["step"] + 1
        out = Path(folder)
        attempt = {"pid": os.getpid(), "start": start, "resume": self.resume}
        with open(out / "progress", "a") as f:
            f.write(json.dumps(attempt) + "\n")
        with self.preemption() as preempt:
            for step in range(start, steps):
                x = torch.randn(16, 8)
                loss = (model(x) - x.sum(dim=1, keepdim=True)).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                (out / "step").write_text(str(step))
                time.sleep(sleep)

                def snapshot(step: int = step) -> dict[str, Any]:
                    return {
                        "model": model.state_dict(),
                        "optimizer": opt.state_dict(),
                        "step": step,
                        "rng": ckstore.rng_state(),
                    }

                preempt.safe_point(repo, snapshot, metadata={"step": step})
        save_file(model.state_dict(), str(out / "final.safetensors"))
        return attempt
