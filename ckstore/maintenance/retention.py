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

from dataclasses import dataclass, field

from ckstore.errors import ForceRequiredError, InvalidInputError, NotFoundError
from ckstore.format.ids import ObjectId
from ckstore.history.log import LogEntry, log, metric_value, ranked
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


@dataclass(frozen=True)
class Selection:
    """What a policy keeps, and what it could not judge."""

    kept: set[ObjectId]
    # --keep-best: the commits that record no numeric value of the metric, which the policy
    # would delete without ranking them (whatever their quality), by branch
    unranked: dict[str, list[ObjectId]] = field(default_factory=dict)
    metrics: frozenset[str] = frozenset()  # every numeric metric the branches' commits record
    ranked_any: bool = True  # some commit records the metric (always, without --keep-best)

    def check(self, policy: RetentionPolicy, force: bool) -> None:
        """Refuse a --keep-best that ranks nothing (a misspelt metric), and one that would
        delete commits it cannot rank unless ``force``: both would delete good commits unseen."""
        if policy.keep_best is None:
            return
        known = ", ".join(sorted(self.metrics)) or "none"
        if not self.ranked_any:
            raise NotFoundError(
                f"no commit records a numeric metric {policy.metric!r}, so --keep-best cannot rank any"
                f" (recorded: {known})"
            )
        if self.unranked and not force:
            count = len({c for ids in self.unranked.values() for c in ids})
            raise ForceRequiredError(
                f"--keep-best would delete {count} commit(s) that record no numeric {policy.metric!r}"
                f" without ranking them (branch {', '.join(sorted(self.unranked))}; 'gc --dry-run' lists"
                f" them); pass --force to delete them, or rank by another metric (recorded: {known})"
            )


def select_kept(graph: CommitGraph, policy: RetentionPolicy) -> set[ObjectId]:
    return select(graph, policy).kept


def select(graph: CommitGraph, policy: RetentionPolicy) -> Selection:
    # Tags and remote-tracking refs are kept as they are, with none of their history.
    keep = {*graph.refs.list(TAGS).values(), *graph.refs.list(REMOTES).values()}
    histories = {}
    metrics: set[str] = set()
    ranked_any = policy.keep_best is None
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
        histories[name] = history
        if policy.keep_last is not None:
            keep.update(e.id for e in history[: policy.keep_last])
        if policy.keep_best is not None and policy.metric:
            best = ranked(history, policy.metric, policy.maximize)
            ranked_any = ranked_any or bool(best)
            keep.update(e.id for e in best[: policy.keep_best])
            metrics.update(k for e in history for k in e.commit.decoded_metadata() if metric_value(e, k) is not None)
        if policy.keep_every is not None:
            keep.update(e.id for e in _every(history, policy.keep_every))
    unranked: dict[str, list[ObjectId]] = {}
    if policy.keep_best is not None and policy.metric:
        for name, history in histories.items():
            lost = [e.id for e in history if e.id not in keep and metric_value(e, policy.metric) is None]
            if lost:
                unranked[name] = lost
    return Selection(keep, unranked, frozenset(metrics), ranked_any)


def best(graph: CommitGraph, metric: str, mode: str = "min", branch: str | None = None) -> ObjectId:
    """The commit of ``branch`` (default: current) with the lowest (or highest) ``metric``."""
    if mode not in ("min", "max"):
        raise InvalidInputError("mode must be 'min' or 'max'")
    history = log(graph, HEADS + (branch or graph.head_branch()))
    top = ranked(history, metric, mode == "max")
    if not top:
        raise NotFoundError(f"no commit on the branch records a numeric metric {metric!r}")
    return top[0].id
