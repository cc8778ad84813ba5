"""fsck: a clean repository passes; each kind of damage is reported, naming what is damaged."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ckstore.codecs.objects import Encoding, parse_header
from ckstore.repo import Repo
from tests.helpers import checkpoint, flip_bit, object_file, save_st


@pytest.fixture
def damaged(repo: Repo, tmp_path: Path) -> tuple[Repo, str]:
    """A repository with two commits: a zeros tensor (zstd chunks) and a noise blob (raw chunks)."""
    src = tmp_path / "src"
    save_st(src / "m.safetensors", {"zeros": torch.zeros(3000), "noise": torch.randn(100)})
    (src / "noise.bin").write_bytes(os.urandom(5000))
    repo.commit(checkpoint(tmp_path / "first.safetensors", 0))
    oid = repo.commit(src)
    repo.wait()  # compaction re-encodes the objects this test then damages
    return repo, oid


def chunk_of(repo: Repo, oid: str, path: str, tensor: str | None = None) -> str:
    f = next(f for f in repo.read_commit(oid).files if f.path == path)
    chunks = next(t.chunks for t in f.tensors if t.name == tensor) if tensor else f.chunks
    return chunks[0].id


def test_clean(damaged: tuple[Repo, str]) -> None:
    repo, _ = damaged
    assert repo.fsck() == [] and repo.fsck(read_data=True) == []


def test_missing_object(damaged: tuple[Repo, str]) -> None:
    repo, oid = damaged
    chunk = chunk_of(repo, oid, "m.safetensors", "zeros")
    object_file(repo, chunk).unlink()
    problems = repo.fsck()
    assert len(problems) == 1
    assert chunk in problems[0] and "missing" in problems[0]
    assert "'m.safetensors'" in problems[0] and "'zeros'" in problems[0]


@pytest.mark.parametrize(
    "path, tensor, encoding",
    [
        # A commit stores float chunks with plain zstd; compaction keeps that for zeros (byte
        # grouping is not smaller there).
        ("m.safetensors", "zeros", Encoding.ZSTD),
        ("noise.bin", None, Encoding.RAW),
    ],
)
def test_bit_flip_needs_read_data(damaged: tuple[Repo, str], path: str, tensor: str | None, encoding: Encoding) -> None:
    repo, oid = damaged
    chunk = chunk_of(repo, oid, path, tensor)
    file = object_file(repo, chunk)
    assert parse_header(file.read_bytes()).encoding == encoding
    flip_bit(file, -2)
    assert repo.fsck() == []  # existence checks cannot see it
    problems = repo.fsck(read_data=True)
    assert len(problems) == 1 and chunk in problems[0] and repr(path) in problems[0]
    if tensor:
        assert repr(tensor) in problems[0]


def test_corrupt_ref(damaged: tuple[Repo, str]) -> None:
    repo, _ = damaged
    assert repo.path is not None
    (repo.path / "refs" / "heads" / "main").write_text("not a commit\n")
    problems = repo.fsck()
    assert any("refs/heads/main" in p and "corrupt" in p for p in problems)


def test_corrupt_manifest(damaged: tuple[Repo, str]) -> None:
    repo, oid = damaged
    flip_bit(object_file(repo, oid), -5)
    problems = Repo(repo.path).fsck()  # a fresh Repo: no cached manifest
    assert len(problems) == 1 and oid in problems[0] and "refs/heads/main" in problems[0]


def test_missing_parent_and_dangling_tag(damaged: tuple[Repo, str]) -> None:
    repo, oid = damaged
    parent = repo.read_commit(oid).parents[0]
    repo.create_tag("t", parent)
    object_file(repo, parent).unlink()
    problems = Repo(repo.path).fsck()
    assert problems and all(parent in p for p in problems)


def test_unreferenced_corrupt_object_found_by_read_data(damaged: tuple[Repo, str]) -> None:
    repo, _ = damaged
    stray = repo.store.put_chunk(os.urandom(3000)).id
    flip_bit(object_file(repo, stray), 100)
    assert repo.fsck() == []
    problems = repo.fsck(read_data=True)
    assert len(problems) == 1 and stray in problems[0]
