"""Choosing what a checkout writes: the commit's files as committed (optionally only some
tensors), Hugging Face shards, or the base model with a LoRA adapter merged in; and exporting
exactly a commit's model as a folder ``from_pretrained`` loads (``plan_export``).

An export writes three things and nothing else:

* the model's tensors, as ``model.safetensors`` (or shards with an index, with a shard size),
  metadata ``{"format": "pt"}`` unless the committed model file says otherwise. In a commit of
  files they are the tensors of the top-level ``model.safetensors`` / ``model-*-of-*.safetensors``
  files (or the files the caller names); in a training-state commit (``commit_state``) the
  tensors under one key of the state, ``model`` unless told otherwise, found by their key paths in
  the state document, so tied weights (stored once) come out under every key the model had.
* the names without the prefix: ``model.encoder.weight`` -> ``encoder.weight``.
* every other file of the commit (or of the commit the caller names, e.g. the base model's): the
  config, tokenizer and module folders, minus what belongs to training: top-level safetensors
  files (optimizer state, the old model files) and their index, the training state's files, and
  top-level pickles (``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``, ``training_args.bin``).
  An overlay's manifest already lists its base's files, so a state committed on a base model
  exports with the base's config and tokenizer.

A model file that is exported whole and unrenamed is written byte-identical to the committed one.
A commit holding a PEFT LoRA adapter (an adapter overlay on a base model) exports its model as the
base with the adapter merged, as ``checkout --merge-lora`` writes it (lora.py), without the
adapter's files: a folder holding ``adapter_config.json`` is loaded by transformers as an adapter
whose base it must find by ``base_model_name_or_path``, which rarely resolves elsewhere.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ckstore.errors import IntegrityError, InvalidInputError, TensorNotFoundError
from ckstore.format.manifest import Commit, FileEntry, TensorEntry
from ckstore.format.values import JSONValue, decode_value
from ckstore.read.checkout import Output, full_output, plan_outputs
from ckstore.read.shards import SINGLE_NAME, gather_tensors, parse_size, plan_model_files, plan_shards
from ckstore.repository.filedata import header_metadata, state_document
from ckstore.repository.store import ObjectStore

# Consolidating a distributed checkpoint and merging a LoRA adapter are imported by the plans
# that need them: a plain checkout does without either (start-up: scripts/bench_startup.py).

MODEL_FILES = ("model.safetensors", "model-[0-9][0-9][0-9][0-9][0-9]-of-[0-9][0-9][0-9][0-9][0-9].safetensors")
STATE_MODEL_KEY = "model"
# What training writes beside a model (Trainer: optimizer.pt, scheduler.pt, rng_state.pth,
# training_args.bin); the weights themselves are exported from the safetensors tensors.
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".pkl", ".pickle")
HF_FORMATS = ("pt", "tf", "flax", "mlx")  # the "format" values from_pretrained accepts


def plan_checkout(
    store: ObjectStore,
    commit: Commit,
    only: Sequence[str] | None = None,
    shard_size: int | str | None = None,
    merge_lora: bool = False,
) -> list[Output]:
    if merge_lora:
        if shard_size is not None or only:
            raise InvalidInputError("merge_lora cannot be combined with shard_size or only")
        from ckstore.read.lora import plan_merged

        return plan_merged(store, commit)
    if commit.dcp is not None:  # a distributed checkpoint: its full tensors, not the ranks' pieces
        from ckstore.read.consolidate import plan_consolidated

        return plan_consolidated(store, commit, only, None if shard_size is None else parse_size(shard_size))
    if shard_size is not None:
        return plan_shards(store, commit, parse_size(shard_size), only)
    return plan_outputs(store, commit, only)


@dataclass(frozen=True)
class ExportPlan:
    outputs: list[Output]
    merged_adapter: str | None = None  # the LoRA adapter merged into the model, if any


def plan_export(
    store: ObjectStore,
    commit: Commit,
    *,
    prefix: str | None = None,
    weights: Sequence[str] | None = None,
    files_from: Commit | None = None,
    shard_size: int | str | None = None,
) -> ExportPlan:
    """The outputs of an export (module docstring): model tensors, then the other files."""
    size = None if shard_size is None else parse_size(shard_size)
    if commit.dcp is not None:
        raise InvalidInputError(
            "a distributed checkpoint has no model folder to export; check it out "
            "(consolidated safetensors, optionally --shard-size) instead"
        )
    if commit.state is not None:
        if weights:
            raise InvalidInputError(
                "weights names files of a commit of files; a training state's model is chosen by its key prefix"
            )
        tensors = _state_tensors(store, commit, STATE_MODEL_KEY if prefix is None else prefix)
        return ExportPlan(
            plan_model_files(store, tensors, size, {"format": "pt"})
            + [full_output(f) for f in _companion_files(files_from or commit)]
        )
    files = _weight_files(commit, weights)
    # A LoRA adapter overlay's model is the base with the adapter merged: what from_pretrained
    # loads with no peft and no base_model_name_or_path to resolve (unless --weights names the
    # adapter's own file, asking for its tensors as they are).
    from ckstore.read.lora import find_merge

    merge = find_merge(store, commit)
    if merge is not None and any(f is merge.adapter for f in files):
        merge = None
    dotted = _dotted(prefix)
    if dotted:
        _check_prefix([t.name for f in files for t in f.tensors], dotted)
    tensors = gather_tensors(files, lambda t: t.name[len(dotted) :] if t.name.startswith(dotted) else None)
    if not tensors:
        raise TensorNotFoundError(f"{', '.join(f.path for f in files)} hold(s) no tensors")
    if len(files) == 1 and size is None and not dotted and files[0].path == SINGLE_NAME:
        # the committed model file, byte for byte (with the adapter merged: its own header metadata)
        outputs = [merge.file_output(store, files[0]) if merge else full_output(files[0])]
    else:
        outputs = plan_model_files(store, tensors, size, _model_metadata(store, files), merge.tensor if merge else None)
    if files_from is not None or merge is None:
        companions = _companion_files(files_from or commit)
    else:
        companions = [f for f in _companion_files(commit) if not merge.is_adapter_file(f)]
        companions = sorted(companions + ([merge.base_card] if merge.base_card else []), key=lambda f: f.path)
    return ExportPlan(outputs + [full_output(f) for f in companions], merge.adapter.path if merge else None)


def _dotted(prefix: str | None) -> str:
    """``"model"`` and ``"model."`` both mean the keys below ``model``; None or "" means all."""
    return prefix.rstrip(".") + "." if prefix and prefix.rstrip(".") else ""


def _top_level_keys(names: Sequence[str]) -> str:
    return ", ".join(sorted({n.split(".", 1)[0] for n in names}))


def _check_prefix(names: Sequence[str], dotted: str) -> None:
    if not any(n.startswith(dotted) for n in names):
        raise TensorNotFoundError(
            f"no tensor of the commit has the prefix {dotted!r} (top-level keys: {_top_level_keys(names)})"
        )


def _weight_files(commit: Commit, patterns: Sequence[str] | None) -> list[FileEntry]:
    safetensors = [f for f in commit.files if f.kind == "safetensors"]
    if patterns:
        chosen = [f for f in safetensors if any(fnmatch.fnmatchcase(f.path, p) for p in patterns)]
        if not chosen:
            raise TensorNotFoundError(f"no safetensors file of the commit matches {', '.join(map(repr, patterns))}")
        return chosen
    chosen = [f for f in safetensors if "/" not in f.path and any(fnmatch.fnmatchcase(f.path, p) for p in MODEL_FILES)]
    if not chosen:
        raise TensorNotFoundError(
            "the commit has no model.safetensors (or model-*-of-*.safetensors shards); name the files holding the "
            f"model (its safetensors files: {', '.join(sorted(f.path for f in safetensors)) or 'none'})"
        )
    return chosen


def _model_metadata(store: ObjectStore, files: Sequence[FileEntry]) -> dict[str, str]:
    """The model files' own ``__metadata__`` when they agree, with a format from_pretrained accepts."""
    found = [header_metadata(store, f) or {} for f in files]
    metadata = dict(found[0]) if all(m == found[0] for m in found) else {}
    if metadata.get("format") not in HF_FORMATS:
        metadata["format"] = "pt"
    return metadata


