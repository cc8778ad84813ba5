"""Training-like repositories for the remote tests: epochs whose model drifts, a frozen embedding,
an optimizer state that changes every epoch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file
from safetensors.torch import save_file as save_torch

from ckstore.repo import Repo

CHUNK = 64 << 10


def epoch_files(folder: Path, epoch: int, n: int = 256 << 10) -> Path:
    """A training checkpoint after ``epoch`` epochs: the model drifts a little each epoch (a
    fine-tune: most chunks change), the frozen embedding never does, the optimizer state does."""
    rng = np.random.default_rng(0)
    emb = rng.standard_normal(n, dtype=np.float32)
    w = rng.standard_normal(n, dtype=np.float32)
    step = np.random.default_rng(epoch)
    w[: n // 4] += 0.01 * epoch * step.standard_normal(n // 4, dtype=np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {"model.embed": emb, "model.w": w, "optim.m": step.standard_normal(n // 2, dtype=np.float32)},
        str(folder / "model.safetensors"),
        metadata={"epoch": str(epoch)},
    )
    (folder / "config.json").write_text(f'{{"epoch": {epoch}}}')
    return folder


def make_repo(path: Path, work: Path, epochs: range) -> tuple[Repo, list[str]]:
    repo = Repo.init(path, chunk_size=CHUNK)
    ids = [repo.commit(epoch_files(work / f"e{e}", e), message=f"epoch {e}") for e in epochs]
    repo.wait()  # the compaction after the last commit has made the older epochs deltas
    return repo, ids


def digests(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def pushed(tmp_path: Path, url: str, endpoint: str | None, epochs: range = range(1, 2)) -> tuple[Repo, list[str]]:
    """Repository ``a`` with ``epochs`` committed and pushed to ``url`` as remote "origin"."""
    repo, ids = make_repo(tmp_path / "a", tmp_path / "work", epochs)
    repo.add_remote("origin", url, endpoint)
    repo.push()
    return repo, ids


def assert_checks_out(repo: Repo, ref: str, out: Path, epoch_folder: Path) -> None:
    """``ref`` checks out byte-identical to the files committed from ``epoch_folder``."""
    repo.checkout(ref, out)
    assert digests(out) == digests(epoch_folder)


def adamw_fine_tune(root: Path, epochs: int, steps: int = 4) -> list[Path]:
    """Folders of a small real fine-tune, one an epoch: a two-layer MLP trained by torch's AdamW
    ``steps`` steps an epoch on a fixed regression task, each folder holding what a training
    script saves (the weights, AdamW's two moments per parameter), named per epoch."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 128))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    x, y = torch.randn(64, 128), torch.randn(64, 128)
    out = []
    for epoch in range(1, epochs + 1):
        for _ in range(steps):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        tensors = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
        for i, p in enumerate(model.parameters()):
            tensors[f"optim.{i}.exp_avg"] = opt.state[p]["exp_avg"].clone()
            tensors[f"optim.{i}.exp_avg_sq"] = opt.state[p]["exp_avg_sq"].clone()
        folder = root / f"epoch{epoch}"
        folder.mkdir(parents=True, exist_ok=True)
        save_torch(tensors, str(folder / f"epoch-{epoch}.safetensors"))
        out.append(folder)
    return out
