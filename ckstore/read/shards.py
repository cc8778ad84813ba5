"""Checkout in the Hugging Face sharded layout (``checkout --shard-size``).

The tensors of a commit's top-level safetensors files are re-split into
``model-0000X-of-0000N.safetensors`` shards plus ``model.safetensors.index.json``, exactly as
the Hub's writer (``huggingface_hub.split_torch_state_dict_into_shards``, used by
``save_pretrained``) splits a state dict: tensors in key order, a new shard when the next tensor
would push the current one past the limit, and a tensor larger than the limit alone in a shard of
its own (appended when it is met, as the Hub does). One shard is written as ``model.safetensors``
with no index, also as the Hub does. Sizes follow transformers: ``MB``/``GB`` are decimal,
``MiB``/``GiB`` binary.

Nothing is copied or re-encoded: each shard is a fresh header (``emit_header``) followed by the
stored chunks of its tensors, planned as checkout ``Output``s, so shards are streamed, verified
and written atomically like any checkout. Safetensors files in sub-folders belong to other
modules (sentence-transformers' ``2_Dense/``…) and are written unchanged, like every
non-safetensors file; a previous top-level ``*.safetensors.index.json`` is dropped because the new
shards replace it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence

from ckstore.errors import InvalidInputError
from ckstore.format.manifest import Commit, FileEntry, TensorEntry
from ckstore.format.manifest_entries import tensors_by_name
from ckstore.format.safetensors import emit_header
from ckstore.read.checkout import Output, Piece, check_patterns, full_output, select_tensors
from ckstore.repository.filedata import file_context, header_metadata
from ckstore.repository.store import ObjectStore

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DEFAULT_METADATA = {"format": "pt"}  # what save_pretrained writes; from_pretrained checks it
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"\s*(\d+)\s*([A-Za-z]*)\s*")


def parse_size(text: str | int) -> int:
    """``"500MB"`` -> 500_000_000, ``"2GiB"`` -> 2 * 2**30, ``"1024"`` -> 1024 (transformers' units)."""
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE.fullmatch(text)
        unit = m.group(2) if m else ""
        if m is None or unit.upper() not in _UNITS:
            raise InvalidInputError(f"invalid size {text!r}: use bytes or a number with KB, MB, GB, KiB, MiB or GiB")
        if unit.endswith("b") and len(unit) > 1 and not unit.upper().endswith("IB"):
            # transformers reads a lowercase "b" ("500Mb") as bits; refuse the ambiguity outright.
            raise InvalidInputError(f"ambiguous size {text!r}: write {unit[:-1].upper()}B for bytes")
        value = int(m.group(1)) * _UNITS[unit.upper()]
    if value <= 0:
        raise InvalidInputError(f"shard size must be positive, got {text!r}")
    return value


def split_into_shards(sizes: Sequence[tuple[str, int]], max_size: int) -> list[list[str]]:
    """Names per shard, in the Hub's greedy order (see the module docstring)."""
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for name, size in sizes:
        if size > max_size:
            shards.append([name])
            continue
        if current_size + size > max_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current:
        shards.append(current)
    return shards


def shard_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_NAME]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def index_document(weight_map: dict[str, str], total_size: int) -> bytes:
    """The index as transformers writes it (sorted keys, two-space indent, final newline)."""
    doc = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def _is_sharded_input(f: FileEntry) -> bool:
    return f.kind == "safetensors" and "/" not in f.path


def _is_old_index(f: FileEntry) -> bool:
    return "/" not in f.path and f.path.endswith(".safetensors.index.json")


def _common_metadata(store: ObjectStore, files: Sequence[FileEntry]) -> dict[str, str]:
    """The inputs' ``__metadata__`` when they all agree (``{"format": "pt"}`` otherwise)."""
    found = [header_metadata(store, f) for f in files]
    first = found[0] if found else None
    return first if first is not None and all(m == first for m in found) else dict(DEFAULT_METADATA)


def gather_tensors(
    files: Sequence[FileEntry],
    name_of: Callable[[TensorEntry], str | None],
) -> dict[str, tuple[FileEntry, TensorEntry]]:
    """The tensors of ``files`` that ``name_of`` names (None: left out), under those names, each
    with its file; two tensors under one name cannot go into one model and are refused."""
    return tensors_by_name(files, "one model cannot hold both", name_of)


def plan_model_files(
    store: ObjectStore,
    tensors: Mapping[str, tuple[FileEntry, TensorEntry]],
    shard_size: int | None,
    metadata: dict[str, str],
    rewrite: Callable[[FileEntry, TensorEntry], tuple[TensorEntry, list[Piece]]] | None = None,
) -> list[Output]:
    """The shards (plus their index) holding ``tensors`` under their keys, or ``model.safetensors``
    alone when they fit one shard or ``shard_size`` is None. Each value is the committed tensor
    and the file it came from (the key may differ from its name: a stripped prefix); ``rewrite``
    gives a tensor as written instead and its pieces (a merged LoRA update)."""
    parts: dict[str, Sequence[Piece]] = {n: t.chunks for n, (_, t) in tensors.items()}
    if rewrite is not None:
        rewritten = {n: (f, *rewrite(f, t)) for n, (f, t) in tensors.items()}
        tensors = {n: (f, t) for n, (f, t, _) in rewritten.items()}
        parts = {n: p for n, (_, _, p) in rewritten.items()}
    order = sorted(tensors)
    groups = (
        [order] if shard_size is None else split_into_shards([(n, tensors[n][1].nbytes) for n in order], shard_size)
    )
    outputs = []
    weight_map: dict[str, str] = {}
    for shard_name, group in zip(shard_names(len(groups)), groups):
        header, _ = emit_header([(n, tensors[n][1].dtype, tensors[n][1].shape) for n in group], metadata)
        pieces: list[tuple[Piece, str]] = [(header, "")]
        for n in group:
            source, t = tensors[n]
            pieces.extend((p, file_context(source.path, t.name)) for p in parts[n])
            weight_map[n] = shard_name
        outputs.append(Output(shard_name, tuple(pieces), len(header) + sum(tensors[n][1].nbytes for n in group)))
    if len(groups) > 1:
        index = index_document(dict(sorted(weight_map.items())), sum(t.nbytes for _, t in tensors.values()))
        outputs.append(Output(INDEX_NAME, ((index, ""),), len(index)))
    return outputs


def plan_shards(store: ObjectStore, commit: Commit, shard_size: int, only: Sequence[str] | None = None) -> list[Output]:
    """Outputs for a sharded checkout: the shards, their index, and the other files unchanged."""
    inputs = [f for f in commit.files if _is_sharded_input(f)]
    if only:
        check_patterns([t for f in inputs for t in f.tensors], only)
    tensors = gather_tensors(inputs, lambda t: t.name if not only or select_tensors([t], only) else None)
    if not tensors:
        raise InvalidInputError("the commit has no top-level safetensors tensors to shard")
    outputs = plan_model_files(store, tensors, shard_size, _common_metadata(store, inputs))
    written = {o.path for o in outputs}
    for f in commit.files:
        if _is_sharded_input(f) or _is_old_index(f):
            continue
        if f.path in written:
            raise InvalidInputError(f"the commit's file {f.path!r} would collide with a shard of the same name")
        outputs.append(full_output(f))
    return outputs
