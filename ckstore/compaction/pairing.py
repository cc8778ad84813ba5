"""Compaction's pairing: which chunk of the parent each position of a commit is re-encoded
against, what may predict it, and the roles that keep a run's new links acyclic (compact.py runs
the pairs, encoding.py re-encodes one position).

A commit's chunk positions pair with its parent's by position, else by tensor name
(``positions.ChunkIndex``); a DCP parameter's weight and ``exp_avg_sq`` pieces (optstate.py) also
name their siblings (weight, moments) at the same chunk index, from which a predicted delta may
be computed (codecs/predict.py).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ckstore.format.ids import ObjectId
from ckstore.format.manifest import Commit
from ckstore.format.optstate import FIRST, SECOND, WEIGHT, float32_members
from ckstore.format.positions import HEADER, ChunkIndex, Position, Slot, chunk_at, slots
from ckstore.format.settings import PREDICTED_VERSION
from ckstore.repository.change_record import comparable
from ckstore.repository.context import RepoContext

# codecs/predict.py needs numpy: imported where used, so commands that compact nothing start without it.
if TYPE_CHECKING:
    from ckstore.codecs.predict import Predictor


@dataclass(frozen=True)
class Prediction:
    """A parent chunk to try as a predicted delta: ``bases`` in the predictor's order; ``whole``
    are the child's chunks (whole through the run), ``moment`` the parent's first moment (whole
    when the run starts, at most a plain delta against the child's when it ends) or None."""

    predictor: Predictor
    bases: tuple[ObjectId, ...]
    whole: tuple[ObjectId, ...]
    moment: ObjectId | None


@dataclass(frozen=True)
class Job:
    slot: Slot  # the child's chunk
    parent: ObjectId | None  # the parent's chunk at the same position, if a delta candidate
    # For each older commit in view (newest first), the chunks at this position and, for a
    # parameter's piece, at its siblings' (weight, moments): what may depend on the parent's chunk.
    older: tuple[tuple[ObjectId | None, ...], ...]
    history_ends: bool  # ``older`` reaches the branch's first commit
    grandparent: ObjectId | None = None  # ``older``'s first commit's chunk at this very position
    great_grandparent: ObjectId | None = None  # and its second commit's
    prediction: Prediction | None = None
    tip: bool = True  # the child is the branch tip (not the pair below it)
    # The tensor's dtype when the parent has it at the same path and name (its change is recorded).
    dtype: str | None = None
    settle: bool = False  # re-encode the child's chunk in its best whole encoding if stored fast
    record_only: bool = False  # a small position: its change is recorded, nothing re-encoded


class Roles:
    """What a run has decided about each object, so that within one run new bases only ever lead
    to whole objects (staged replacements are invisible to reads until the run ends): that is
    what keeps chains acyclic and as long as their headers say.

    Roles: "base" stays whole through the run; "delta" may become a plain delta against a "base";
    "moment" (a predicted delta's base from the parent) may become a plain delta but is nobody's
    plain-delta base; "predicted" may become a predicted delta whose bases are "base", "delta" or
    "moment" objects, and is nobody's base. So every new link goes predicted -> {moment, delta,
    base} or {moment, delta} -> base, and a chain of new links ends in a whole object within two.
    """

    def __init__(self, keep_whole: Iterable[str] = ()) -> None:
        self._role: dict[str, str] = dict.fromkeys(keep_whole, "base")
        self._recompressed: set[str] = set()
        self._lock = threading.Lock()

    def pair(self, delta: str, base: str) -> bool:
        """Claim ``delta`` to be re-encoded against ``base``, unless either was claimed otherwise."""
        with self._lock:
            if self._role.get(delta, "moment") != "moment" or self._role.get(base, "base") != "base":
                return False
            self._role[delta] = "delta"
            self._role[base] = "base"
            return True

    def predict(self, target: str, whole: Sequence[str], moment: str | None) -> bool:
        """Claim ``target`` to be re-encoded from ``whole`` and ``moment`` (see the class)."""
        with self._lock:
            if target in self._role or any(self._role.get(b, "base") != "base" for b in whole):
                return False
            if moment is not None and self._role.get(moment) == "predicted":
                return False
            self._role[target] = "predicted"
            self._role.update(dict.fromkeys(whole, "base"))
            if moment is not None:
                self._role.setdefault(moment, "moment")
            return True

    def recompress(self, oid: str) -> bool:
        with self._lock:
            if oid in self._recompressed or self._role.get(oid) in ("delta", "predicted"):
                return False
            self._recompressed.add(oid)
            return True


class Upgrade:
    """Whether predicted (or context-sorted) deltas may be written, upgrading a version 2 or newer
    repository to the version that allows them (config.json, durable) before the first one is
    staged (docs/format.md, compatibility)."""

    def __init__(self, ctx: RepoContext) -> None:
        self.ctx = ctx

    def possible(self) -> bool:
        return self.ctx.config.version >= 2 and self.ctx.store.settings.max_delta_depth > 0

    def __call__(self, version: int = PREDICTED_VERSION) -> bool:
        return self.ctx.upgrade(version)


def plan_pair(
    child: Commit, older: Sequence[Commit], depth: int, history_ends: bool, upgrade: Upgrade, tip: bool
) -> list[Job]:
    """One job per chunk position of ``child``, paired with ``older[0]``'s chunk there."""
    # An overlay's chunks are forward deltas against its base's: nothing of it is re-encoded.
    if child.base is not None:
        return []
    new_files = {f.path: [t.name for t in f.tensors] for f in child.files if f.kind == "safetensors"}
    indexes = [ChunkIndex(c.files, new_files) for c in older[: depth + 1]] if depth else []
    child_slots = slots(child.files)
    found: dict[tuple[Position, int], list[ObjectId | None]] = {
        where: [chunk_at(ix, where[0], where[1], slot.size) for ix in indexes] for where, slot in child_slots.items()
    }
    siblings = _siblings(child, child_slots) if indexes and upgrade.possible() else {}
    recorded: dict[Position, str] = (
        {k: new.dtype for k, (new, _) in comparable(child, older[0]).items()} if tip and older else {}
    )
    jobs = []
    for where, slot in child_slots.items():
        parent = found[where][0] if found[where] and where[0][1] != HEADER else None
        group = siblings.get(where, {"": where})
        older_ids = tuple(tuple(found[p][k] for p in group.values()) for k in range(1, len(found[where])))
        grandparent = found[where][1] if len(found[where]) > 1 else None
        great_grandparent = found[where][2] if len(found[where]) > 2 else None
        job = Job(
            slot,
            parent if parent != slot.id else None,
            older_ids,
            history_ends,
            grandparent,
            great_grandparent,
            tip=tip,
            dtype=recorded.get(where[0]),
        )
        if job.parent is not None and where in siblings:
            job = replace(job, prediction=_prediction(job.parent, group, child_slots, found))
        jobs.append(job)
    # A parameter's pieces, chunk by chunk index, one after the other (weight, exp_avg,
    # exp_avg_sq: their files' order puts a tensor or more between them): a prediction reads its
    # siblings' chunks, which the pair's recent reads then still hold (HeaderCache.chunk_bytes).
    # The order decides nothing else: the pool runs jobs concurrently, and Roles keeps a run's
    # links acyclic in any order.
    order = {where: i for i, where in enumerate(child_slots)}
    first = {where: min(order[w] for w in siblings.get(where, {"": where}).values()) for where in child_slots}
    return [job for _, job in sorted(zip(((first[w], order[w]) for w in child_slots), jobs), key=lambda x: x[0])]


def _siblings(
    child: Commit, child_slots: dict[tuple[Position, int], Slot]
) -> dict[tuple[Position, int], dict[str, tuple[Position, int]]]:
    """For each chunk of a parameter's float32 piece (optstate.py): its own and its siblings'
    places, by role, when the three pieces are cut into chunks of equal sizes."""
    out: dict[tuple[Position, int], dict[str, tuple[Position, int]]] = {}
    for roles in float32_members(child.files).values():
        index = 0
        while all(((p, index) in child_slots) for p in roles.values()):
            group: dict[str, tuple[tuple[str, str | None], int]] = {role: (p, index) for role, p in roles.items()}
            if len({child_slots[w].size for w in group.values()}) == 1:
                out.update(dict.fromkeys(group.values(), group))
            index += 1
    return out


def _prediction(
    target: ObjectId,
    group: dict[str, tuple[Position, int]],
    child_slots: dict[tuple[Position, int], Slot],
    found: dict[tuple[Position, int], list[ObjectId | None]],
) -> Prediction | None:
    """How to predict the parent's chunk ``target`` from its siblings (None: a first moment, or a
    sibling the parent lacks)."""
    from ckstore.codecs.predict import Predictor

    m, v = (child_slots[group[r]].id for r in (FIRST, SECOND))
    w = child_slots[group[WEIGHT]].id if WEIGHT in group else None
    if target in (w, m, v):
        return None
    if w is not None and found[group[WEIGHT]][0] == target:
        return Prediction(Predictor.ADAM_WEIGHT, (w, m, v), (w, m, v), None)
    moment = found[group[FIRST]][0]
    if found[group[SECOND]][0] != target or moment is None or moment == target:
        return None
    return Prediction(Predictor.ADAM_SECOND_MOMENT, (v, m, moment), (v, m), moment)
