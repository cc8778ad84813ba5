"""What the compaction tests share: a small chunk size, a state that drifts a little each step
(a delta between steps pays), and how a commit's chunks are stored."""

from __future__ import annotations

from pathlib import Path

import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from ckstore import Repo
from ckstore.cli import main
from ckstore.codecs.objects import Encoding, parse_header

CHUNK = 4096


def encoding_of(repo: Repo, oid: str) -> Encoding:
    return parse_header(repo.store.read_raw(oid)).encoding


def tensor_chunks(repo: Repo, ref: str) -> list[str]:
    return [c.id for f in repo.read_commit(repo.resolve(ref)).files for t in f.tensors for c in t.chunks]


def step_state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g) * 0.05
    drift = torch.randn(64, 256, generator=torch.Generator().manual_seed(step + 1)) * 1e-5
    return {"w": w + drift * step, "frozen": torch.randn(4096, generator=g)}


def commit_epochs(repo: Path, scratch: Path, epochs: int) -> None:
    """A new repository at ``repo`` and ``epochs`` epoch-named checkpoint folders committed by
    the CLI (which detaches each commit's compaction)."""
    Repo.init(repo, chunk_size=CHUNK)
    for step in range(epochs):
        folder = scratch / f"epoch_{step}"
        folder.mkdir()
        save_file(step_state(step), str(folder / f"model_epoch_{step}.safetensors"))
        result = CliRunner().invoke(main, ["--repo", str(repo), "commit", str(folder)])
        assert result.exit_code == 0, result.output
