"""A commit's files in a few lines: per file its tensor count, dtypes and bytes, and its tensors
grouped by the first part of their names, optimizer state recognised as such (pure: no I/O).

``ckstore show`` prints this by default; a checkpoint of a few hundred tensors (model plus
optimizer) would otherwise be a few hundred lines. Grouping by the first dotted part is what
state dicts share: ``model.*`` / ``optimizer.*`` in a training state, ``state.<i>.*`` in a
flattened optimizer, ``encoder.*`` / ``embeddings.*`` in a model. A distributed checkpoint's
tensors are named by the fully-qualified name each holds a piece of, as its record says, not by
the name it is stored under (``…exp_avg@0,0``, ``…lr@bytes``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from ckstore.format.manifest import Commit, TensorEntry

# What torch's optimizers keep per parameter. A group is optimizer state when its name says so,
# or when all its tensors end in these names and one of them is unmistakable (not just "step").
_OPTIMIZER_NAMES = frozenset({"optimizer", "optimizers", "optim", "opt", "optimizer_state", "optimizer_states"})
_DISTINCT_LEAVES = frozenset(
    {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta", "exp_inf", "sum"}
)
_STATE_LEAVES = _DISTINCT_LEAVES | {"step", "mu_product", "eta", "prev", "step_size", "ax"}
MAX_GROUPS = 8


@dataclass(frozen=True)
class TensorGroup:
    name: str  # the first dotted part shared by its tensors ("" for the rest when groups are capped)
    tensors: int
    bytes: int
    dtypes: tuple[tuple[str, int], ...]  # (dtype, count), most frequent first
    optimizer: bool  # recognised as optimizer state
    leaves: tuple[tuple[str, int], ...] = ()  # optimizer state only: (last name part, count)


@dataclass(frozen=True)
class FileSummary:
    path: str
    kind: str
    size: int
    from_base: bool  # the whole file is the base's
    tensors: int
    tensor_bytes: int
    dtypes: tuple[tuple[str, int], ...]
    tensors_from_base: int
    groups: tuple[TensorGroup, ...]  # empty when grouping says nothing (a single ordinary group)


def _counts(items: Iterable[str]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted(Counter(items).items(), key=lambda kv: (-kv[1], kv[0])))


def is_optimizer_state(name: str, leaves: Collection[str]) -> bool:
    """Whether a group of tensors named ``name`` (its first name part) whose names end in
    ``leaves`` is optimizer state: its name says so, or every leaf is what an optimizer keeps per
    parameter and one of them is unmistakable (not just ``step``)."""
    return name in _OPTIMIZER_NAMES or (
        all(leaf in _STATE_LEAVES for leaf in leaves) and any(leaf in _DISTINCT_LEAVES for leaf in leaves)
    )


def _group(name: str, tensors: list[TensorEntry], named: Callable[[TensorEntry], str]) -> TensorGroup:
    leaves = [named(t).rsplit(".", 1)[-1] for t in tensors]
    optimizer = is_optimizer_state(name, leaves)
    return TensorGroup(
        name,
        len(tensors),
        sum(t.nbytes for t in tensors),
        _counts(t.dtype for t in tensors),
        optimizer,
        _counts(leaves) if optimizer else (),
    )


def _stored_name(t: TensorEntry) -> str:
    return t.name


def group_tensors(
    tensors: Iterable[TensorEntry], named: Callable[[TensorEntry], str] = _stored_name
) -> tuple[TensorGroup, ...]:
    """Groups by the first part of each tensor's name (``named``: the name to show for it)."""
    by_name: dict[str, list[TensorEntry]] = {}
    for t in tensors:
        by_name.setdefault(named(t).split(".", 1)[0], []).append(t)
    groups = [_group(name, members, named) for name, members in by_name.items()]
    if len(groups) == 1 and not groups[0].optimizer:
        return ()
    if len(groups) > MAX_GROUPS:  # the largest groups by bytes, then one line for the rest
        groups.sort(key=lambda g: -g.bytes)
        rest = [t for g in groups[MAX_GROUPS - 1 :] for t in by_name[g.name]]
        groups = [
            *groups[: MAX_GROUPS - 1],
            TensorGroup("", len(rest), sum(t.nbytes for t in rest), _counts(t.dtype for t in rest), False),
        ]
    return tuple(groups)


def _dcp_names(commit: Commit) -> dict[tuple[str, str], str]:
    """(file, stored name) -> the fully-qualified name of the tensor or item it holds (a piece of)."""
    record = commit.dcp
    if record is None:
        return {}
    names = {(p.file, p.tensor): t.fqn for t in record.tensors for p in t.pieces}
    names.update({(o.file, o.tensor): o.fqn for o in record.objects})
    return names


def summarise(commit: Commit, inherited: Collection[tuple[str, str | None]] = ()) -> list[FileSummary]:
    """One summary per file; ``inherited`` are the (path, tensor) pairs identical to the base's."""
    fqns = _dcp_names(commit)
    out = []
    for f in commit.files:

        def named(t: TensorEntry, path: str = f.path) -> str:
            return fqns.get((path, t.name), t.name)

        out.append(
            FileSummary(
                f.path,
                f.kind,
                f.size,
                (f.path, None) in inherited,
                len(f.tensors),
                sum(t.nbytes for t in f.tensors),
                _counts(t.dtype for t in f.tensors),
                sum((f.path, t.name) in inherited for t in f.tensors),
                group_tensors(f.tensors, named),
            )
        )
    return out
