"""Merging a PEFT LoRA adapter into its base weights at checkout (``--merge-lora``).

Supported layout (what ``peft``'s ``save_pretrained`` writes): a folder holding
``adapter_config.json`` and ``adapter_model.safetensors``, committed as an overlay on the base
model. Adapter keys are ``base_model.model.<module>.lora_A.weight`` and ``….lora_B.weight``
(an adapter-name segment such as ``lora_A.default.weight`` is accepted too); each pair updates the
base tensor ``<module>.weight`` — matched exactly, or as the unique base name that ends with it or
that it ends with, so a ``bert.`` or ``model.`` prefix on either side is fine. The update is
``W + scale · B @ A`` with ``scale = lora_alpha / r`` (``lora_alpha / sqrt(r)`` when
``use_rslora``), per-module ``rank_pattern`` / ``alpha_pattern`` honoured, transposed when
``fan_in_fan_out``; it is computed in float32 (float64 for F64 weights) and cast back to the
weight's dtype. Other adapter tensors (``modules_to_save``) replace the base tensor they name.
The adapter files are not written: the output is the base model with merged weights.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckstore.read.checkout import Output, Piece, full_output
from ckstore.errors import InvalidInputError, MissingDependencyError
from ckstore.repository.filedata import file_context, header_metadata, read_file_bytes
from ckstore.format.manifest import Commit, FileEntry, TensorEntry
from ckstore.format.safetensors import emit_header
from ckstore.repository.store import ObjectStore

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")


@dataclass
class _Update:
    module: str
    a: TensorEntry | None = None
    b: TensorEntry | None = None
    replacement: TensorEntry | None = None


def _folder(path: str) -> str:
    return path.rsplit("/", 1)[0] if "/" in path else ""


def find_adapter(commit: Commit) -> tuple[FileEntry, FileEntry]:
    for f in commit.files:
        if f.path.rsplit("/", 1)[-1] == ADAPTER_WEIGHTS and f.kind == "safetensors":
            folder = _folder(f.path)
            config_path = f"{folder}/{ADAPTER_CONFIG}" if folder else ADAPTER_CONFIG
            config = next((c for c in commit.files if c.path == config_path), None)
            if config is not None:
                return f, config
    raise InvalidInputError(f"LoRA merge: the commit has no {ADAPTER_WEIGHTS} with an {ADAPTER_CONFIG} beside it")


def _pattern_value(pattern: dict[str, Any], module: str, default: Any) -> Any:
    """peft's rule (utils.other.get_pattern_key): the first key that, as a regular expression,
    matches the module name or a dotted suffix of it. A plain ``fullmatch`` missed regex keys
    written without the model's prefix (``layer.1.*value`` for ``bert.encoder.layer.1.….value``)."""
    for key, value in pattern.items():
        try:
            if re.match(rf"(.*\.)?({key})$", module):
                return value
        except re.error:
            raise InvalidInputError(f"LoRA merge: rank/alpha pattern {key!r} is not a regular expression") from None
    return default


def _match(name: str, base_names: list[str]) -> str:
    exact = [b for b in base_names if b == name]
    if exact:
        return exact[0]
    near = [b for b in base_names if b.endswith("." + name) or name.endswith("." + b)]
    if len(near) != 1:
        raise InvalidInputError(
            f"LoRA merge: adapter tensor for {name!r} matches {len(near)} base tensors; cannot merge"
        )
    return near[0]


