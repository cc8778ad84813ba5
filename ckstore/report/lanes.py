"""The report's branches: each ref given is a lane with its own history, columns and metric
curve, and a fork point where its own commits leave an earlier lane's history.

A commit shared by several lanes (the history before a fork) is drawn once, in the first lane
that holds it; each lane's curve still runs over its whole history, so curves that coincide up
to the fork part there. A lane's position numbers count its history from its oldest kept commit,
so a branch that forked at main's third commit numbers its first own commit 4.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ckstore.format.ids import ObjectId
from ckstore.history.log import LogEntry, log
from ckstore.repository.graph import CommitGraph

COUNTERS = ("step", "epoch", "global_step", "iteration")  # metadata that numbers a run's commits


@dataclass(frozen=True)
class Lane:
    name: str  # the ref as given (HEAD: its branch)
    history: list[LogEntry]  # every commit the ref reaches, oldest first
    own: list[ObjectId]  # the commits drawn in this lane's columns (no earlier lane holds them)
    fork: ObjectId | None  # the commit its own history leaves an earlier lane at
    fork_lane: str | None  # that earlier lane (None: the fork commit is not in any, e.g. gc deleted it)

    def position(self, oid: ObjectId) -> int:
        """1-based position of ``oid`` in the lane's history."""
        return next(i for i, e in enumerate(self.history, 1) if e.id == oid)


def counter_of(entry: LogEntry) -> tuple[str, int] | None:
    """The run counter a commit records (``step`` first), if any: the x of its metric points."""
    meta = entry.commit.decoded_metadata()
    for key in COUNTERS:
        value = meta.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return key, value
    return None


def lanes(graph: CommitGraph, refs: Sequence[str]) -> list[Lane]:
    """One lane per distinct ref (two refs naming one history are one lane), in the order given."""
    out: list[Lane] = []
    drawn: dict[ObjectId, str] = {}  # commit -> the lane it is drawn in
    tips: set[ObjectId] = set()
    for ref in refs:
        tip = graph.resolve(ref)
        if tip in tips:
            continue
        tips.add(tip)
        name = graph.head_branch() if ref == "HEAD" else ref
        history = list(reversed(log(graph, ref)))
        own = [e.id for e in history if e.id not in drawn]
        fork = fork_lane = None
        if out:
            fork = _fork(history, set(own))
            fork_lane = drawn.get(fork) if fork is not None else None
        for oid in own:
            drawn[oid] = name
        out.append(Lane(name, history, own, fork, fork_lane))
    return out


def _fork(history: list[LogEntry], own: set[ObjectId]) -> ObjectId | None:
    """Where a lane leaves the lanes before it: the parent of its oldest own commit (which gc may
    have deleted), or its tip when it has no commit of its own (a branch at an earlier commit)."""
    mine = [e for e in history if e.id in own]
    if not mine:
        return history[-1].id if history else None
    first = mine[0].commit
    return first.parents[0] if first.parents else None
