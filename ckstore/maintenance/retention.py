"""Which commits to keep, and which is best: decisions made from history and metadata only.

A policy keeps the union of what each of its rules selects, per branch, plus every tagged commit,
every commit a remote-tracking ref names, and the newest commit of every branch (a branch name must keep resolving: resuming uses it):
``keep_last`` (the N newest), ``keep_best`` (the N with the best ``metric``), ``keep_every`` (each
commit whose ``step`` — else ``epoch`` — metadata is a multiple of K, or, without those, every K-th
commit counted from the oldest). A policy with no rule keeps everything reachable. With
``branches`` the rules thin only those branches; every other branch keeps its whole history (a
training manager's ``total_limit``/``keep_latest_k``/``num_to_keep`` is about its own run).

Counting by position needs the whole history: once an earlier gc pruned a branch's old commits,
the positions of the survivors are unknown, so there ``keep_every`` keeps every commit that has
no ``step``/``epoch`` metadata rather than re-count from the truncation and delete commits the
earlier run kept. Record ``step`` or ``epoch`` (as commit_state callers normally do) to thin a
rolling run repeatedly.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckstore.errors import InvalidInputError, NotFoundError
from ckstore.format.ids import ObjectId
from ckstore.history.log import LogEntry, log, ranked
from ckstore.repository.graph import REMOTES, CommitGraph
from ckstore.repository.refs import HEADS, TAGS


@dataclass(frozen=True)
class RetentionPolicy:
    keep_last: int | None = None
    keep_best: int | None = None
    metric: str | None = None
    maximize: bool = False
    keep_every: int | None = None
    branches: tuple[str, ...] | None = None  # None: every branch

    def validate(self) -> None:
        for name in ("keep_last", "keep_best", "keep_every"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidInputError(f"{name} must be at least 1")
        if self.keep_best is not None and not self.metric:
            raise InvalidInputError("keep_best needs a metric to rank commits by")
        if self.branches is not None and not self.active:
            raise InvalidInputError("branches limits a retention rule: give keep_last, keep_best or keep_every")

    @property
    def active(self) -> bool:
        return any(v is not None for v in (self.keep_last, self.keep_best, self.keep_every))


def _counter(entry: LogEntry) -> int | None:
    meta = entry.commit.decoded_metadata()
    for key in ("step", "epoch"):
        value = meta.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _every(history: list[LogEntry], k: int) -> list[LogEntry]:
    oldest_first = list(reversed(history))
    # History that lost commits to an earlier gc: positions counted now would not be the
    # positions that run counted (see the module docstring).
    truncated = any(e.pruned_parents for e in history)
    out = []
    for position, entry in enumerate(oldest_first, start=1):
        counter = _counter(entry)
        if counter is None and truncated:
            out.append(entry)
        elif (position if counter is None else counter) % k == 0:
            out.append(entry)
    return out


def select_kept(graph: CommitGraph, policy: RetentionPolicy) -> set[ObjectId]:
    # Tags and remote-tracking refs are kept as they are, with none of their history.
    keep = {*graph.refs.list(TAGS).values(), *graph.refs.list(REMOTES).values()}
    heads = graph.refs.list(HEADS)
    missing = sorted(set(policy.branches or ()) - set(heads))
    if missing:
        raise NotFoundError(f"no such branch: {missing[0]}")
    for name, tip in heads.items():
        keep.add(tip)
        history = log(graph, HEADS + name)
        if policy.branches is not None and name not in policy.branches:
            keep.update(e.id for e in history)
            continue
        if policy.keep_last is not None:
            keep.update(e.id for e in history[: policy.keep_last])
        if policy.keep_best is not None and policy.metric:
            keep.update(e.id for e in ranked(history, policy.metric, policy.maximize)[: policy.keep_best])
        if policy.keep_every is not None:
            keep.update(e.id for e in _every(history, policy.keep_every))
    return keep


def best(graph: CommitGraph, metric: str, mode: str = "min", branch: str | None = None) -> ObjectId:
    """The commit of ``branch`` (default: current) with the lowest (or highest) ``metric``."""
    if mode not in ("min", "max"):
        raise InvalidInputError("mode must be 'min' or 'max'")
    history = log(graph, HEADS + (branch or graph.head_branch()))
    top = ranked(history, metric, mode == "max")
    if not top:
        raise NotFoundError(f"no commit on the branch records a numeric metric {metric!r}")
    return top[0].id
