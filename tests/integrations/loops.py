"""The plain training loop of preempted_loop.py run as a process, and how two of its final states
compare (shared by the preemption tests run directly and under Slurm)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckstore.repo import Repo

ROOT = Path(__file__).resolve().parents[2]
LOOP = Path(__file__).with_name("preempted_loop.py")
STEPS = 400


def run_loop(repo: Path, *extra: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, str(LOOP), str(repo), str(STEPS), "--sleep", "0.004", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith("ready"), proc.communicate()
    return proc


def final_state(repo: Path) -> dict[str, Any]:
    state = Repo(repo).load_state("main")
    assert isinstance(state, dict), type(state)  # the loop commits a dict
    assert state["step"] == STEPS - 1
    return state


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two nested states differ (tensors and arrays bit for bit, dtypes included)."""
    if isinstance(a, torch.Tensor):
        same = isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        same = isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return [f"{path}: keys"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}/{k}")]
    elif isinstance(a, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return [f"{path}: {type(a).__name__} of {len(a)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}/{i}")]
    else:
        same = type(a) is type(b) and a == b
    return [] if same else [path]
