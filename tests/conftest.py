"""Fixtures shared by the core-store tests."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckstore.repo import Repo


@pytest.fixture
def repo(tmp_path: Path) -> Repo:
    """An empty on-disk repository with small chunks, so small test tensors span several chunks."""
    return Repo.init(tmp_path / "repo", chunk_size=4096)


@pytest.fixture(autouse=True)
def _reset_torch_determinism() -> Iterator[None]:
    """Lightning's ``deterministic=True`` switches torch's deterministic mode on process-wide; it
    would leak into later tests (torch.empty then fails for float4), so switch it back off."""
    yield
    torch = sys.modules.get("torch")
    if torch is not None and torch.are_deterministic_algorithms_enabled():
        torch.use_deterministic_algorithms(False)
