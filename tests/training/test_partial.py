"""Partial reads: repo.open(ref) reads only the chunks a tensor or row range needs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ckstore.errors import IntegrityError, InvalidInputError, TensorNotFoundError
from ckstore.repo import Repo
from tests.helpers import flip_bit, object_file, save_st

CHUNK = 4096  # the repo fixture's chunk size


@pytest.fixture
def model(repo: Repo, tmp_path: Path) -> tuple[Repo, str, Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "big": torch.randn(1000, 256, generator=g),  # 1 MB: 250 chunks
        "bf16": torch.randn(37, 5, generator=g).to(torch.bfloat16),
        "flags": torch.rand(20, 3, generator=g) > 0.5,
        "vec": torch.arange(10, dtype=torch.int64),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
    }
    path = save_st(tmp_path / "src" / "model.safetensors", tensors)
    return repo, repo.commit(tmp_path / "src"), path, tensors


def chunks_spanning(lo: int, hi: int) -> int:
    """Bytes of the CHUNK-sized chunks that overlap [lo, hi), computed independently."""
    return (((hi - 1) // CHUNK) - lo // CHUNK + 1) * CHUNK if hi > lo else 0


def test_slice_reads_only_the_needed_chunks(model: tuple[Repo, str, Path, dict[str, torch.Tensor]]) -> None:
    repo, cid, _, tensors = model
    lazy = repo.open(cid)
    assert lazy.bytes_read == 0  # opening reads the manifest only
    row = 256 * 4
    for a, b in [(10, 20), (0, 1), (999, 1000), (3, 4), (500, 900)]:
        before = lazy.bytes_read
        got = lazy.get_slice("big")[a:b]
        assert torch.equal(got, tensors["big"][a:b])
        assert lazy.bytes_read - before == chunks_spanning(a * row, b * row)
    before = lazy.bytes_read
    assert torch.equal(lazy.get_slice("big")[7], tensors["big"][7])
    assert lazy.bytes_read - before == CHUNK  # row 7 lies inside one chunk
    before = lazy.bytes_read
    assert torch.equal(lazy["big"], tensors["big"])
    assert lazy.bytes_read - before == tensors["big"].nbytes


def test_slices_match_safe_open(model: tuple[Repo, str, Path, dict[str, torch.Tensor]]) -> None:
    repo, cid, path, tensors = model
    lazy = repo.open(cid)
    keys: list[Any] = [
        slice(2, 9),
        slice(None),
        slice(-3, None),
        slice(None, None, 3),
        slice(5, 2),
        4,
        -1,
        (slice(1, 6), slice(0, 2)),
        (slice(None), 1),
        Ellipsis,
        (Ellipsis, 0),
        (slice(2, 10, 2), 0),
    ]
    with safe_open(path, "pt") as ref:
        assert sorted(lazy.keys()) == sorted(ref.keys()) and len(lazy) == len(tensors)
        for name in ("big", "bf16", "flags"):
            s = lazy.get_slice(name)
            assert s.get_shape() == ref.get_slice(name).get_shape() and s.get_dtype() == ref.get_slice(name).get_dtype()
            for key in keys:
                assert torch.equal(s[key], ref.get_slice(name)[key]), (name, key)
        for name in tensors:
            assert torch.equal(lazy.get_tensor(name), ref.get_tensor(name))
    assert torch.equal(lazy.get_slice("vec")[3:6], torch.tensor([3, 4, 5]))
    assert lazy.get_slice("empty")[0:0].shape == (0, 4)
    assert lazy.get_slice("scalar")[()] == 3.5
    with pytest.raises(IndexError):
        lazy.get_slice("vec")[10]


def test_mapping_behaviour(model: tuple[Repo, str, Path, dict[str, torch.Tensor]]) -> None:
    repo, cid, _, _ = model
    with repo.open(cid) as lazy:
        assert "big" in lazy and "nope" not in lazy and lazy.bytes_read == 0
        with pytest.raises(KeyError):
            lazy["nope"]
        with pytest.raises(TensorNotFoundError):
            lazy.get_slice("nope")
    with pytest.raises(TensorNotFoundError):
        repo.open(cid, path="other.safetensors")
    with pytest.raises(InvalidInputError):
        repo.open(cid, framework="jax")


def test_numpy_framework(model: tuple[Repo, str, Path, dict[str, torch.Tensor]]) -> None:
    repo, cid, _, tensors = model
    lazy = repo.open(cid, framework="np")
    got = lazy.get_slice("big")[100:110]
    assert isinstance(got, np.ndarray) and np.array_equal(got, tensors["big"][100:110].numpy())
    assert np.array_equal(lazy.get_slice("big")[20:10:-3], tensors["big"].numpy()[20:10:-3])
    assert np.array_equal(lazy["flags"], tensors["flags"].numpy())
    with pytest.raises(InvalidInputError, match="numpy has no dtype"):
        lazy["bf16"]


def test_corruption_is_detected_only_where_read(model: tuple[Repo, str, Path, dict[str, torch.Tensor]]) -> None:
    repo, cid, _, tensors = model
    big = next(t for f in repo.show(cid)[1].files for t in f.tensors if t.name == "big")
    flip_bit(object_file(repo, big.chunks[100].id))
    lazy = repo.open(cid)
    assert torch.equal(lazy.get_slice("big")[0:50], tensors["big"][0:50])  # chunks 0-12: intact
    with pytest.raises(IntegrityError):
        lazy.get_slice("big")[400:401]  # bytes 409600.. lie in chunk 100


def test_training_state_commit(repo: Repo) -> None:
    state = {
        "w": torch.randn(300, 20),
        "z": torch.randn(50, 3, dtype=torch.complex128),
        "step": 12,
        "opt": {"state": {0: {"m": torch.ones(40, 2)}}},
    }
    cid = repo.commit_state(state)
    lazy = repo.open(cid)
    assert len(lazy) == 3
    assert torch.equal(lazy.get_slice("w")[250:260], state["w"][250:260])
    z = lazy.get_slice("z")
    assert z.get_shape() == [50, 3] and z.get_dtype() == "complex128"  # raw bytes, real dtype from state.json
    assert torch.equal(z[10:12], state["z"][10:12])
    assert torch.equal(lazy.get_tensor("z"), state["z"])
    [m_name] = [k for k in lazy if k not in ("w", "z")]
    assert torch.equal(lazy[m_name], torch.ones(40, 2))
    np_z = repo.open(cid, framework="np").get_slice("z")[3]
    assert np.array_equal(np_z, state["z"][3].numpy())


def test_same_name_in_two_files_needs_path(repo: Repo, tmp_path: Path) -> None:
    save_st(tmp_path / "src" / "a.safetensors", {"w": torch.ones(2)})
    save_st(tmp_path / "src" / "b.safetensors", {"w": torch.zeros(2)})
    cid = repo.commit(tmp_path / "src")
    with pytest.raises(InvalidInputError, match="path="):
        repo.open(cid)
    assert torch.equal(repo.open(cid, path="b.safetensors")["w"], torch.zeros(2))


def test_overlay_reads_through_its_base_repository(tmp_path: Path) -> None:
    base = Repo.init(tmp_path / "base", chunk_size=CHUNK)
    g = torch.Generator().manual_seed(1)
    tensors = {"frozen": torch.randn(500, 64, generator=g), "head": torch.randn(10, 64, generator=g)}
    save_st(tmp_path / "v1" / "model.safetensors", tensors)
    base.commit(tmp_path / "v1")
    tuned = {**tensors, "head": tensors["head"] + 1}
    save_st(tmp_path / "v2" / "model.safetensors", tuned)
    overlay = Repo.init(tmp_path / "overlay", chunk_size=CHUNK)
    cid = overlay.commit(tmp_path / "v2", base="HEAD", base_repo=tmp_path / "base")
    lazy = Repo(tmp_path / "overlay").open(cid)
    assert torch.equal(lazy.get_slice("frozen")[100:104], tensors["frozen"][100:104])  # chunks of the base repo
    assert lazy.bytes_read == CHUNK
    assert torch.equal(lazy["head"], tuned["head"])
    Repo(tmp_path / "overlay").checkout(cid, tmp_path / "out", shard_size=100_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {
        "frozen": "model-00001-of-00002.safetensors",
        "head": "model-00002-of-00002.safetensors",
    }
    for name, shard in index["weight_map"].items():
        assert torch.equal(load_file(tmp_path / "out" / shard)[name], tuned[name])
