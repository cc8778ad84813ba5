"""Which rows the report's heatmap and tensor tables have: the model's modules (tensors grouped by
name up to the last dot), optimizer state grouped per parameter and ranked below the weights
(folded into one heatmap row), and counters kept out of every "change" (pure: no I/O).

Optimizer state is what ``ckstore show`` recognises as such (history/summary.py): a group whose
first name part says so (``optimizer.state.0``, ``optim.state.<fqn>``) or whose tensors all end in
what an optimizer keeps per parameter (the README's ``<param>.exp_avg`` files). A one-element
tensor (a step counter, a scale) is a counter or a scalar: its relative change (250 -> 300 is
0.2) says nothing about training and would outweigh a parameter's moments in the group's norm.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import PurePosixPath

from ckstore.format.manifest import Commit
from ckstore.history.summary import is_optimizer_state

TensorKey = tuple[str, str]  # (file path, tensor name)
_DIGITS = re.compile(r"(\d+)")


def natural_key(text: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key that orders the numbers inside names by value: ``layers.2`` before ``layers.10``,
    ``0, 1, 2, …, 10, 100`` rather than ``0, 1, 10, 100``."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in _DIGITS.split(text) if part)


def module_of(name: str) -> str:
    """A tensor's module: its name without the last component (``layers.0.attn.q.weight`` ->
    ``layers.0.attn.q``); a name without dots is its own module."""
    return name.rsplit(".", 1)[0] if "." in name else name


@dataclass(frozen=True)
class Groups:
    modules: dict[str, list[TensorKey]]  # the model's modules, in natural name order
    optimizer: dict[str, list[TensorKey]]  # optimizer state per parameter, in natural name order
    counters: frozenset[TensorKey]  # one-element tensors: shown, never as a change

    def changing(self, members: Iterable[TensorKey]) -> list[TensorKey]:
        """``members`` without the counters: the tensors a relative change is computed over."""
        return [key for key in members if key not in self.counters]

    def folded_optimizer(self) -> list[TensorKey]:
        """Every optimizer tensor but the counters: the one heatmap row that stands for them."""
        return [key for members in self.optimizer.values() for key in self.changing(members)]


def group(commits: Iterable[Commit]) -> Groups:
    """The rows for the tensors of ``commits`` (each tensor once, the first time it appears)."""
    by_module: dict[tuple[str, str], list[TensorKey]] = {}  # (file path, module) -> tensors
    counters: set[TensorKey] = set()
    seen: set[TensorKey] = set()
    for commit in commits:
        for f in commit.files:
            for t in f.tensors:
                key = (f.path, t.name)
                if key in seen:
                    continue
                seen.add(key)
                by_module.setdefault((f.path, module_of(t.name)), []).append(key)
                if math.prod(t.shape) <= 1:
                    counters.add(key)
    modules: dict[str, list[TensorKey]] = {}
    optimizer: dict[str, list[TensorKey]] = {}
    for (path, module), members in by_module.items():
        leaves = [name[len(module) + 1 :] if name != module else name for _, name in members]
        if is_optimizer_state(module.split(".", 1)[0], leaves):
            label = module if is_optimizer_state(module.split(".", 1)[0], ()) else f"{_stem(path)}: {module}"
            optimizer.setdefault(label, []).extend(members)
        else:
            modules.setdefault(module, []).extend(members)
    return Groups(_sorted(modules), _sorted(optimizer), frozenset(counters))


def _stem(path: str) -> str:
    return PurePosixPath(path).name.split(".", 1)[0]


def _sorted(groups: dict[str, list[TensorKey]]) -> dict[str, list[TensorKey]]:
    return {
        name: sorted(members, key=lambda k: (natural_key(k[1]), k[0]))
        for name, members in sorted(groups.items(), key=lambda kv: natural_key(kv[0]))
    }
