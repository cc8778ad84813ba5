"""Shared test helpers: making safetensors checkpoints, hashing trees, damaging objects."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import Result
from safetensors.torch import save_file

from ckstore.format import manifest
from ckstore.repo import Repo
from ckstore.repository.store import object_key
from ckstore.write.commit import commit_sources, prepare_commit
from ckstore.write.ingest import MemoryFile

# One definition of the dtype table and tensor maker, shared with the safetensors format tests.
from tests.format.test_safetensors import TORCH_DTYPES, make_tensor  # noqa: F401  (re-exported)


def save_st(path: Path, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(dict(tensors), str(path), metadata=metadata)
    return path


def checkpoint(path: Path, seed: int, n: int = 4096) -> Path:
    """A small model+optimizer checkpoint; ``seed`` changes every tensor, so commits differ."""
    g = torch.Generator().manual_seed(seed)
    return save_st(
        path,
        {
            "model.w": torch.randn(n, generator=g),
            "model.b": torch.randn(64, generator=g),
            "optim.m": torch.randn(n, generator=g),
        },
        metadata={"epoch": str(seed)},
    )


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree_digest(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file below ``root`` (the byte-identity oracle)."""
    return {p.relative_to(root).as_posix(): sha256(p) for p in sorted(root.rglob("*")) if p.is_file()}


def object_file(repo: Repo, oid: str) -> Path:
    """The loose file of an object, for tests that damage or remove one: an object resting in a
    pack (small ones do, backend/local_settle.py) is spread loose first, with every other."""
    assert repo.path is not None
    path = repo.path / object_key(oid)
    packs = getattr(repo.backend, "packs", None)
    if not path.exists() and packs is not None and packs.locate(oid) is not None:
        from unittest.mock import patch

        from ckstore.backend import local_settle

        with patch.object(local_settle, "SMALL_OBJECT", 0):
            repo.backend.unpack()
    return path


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
        "model-00002-of-00002.safetensors": {
            "head.weight": torch.randn(16, 300, generator=g),
            "head.bias": torch.zeros(300, dtype=torch.bfloat16),
        },
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


def dcp_adamw_run(repo: Repo, steps: int, width: int = 192, seed: int = 0) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """Save ``steps`` consecutive AdamW steps of a small model with torch.distributed.checkpoint
    (one process) through ckstore's DCP Writer, compaction waited for after each; every commit
    with the tensors it saved, under their DCP names (as ``checkout`` writes them)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ckstore.dcp import Writer, saved_commit, wait_compaction

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, width))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for step in range(steps):
        model(torch.randn(8, width)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        msd, osd = get_state_dict(model, opt)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "single process": DCP without a process group
            meta = dcp.save({"model": msd, "optim": osd}, storage_writer=Writer(repo, message=f"step {step}"))
        wait_compaction()
        saved = {f"model.{k}": v.detach().clone() for k, v in msd.items()}
        for fqn, moments in osd["state"].items():
            saved.update(
                {
                    f"optim.state.{fqn}.{k}": v.detach().clone()
                    for k, v in moments.items()
                    if isinstance(v, torch.Tensor) and v.dim() > 0
                }
            )
        out.append((saved_commit(meta), saved))
    return out


def assert_reads_back(repo: Repo, runs: list[tuple[str, dict[str, torch.Tensor]]], out: Path) -> None:
    """Every commit of ``dcp_adamw_run`` checks out to exactly the tensors it saved."""
    from safetensors.torch import load_file

    for i, (commit, saved) in enumerate(runs):
        repo.checkout(commit, out / str(i))
        got = load_file(str(out / str(i) / "model.safetensors"))
        for name, tensor in saved.items():
            assert torch.equal(got[name], tensor) and got[name].dtype == tensor.dtype, (i, name)


def encodings(repo: Repo) -> dict[str, int]:
    """How many stored objects use each encoding, by name."""
    from collections import Counter

    from ckstore.codecs.objects import parse_header

    return dict(Counter(parse_header(repo.store.read_raw(o)).encoding.name for o in repo.store.iter_ids()))


def adam_like_epochs(root: Path, epochs: int, seed: int = 0) -> list[Path]:
    """Folders of epochs of a model whose fp32 and bf16 weights each move by about the same
    absolute amount per epoch (what an AdamW step does), so the move in units in the last place
    depends on the exponent: where a context-sorted delta is smaller than a plain one."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(3 * 65536) * 0.05
    out = []
    for e in range(epochs):
        w = w + 1e-4 * np.tanh(rng.standard_normal(w.size))
        folder = root / f"e{e}"
        save_st(
            folder / "model.safetensors",
            {
                "w32": torch.from_numpy(w.astype(np.float32)),
                "w16": torch.from_numpy(w[:65536].astype(np.float32)).to(torch.bfloat16),
            },
        )
        out.append(folder)
    return out


def commit_many_files(repo: Repo, count: int, changed: int | None = None) -> str:
    """A commit of ``count`` tiny files (a version-4 manifest from about 3,000, docs/format.md
    5.3), file number ``changed`` with other content."""
    files = [
        MemoryFile(
            f"{i // 100:03d}/{i:05d}.txt",
            None,
            (memoryview(f"object {i}{' changed' if i == changed else ''}\n".encode()),),
        )
        for i in range(count)
    ]
    oid = commit_sources(repo._ctx, files, prepare_commit("many files", None, None).on_branch(repo._ctx))
    repo.wait()
    return oid


@contextmanager
def counting_parsed_entries(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Count the file entries parsed whole (``manifest.parse_files``) while the block runs."""
    parsed = [0]
    parse_files = manifest.parse_files

    def counting(doc: list[object], version: int) -> object:
        parsed[0] += len(doc)
        return parse_files(doc, version)  # type: ignore[arg-type]

    monkeypatch.setattr(manifest, "parse_files", counting)
    try:
        yield parsed
    finally:
        monkeypatch.undo()


# The in-process CLI (tests/conftest.py's ``cli`` fixture): run(*args, code=expected exit code, repo=pass --repo).
Cli = Callable[..., Result]


def assert_one_line_error(stderr: str) -> None:
    assert stderr.startswith("ckstore: ") and stderr.count("\n") == 1, stderr
    assert "Traceback" not in stderr


def torchrun_script(script: Path, nproc: int, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``script`` under ``torchrun --standalone`` with ``nproc`` ranks on this machine."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(script),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env=env, check=False
    )  # generous: CI shares 2 cores
    if check and result.returncode != 0:
        raise AssertionError(f"torchrun failed:\n{result.stdout[-3000:]}\n{result.stderr[-12000:]}")
    return result
