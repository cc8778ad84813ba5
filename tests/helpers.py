"""Shared test helpers: making safetensors checkpoints, hashing trees, damaging objects."""

from __future__ import annotations

import hashlib
import json
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


def hf_folder(root: Path, seed: int = 0) -> Path:
    """A Hugging Face style model folder: two shards, their index, config and tokenizer files."""
    g = torch.Generator().manual_seed(seed)
    shards = {
        "model-00001-of-00002.safetensors": {"embed.weight": torch.randn(256, 16, generator=g)},
        "model-00002-of-00002.safetensors": {"head.weight": torch.randn(16, 300, generator=g),
                                             "head.bias": torch.zeros(300, dtype=torch.bfloat16)},
    }
    weight_map = {}
    for name, tensors in shards.items():
        save_st(root / name, tensors, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (root / "config.json").write_text(json.dumps({"hidden_size": 16, "seed": seed}))
    (root / "tokenizer.json").write_text(json.dumps({"vocab": {f"t{i}": i for i in range(500)}}))
    (root / "tokenizer_config.json").write_text("{}")
    (root / "special_tokens_map.json").write_text("")  # an empty file is a file too
    save_st(root / "2_Dense" / "model.safetensors", {"linear.weight": torch.randn(8, 8, generator=g)})
    (root / "2_Dense" / "config.json").write_text('{"in": 8}')
    return root
