"""Which tensors of a commit are one parameter's weight and AdamW moments (pure): the sibling
chunks a predicted delta (predict.py) is computed from.

A DCP commit (ckstore.dcp) stores each piece under its fully qualified name and global offsets,
``dcp_manifest.piece_name``: the model's ``model.<fqn>@<offsets>`` and the optimizer state
``optim.state.<fqn>.exp_avg@<offsets>`` and ``...exp_avg_sq@<offsets>`` (torch's
``get_state_dict`` keys optimizer state by parameter fqn). The same piece of the three has the
same offsets and shape, so its chunks pair by index. ``Repo.commit_state`` names optimizer state
by parameter *index* (``optimizer.state.0.exp_avg``), which does not say which model tensor it
belongs to, so those commits are not grouped (a wrong guess would only cost size, but a guess by
order is wrong often enough not to be worth the reads).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from .manifest import FileEntry

WEIGHT, FIRST, SECOND = "w", "m", "v"
_PIECE = re.compile(r"^(?P<name>.+)@(?P<offsets>\d+(?:,\d+)*)$")
_MODEL = "model."
_OPTIM = "optim.state."
_MOMENTS = {".exp_avg_sq": SECOND, ".exp_avg": FIRST}


@dataclass(frozen=True)
class Member:
    key: tuple[str, str]  # (parameter fqn, offsets): the same for a piece's weight and moments
    role: str  # WEIGHT, FIRST or SECOND


def member(tensor_name: str) -> Member | None:
    """The parameter piece and role a DCP tensor name stands for, None for anything else."""
    found = _PIECE.match(tensor_name)
    if found is None:
        return None
    name, offsets = found["name"], found["offsets"]
    if name.startswith(_OPTIM):
        for suffix, role in _MOMENTS.items():
            if name.endswith(suffix) and len(name) > len(_OPTIM) + len(suffix):
                return Member((name[len(_OPTIM):-len(suffix)], offsets), role)
        return None
    if name.startswith(_MODEL) and len(name) > len(_MODEL):
        return Member((name[len(_MODEL):], offsets), WEIGHT)
    return None


def float32_members(files: Iterable[FileEntry]) -> dict[tuple[str, str], dict[str, tuple[str, str]]]:
    """Parameter piece -> role -> (file path, tensor name), for float32 pieces whose weight and
    both moments the commit holds with the same shape (the first file wins when a replicated
    piece is in several)."""
    found: dict[tuple[str, str], dict[str, tuple[str, str, tuple[int, ...]]]] = {}
    for f in files:
        for t in f.tensors:
            m = member(t.name) if t.dtype == "F32" else None
            if m is not None:
                found.setdefault(m.key, {}).setdefault(m.role, (f.path, t.name, tuple(t.shape)))
    out: dict[tuple[str, str], dict[str, tuple[str, str]]] = {}
    for key, roles in found.items():
        if len(roles) == 3 and len({shape for _, _, shape in roles.values()}) == 1:
            out[key] = {role: (path, name) for role, (path, name, _) in roles.items()}
    return out
