"""Which tensors of a commit are one parameter's weight and AdamW moments (pure): the sibling
chunks a predicted delta (codecs/predict.py) is computed from.

A DCP commit (ckstore.dcp) stores each piece under its fully qualified name and global offsets,
``dcp_record.piece_name``: the model's ``model.<fqn>@<offsets>`` and the optimizer state
``optim.state.<fqn>.exp_avg@<offsets>`` and ``...exp_avg_sq@<offsets>`` (torch's
``get_state_dict`` keys optimizer state by parameter fqn). The same piece of the three has the
same offsets and shape, so its chunks pair by index.

``Repo.commit_state`` stores ``{"model": model.state_dict(), "optimizer": opt.state_dict()}`` as
``model.<name>`` and ``optimizer.state.<i>.exp_avg`` (the keys are the user's): optimizer state by
parameter *index*, which does not say which model tensor it belongs to. The two moments of one
index always belong together (enough for ``exp_avg_sq``'s prediction); the weight is guessed:
PyTorch numbers parameters in ``model.parameters()`` order, which is their order in the state
dict, so the i-th state's weight is taken as the next float32 tensor of the same shape, in file
order, outside the optimizer's state (buffers and frozen tensors of other shapes are skipped). A
wrong guess costs compaction a failed fit, never correctness: a predicted delta is kept only when
it decodes to the bytes and is smaller.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from ckstore.format.manifest import FileEntry

WEIGHT, FIRST, SECOND = "w", "m", "v"
_PIECE = re.compile(r"^(?P<name>.+)@(?P<offsets>\d+(?:,\d+)*)$")
_INDEXED = re.compile(r"^(?P<optimizer>.+)\.state\.(?P<index>\d+)\.(?P<moment>exp_avg|exp_avg_sq)$")
_MODEL = "model."
_OPTIM = "optim.state."
_MOMENTS = {".exp_avg_sq": SECOND, ".exp_avg": FIRST}


@dataclass(frozen=True)
class Member:
    # (parameter fqn, offsets) for DCP, (optimizer path, "#" + index) for commit_state: the same
    # for a piece's weight and moments
    key: tuple[str, str]
    role: str  # WEIGHT, FIRST or SECOND


def member(tensor_name: str) -> Member | None:
    """The parameter piece and role a DCP tensor name stands for, or the ``commit_state``
    optimizer state (key: optimizer path and index); None for anything else."""
    found = _PIECE.match(tensor_name)
    if found is None:
        indexed = _INDEXED.match(tensor_name)
        if indexed is None:
            return None
        role = SECOND if indexed["moment"] == "exp_avg_sq" else FIRST
        return Member((indexed["optimizer"], "#" + indexed["index"]), role)
    name, offsets = found["name"], found["offsets"]
    if name.startswith(_OPTIM):
        for suffix, role in _MOMENTS.items():
            if name.endswith(suffix) and len(name) > len(_OPTIM) + len(suffix):
                return Member((name[len(_OPTIM) : -len(suffix)], offsets), role)
        return None
    if name.startswith(_MODEL) and len(name) > len(_MODEL):
        return Member((name[len(_MODEL) :], offsets), WEIGHT)
    return None


def float32_members(files: Iterable[FileEntry]) -> dict[tuple[str, str], dict[str, tuple[str, str]]]:
    """Parameter piece -> role -> (file path, tensor name), for float32 pieces whose two moments
    (and, when known, weight) the commit holds with one shape (the first file wins when a
    replicated piece is in several)."""
    found: dict[tuple[str, str], dict[str, tuple[str, str, tuple[int, ...]]]] = {}
    for f in files:
        for t in f.tensors:
            m = member(t.name) if t.dtype == "F32" else None
            if m is not None:
                found.setdefault(m.key, {}).setdefault(m.role, (f.path, t.name, tuple(t.shape)))
        _guess_weights(f, found)
    out: dict[tuple[str, str], dict[str, tuple[str, str]]] = {}
    for key, roles in found.items():
        if FIRST in roles and SECOND in roles and len({shape for _, _, shape in roles.values()}) == 1:
            out[key] = {role: (path, name) for role, (path, name, _) in roles.items()}
    return out


def _guess_weights(f: FileEntry, found: dict[tuple[str, str], dict[str, tuple[str, str, tuple[int, ...]]]]) -> None:
    """Give each ``commit_state`` optimizer state of ``f`` (by index) the next float32 tensor of
    its shape in file order that is not optimizer state (the module docstring says why)."""
    indexed = sorted(
        (
            key
            for key, roles in found.items()
            if WEIGHT not in roles and key[1].startswith("#") and roles.get(FIRST, ("",))[0] == f.path
        ),
        key=lambda k: (k[0], int(k[1][1:])),
    )
    if not indexed:
        return
    candidates = [
        t
        for t in f.tensors
        if t.dtype == "F32" and member(t.name) is None and not any(t.name.startswith(key[0] + ".") for key in indexed)
    ]
    at = 0
    for key in indexed:
        shape = found[key][FIRST][2]
        while at < len(candidates) and tuple(candidates[at].shape) != shape:
            at += 1
        if at == len(candidates):
            return
        found[key][WEIGHT] = (f.path, candidates[at].name, shape)
        at += 1