def plan_merged(store: ObjectStore, commit: Commit) -> list[Output]:
    """Outputs writing every non-adapter file, with LoRA updates merged into the base weights."""
    weights, config_file = find_adapter(commit)
    try:
        config = json.loads(read_file_bytes(store, config_file))
        r_default, alpha_default = int(config["r"]), float(config["lora_alpha"])
    except (ValueError, KeyError, TypeError):
        raise InvalidInputError(f"LoRA merge: {config_file.path} is not a PEFT LoRA config") from None
    folder = _folder(weights.path)
    base_files = [f for f in commit.files if f is not weights and f is not config_file and f.kind == "safetensors"]
    # The adapter's own files are not written; an adapter committed beside the base files (the
    # usual case: both at the root) must not take the base's config.json and tokenizer with it.
    others = [f for f in commit.files if f.kind != "safetensors" and f is not config_file
              and (not folder or _folder(f.path) != folder)]
    owner = {t.name: (f, t) for f in base_files for t in f.tensors}
    names = list(owner)

    updates: dict[str, _Update] = {}
    for t in weights.tensors:
        key = t.name[len(_PREFIX):] if t.name.startswith(_PREFIX) else t.name
        m = _LORA_KEY.match(key)
        if m:
            target = _match(m["module"] + ".weight", names)
            update = updates.setdefault(target, _Update(m["module"]))
            setattr(update, m["which"].lower(), t)
        else:
            updates.setdefault(_match(key, names), _Update(key)).replacement = t
    for target, u in updates.items():
        if u.replacement is None and (u.a is None or u.b is None):
            raise InvalidInputError(f"LoRA merge: {u.module} has lora_A without lora_B or the reverse")
        if u.a is not None and u.b is not None:
            _check_shapes(owner[target][1], u.a, u.b, bool(config.get("fan_in_fan_out")))

    def scale(module: str) -> float:
        r = int(_pattern_value(config.get("rank_pattern") or {}, module, r_default))
        alpha = float(_pattern_value(config.get("alpha_pattern") or {}, module, alpha_default))
        return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r

    outputs = [full_output(f) for f in others]
    for f in base_files:
        mine = {name: u for name, u in updates.items() if owner[name][0] is f}
        if not mine:
            outputs.append(full_output(f))
            continue
        tensors = [_written(t, mine.get(t.name)) for t in f.tensors]
        header, _ = emit_header([(t.name, t.dtype, t.shape) for t in tensors], header_metadata(store, f))
        pieces: list[tuple[Piece, str]] = [(header, "")]
        for original, written in zip(f.tensors, tensors):
            ctx = file_context(f.path, original.name)
            u = mine.get(original.name)
            if u is None or u.replacement is not None:
                pieces.extend((c, ctx) for c in written.chunks)
            else:
                pieces.append((_merge_fn(store, original, u, scale(u.module), bool(config.get("fan_in_fan_out"))), ctx))
        outputs.append(Output(f.path, tuple(pieces), len(header) + sum(t.nbytes for t in tensors)))
    return outputs


def _check_shapes(weight: TensorEntry, a: TensorEntry, b: TensorEntry, transpose: bool) -> None:
    """Refuse a mismatched pair while planning, so a failing merge writes no output file at all
    (the merge itself runs lazily, after other files may have been written)."""
    if len(a.shape) == 2 and len(b.shape) == 2 and a.shape[0] == b.shape[1]:
        shape = (b.shape[0], a.shape[1])
        shape = shape[::-1] if transpose else shape
        if tuple(weight.shape) == shape:
            return
        raise InvalidInputError(f"LoRA merge: update for {weight.name!r} has shape {shape}, "
                                f"the weight {tuple(weight.shape)}")
    raise InvalidInputError(f"LoRA merge: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} of {weight.name!r} "
                            "do not form a rank-r product")


def _written(t: TensorEntry, u: _Update | None) -> TensorEntry:
    """The tensor as written: a modules_to_save replacement keeps the base tensor's name."""
    if u is None or u.replacement is None:
        return t
    return TensorEntry(t.name, u.replacement.dtype, u.replacement.shape, u.replacement.chunks)


def _merge_fn(store: ObjectStore, weight: TensorEntry, u: _Update, scale: float, transpose: bool) -> Callable[[], bytes]:
    def merged() -> bytes:
        try:
            import torch

            from ckstore.format.torch_dtypes import dtype_of_code
        except ImportError:
            raise MissingDependencyError("merging LoRA weights needs torch (pip install torch)") from None
        assert u.a is not None and u.b is not None

        def load(t: TensorEntry) -> torch.Tensor:
            data = bytearray(b"".join(store.get_chunk(c.id, c.size, f" (tensor {t.name!r})") for c in t.chunks))
            return torch.frombuffer(data, dtype=dtype_of_code(t.dtype, t.name)).reshape(t.shape)

        w, a, b = load(weight), load(u.a), load(u.b)
        compute = torch.float64 if w.dtype == torch.float64 else torch.float32
        delta = (b.to(compute) @ a.to(compute)) * scale
        if transpose:
            delta = delta.T
        if delta.shape != w.shape:
            raise InvalidInputError(f"LoRA merge: update for {weight.name!r} has shape {tuple(delta.shape)}, "
                                    f"the weight {tuple(w.shape)}")
        out = (w.to(compute) + delta).to(w.dtype).contiguous()
        return out.reshape(-1).view(torch.uint8).numpy().tobytes()

    return merged
