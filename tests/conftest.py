"""Fixtures shared by the core-store tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckstore.repo import Repo


@pytest.fixture
def repo(tmp_path: Path) -> Repo:
    """An empty on-disk repository with small chunks, so small test tensors span several chunks."""
    return Repo.init(tmp_path / "repo", chunk_size=4096)
