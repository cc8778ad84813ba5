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
The adapter files are not written: the output is the base model with merged weights, and
the README.md beside a top-level adapter (peft's model card for the adapter, which replaced the
base's in the overlay) gives way to the base commit's README.md. ``export`` of a commit holding
an adapter writes the same merged model (export.py).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckstore.errors import InvalidInputError, MissingDependencyError
from ckstore.format.manifest import Commit, FileEntry, TensorEntry, decode_commit
from ckstore.format.safetensors import emit_header
from ckstore.read.checkout import Output, Piece, full_output
from ckstore.repository.filedata import file_context, header_metadata, read_file_bytes
from ckstore.repository.store import ObjectStore

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
README = "README.md"  # peft's save_pretrained writes its adapter model card here
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


@dataclass(frozen=True)
class LoraMerge:
    """A planned merge: which files are the adapter's, and each base tensor as written."""

    adapter: FileEntry  # adapter_model.safetensors
    config: FileEntry  # adapter_config.json beside it
    card_replaced: bool  # the top-level README.md is the adapter's card, not the base's
    base_card: FileEntry | None  # then: the base commit's README.md, written instead (if it has one)
    # (file, tensor) -> the tensor as written, and the function computing a merged one's bytes
    merged: dict[tuple[str, str], tuple[TensorEntry, Callable[[], bytes] | None]]

    def is_adapter_file(self, f: FileEntry) -> bool:
        """The adapter's own files: its weights and config, its whole folder when it has one,
        and peft's README.md model card that replaced the base's (whose README.md is written instead)."""
        folder = _folder(self.adapter.path)
        if f is self.adapter or f is self.config:
            return True
        return _folder(f.path) == folder if folder else (f.path == README and self.card_replaced)

    def touches(self, f: FileEntry) -> bool:
        return any(path == f.path for path, _ in self.merged)

    def tensor(self, f: FileEntry, t: TensorEntry) -> tuple[TensorEntry, list[Piece]]:
        """``t`` of base file ``f`` as the merged model holds it, and the pieces of its bytes."""
        found = self.merged.get((f.path, t.name))
        if found is None:
            return t, list(t.chunks)
        written, merge = found
        return written, [merge] if merge is not None else list(written.chunks)

    def file_output(self, store: ObjectStore, f: FileEntry) -> Output:
        """Base file ``f`` with its merged tensors, under its own header metadata."""
        if not self.touches(f):
            return full_output(f)
        written = [self.tensor(f, t) for t in f.tensors]
        header, _ = emit_header([(t.name, t.dtype, t.shape) for t, _ in written], header_metadata(store, f))
        pieces: list[tuple[Piece, str]] = [(header, "")]
        for original, (_, parts) in zip(f.tensors, written):
            pieces.extend((p, file_context(f.path, original.name)) for p in parts)
        return Output(f.path, tuple(pieces), len(header) + sum(t.nbytes for t, _ in written))

    def other_files(self, commit: Commit) -> list[FileEntry]:
        """``commit``'s files that are neither the adapter's nor safetensors, the base's card included."""
        kept = [f for f in commit.files if f.kind != "safetensors" and not self.is_adapter_file(f)]
        return sorted(kept + ([self.base_card] if self.base_card else []), key=lambda f: f.path)


def find_merge(store: ObjectStore, commit: Commit) -> LoraMerge | None:
    """The merge of the commit's LoRA adapter, or None when it has none."""
    try:
        find_adapter(commit)
    except InvalidInputError:
        return None
    return plan_lora_merge(store, commit)


def plan_lora_merge(store: ObjectStore, commit: Commit) -> LoraMerge:
    """Match the adapter's tensors to the base tensors they update, refusing what cannot merge."""
    weights, config_file = find_adapter(commit)
    try:
        config = json.loads(read_file_bytes(store, config_file))
        r_default, alpha_default = int(config["r"]), float(config["lora_alpha"])
    except (ValueError, KeyError, TypeError):
        raise InvalidInputError(f"LoRA merge: {config_file.path} is not a PEFT LoRA config") from None
    base_files = [f for f in commit.files if f is not weights and f is not config_file and f.kind == "safetensors"]
    owner = {t.name: (f, t) for f in base_files for t in f.tensors}
    names = list(owner)

    updates: dict[str, _Update] = {}
    for t in weights.tensors:
        key = t.name[len(_PREFIX) :] if t.name.startswith(_PREFIX) else t.name
        m = _LORA_KEY.match(key)
        if m:
            target = _match(m["module"] + ".weight", names)
            update = updates.setdefault(target, _Update(m["module"]))
            setattr(update, m["which"].lower(), t)
        else:
            updates.setdefault(_match(key, names), _Update(key)).replacement = t
    fan_in_fan_out = bool(config.get("fan_in_fan_out"))
    for target, u in updates.items():
        if u.replacement is None and (u.a is None or u.b is None):
            raise InvalidInputError(f"LoRA merge: {u.module} has lora_A without lora_B or the reverse")
        if u.a is not None and u.b is not None:
            _check_shapes(owner[target][1], u.a, u.b, fan_in_fan_out)

    def scale(module: str) -> float:
        r = int(_pattern_value(config.get("rank_pattern") or {}, module, r_default))
        alpha = float(_pattern_value(config.get("alpha_pattern") or {}, module, alpha_default))
        return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r

    merged: dict[tuple[str, str], tuple[TensorEntry, Callable[[], bytes] | None]] = {}
    for target, u in updates.items():
        f, t = owner[target]
        if u.replacement is not None:  # modules_to_save: the adapter's tensor under the base's name
            r = u.replacement
            merged[(f.path, t.name)] = (TensorEntry(t.name, r.dtype, r.shape, r.chunks), None)
        else:
            merged[(f.path, t.name)] = (t, _merge_fn(store, t, u, scale(u.module), fan_in_fan_out))
    return LoraMerge(weights, config_file, *_base_card(store, commit, weights), merged)


def _base_card(store: ObjectStore, commit: Commit, adapter: FileEntry) -> tuple[bool, FileEntry | None]:
    """Whether the top-level README.md is the adapter's card, and then the base's README.md.

    Only an overlay tells them apart: its README.md is the adapter's when it differs from the base
    commit's (or the base has none). An adapter committed in a folder keeps its card in there."""
    mine = next((f for f in commit.files if f.path == README), None)
    if commit.base is None or _folder(adapter.path) or mine is None:
        return False, None
    base_id = commit.base.commit
    base = decode_commit(
        store.get_commit(base_id),
        read=lambda ref: store.get_chunk(ref.id, ref.size, f" (file list of commit {base_id})"),
    )
    theirs = next((f for f in base.files if f.path == README), None)
    if theirs is not None and [c.id for c in theirs.all_chunks()] == [c.id for c in mine.all_chunks()]:
        return False, None
    return True, theirs


def plan_merged(store: ObjectStore, commit: Commit) -> list[Output]:
    """Outputs writing every non-adapter file, with LoRA updates merged into the base weights."""
    merge = plan_lora_merge(store, commit)
    outputs = [full_output(f) for f in merge.other_files(commit)]
    return outputs + [
        merge.file_output(store, f) for f in commit.files if f.kind == "safetensors" and not merge.is_adapter_file(f)
    ]


def _check_shapes(weight: TensorEntry, a: TensorEntry, b: TensorEntry, transpose: bool) -> None:
    """Refuse a mismatched pair while planning, so a failing merge writes no output file at all
    (the merge itself runs lazily, after other files may have been written)."""
    if len(a.shape) == 2 and len(b.shape) == 2 and a.shape[0] == b.shape[1]:
        shape = (b.shape[0], a.shape[1])
        shape = shape[::-1] if transpose else shape
        if tuple(weight.shape) == shape:
            return
        raise InvalidInputError(
            f"LoRA merge: update for {weight.name!r} has shape {shape}, the weight {tuple(weight.shape)}"
        )
    raise InvalidInputError(
        f"LoRA merge: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} of {weight.name!r} "
        "do not form a rank-r product"
    )


def _written(t: TensorEntry, u: _Update | None) -> TensorEntry:
    """The tensor as written: a modules_to_save replacement keeps the base tensor's name."""
    if u is None or u.replacement is None:
        return t
    return TensorEntry(t.name, u.replacement.dtype, u.replacement.shape, u.replacement.chunks)


def _merge_fn(
    store: ObjectStore, weight: TensorEntry, u: _Update, scale: float, transpose: bool
) -> Callable[[], bytes]:
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
            raise InvalidInputError(
                f"LoRA merge: update for {weight.name!r} has shape {tuple(delta.shape)}, the weight {tuple(w.shape)}"
            )
        out = (w.to(compute) + delta).to(w.dtype).contiguous()
        return out.reshape(-1).view(torch.uint8).numpy().tobytes()

    return merged
