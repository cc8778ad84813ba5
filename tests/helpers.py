"""Shared test helpers: making safetensors checkpoints, hashing trees, damaging objects."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from ckstore.repo import Repo
from ckstore.store import object_key
# One definition of the dtype table and tensor maker, shared with the safetensors format tests.
from test_safetensors_format import TORCH_DTYPES, make_tensor  # noqa: F401  (re-exported)


def save_st(path: Path, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(dict(tensors), str(path), metadata=metadata)
    return path


def checkpoint(path: Path, seed: int, n: int = 4096) -> Path:
    """A small model+optimizer checkpoint; ``seed`` changes every tensor, so commits differ."""
    g = torch.Generator().manual_seed(seed)
    return save_st(path, {
        "model.w": torch.randn(n, generator=g),
        "model.b": torch.randn(64, generator=g),
        "optim.m": torch.randn(n, generator=g),
    }, metadata={"epoch": str(seed)})


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree_digest(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file below ``root`` (the byte-identity oracle)."""
    return {p.relative_to(root).as_posix(): sha256(p) for p in sorted(root.rglob("*")) if p.is_file()}


def object_file(repo: Repo, oid: str) -> Path:
    assert repo.path is not None
    return repo.path / object_key(oid)


def flip_bit(path: Path, offset: int = -1, bit: int = 0) -> None:
    """Damage a file in place (offset counts from the end when negative)."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))


def object_count(repo: Repo) -> int:
    return sum(1 for _ in repo.store.iter_ids())


def leftover_temp_files(root: Path) -> list[Path]:
    """Checkout and backend temporaries that a failed operation must not leave behind."""
    return [p for p in root.rglob("*") if p.name.endswith((".ckstore-tmp", ".tmp"))]