def _companion_files(commit: Commit) -> list[FileEntry]:
    """Every file an export copies as it is (module docstring)."""
    state = {commit.state.values, commit.state.tensors} if commit.state is not None else set()
    return [
        f
        for f in commit.files
        if f.path not in state
        and (
            "/" in f.path
            or not (f.kind == "safetensors" or f.path.endswith((*PICKLE_SUFFIXES, ".safetensors.index.json")))
        )
    ]


# ---- training-state commits ------------------------------------------------------------------------


@dataclass(frozen=True)
class _TensorLeaf:
    name: str  # the tensor's name in the state's safetensors file
    dtype: str | None  # set when safetensors cannot name the dtype (stored as raw bytes)


@dataclass(frozen=True)
class _OtherLeaf:
    tag: str  # a torch dtype, device or size: not a tensor


def _leaf(tag: str, payload: JSONValue) -> object:
    if tag in ("tensor", "ndarray") and isinstance(payload, dict) and isinstance(payload.get("name"), str):
        dtype = payload.get("dtype")
        return _TensorLeaf(str(payload["name"]), dtype if isinstance(dtype, str) else None)
    return _OtherLeaf(tag)


def _walk(value: object, path: tuple[str, ...] = ()) -> Iterator[tuple[str, object]]:
    """(dotted key path, leaf) for every leaf of a decoded state, in its order."""
    if isinstance(value, dict):
        items: Iterator[tuple[object, object]] = iter(value.items())
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        yield ".".join(path), value
        return
    for key, item in items:
        yield from _walk(item, (*path, str(key)))


def _state_tensors(store: ObjectStore, commit: Commit, prefix: str) -> dict[str, tuple[FileEntry, TensorEntry]]:
    """The tensors under ``prefix`` in a training state, by their key path without the prefix."""
    assert commit.state is not None
    dotted = _dotted(prefix)
    doc = state_document(store, commit)
    if not isinstance(doc, dict) or "value" not in doc:
        raise IntegrityError(f"{commit.state.values}: malformed state document")
    leaves = list(_walk(decode_value(doc["value"], leaf=_leaf)))
    _check_prefix([path for path, leaf in leaves if isinstance(leaf, _TensorLeaf)], dotted)
    stored = next(f for f in commit.files if f.path == commit.state.tensors)
    by_name = {t.name: t for t in stored.tensors}
    tensors: dict[str, tuple[FileEntry, TensorEntry]] = {}
    for path, leaf in leaves:
        if not path.startswith(dotted):
            continue
        if not isinstance(leaf, _TensorLeaf):
            kind = leaf.tag if isinstance(leaf, _OtherLeaf) else type(leaf).__name__
            raise InvalidInputError(f"{path} is a {kind}, not a tensor: a model file holds tensors only")
        if leaf.dtype is not None:
            raise InvalidInputError(f"{path} has dtype {leaf.dtype}, which safetensors cannot name")
        if leaf.name not in by_name:
            raise IntegrityError(f"{path} names tensor {leaf.name!r}, which the state's file does not hold")
        tensors[path[len(dotted) :]] = (stored, by_name[leaf.name])
    return tensors
