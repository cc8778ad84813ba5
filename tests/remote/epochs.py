"""Training-like repositories for the remote tests: epochs whose model drifts, a frozen embedding,
an optimizer state that changes every epoch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

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
