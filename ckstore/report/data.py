"""What ``ckstore report`` shows, gathered from manifests, object headers and refs (no rendering).

Per-tensor figures come from each manifest's recorded statistics (format.md 5.1); what a manifest
lacks (older commits, the relative change of a changed tensor) is computed from the chunks, as
``diff`` computes it, so the report's numbers are ``diff``'s and ``log --sizes``' numbers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from ckstore.format.ids import ObjectId
from ckstore.format.manifest import Commit
from ckstore.format.tensor_stats import TensorStats
from ckstore.history.log import LogEntry, metric_value, stored_bytes
from ckstore.history.magnitude import commit_stats
from ckstore.maintenance.gc import collect_garbage
from ckstore.maintenance.retention import RetentionPolicy
from ckstore.maintenance.sizes import CommitSizes, commit_sizes
from ckstore.report.groups import Groups, TensorKey, group
from ckstore.report.lanes import COUNTERS, Lane, counter_of, lanes
from ckstore.repository.context import RepoContext
from ckstore.repository.refs import HEADS, REMOTES, TAGS

# Metrics whose name says higher is better; every other metric is taken as lower-is-better (a loss).
_HIGHER_IS_BETTER = re.compile(r"acc|f1|bleu|rouge|auc|score|precision|recall|reward|iou|map\b", re.I)
EXPLODING = 10.0  # a norm this many times the tensor's first recorded norm
VANISHING = 1e-3  # a norm below this fraction of the tensor's largest earlier norm
FROZEN_RUN = 3  # this many commits without change make a tensor "frozen"


@dataclass(frozen=True)
class CommitRow:
    id: ObjectId
    commit: Commit
    parent: ObjectId | None  # the first parent the figures compare with (None: a root)
    sizes: CommitSizes
    stored_bytes: int  # on-disk size of every object this commit's files name
    torch_save_bytes: int  # estimate: what torch.save of its tensors would write
    stats: dict[TensorKey, TensorStats]
    lane: str = ""  # the branch (lane) whose columns it is drawn in
    label: str = ""  # its column label: lane, run counter or position, short id


@dataclass(frozen=True)
class Flag:
    kind: str  # "non-finite", "exploding", "vanishing", "frozen changed"
    commit: ObjectId
    tensor: TensorKey
    detail: str


@dataclass(frozen=True)
class Series:
    lane: str
    ids: list[ObjectId]  # the lane's commits that record the metric, oldest first
    x: list[float]  # their run counter (``Metric.x_label``) or position in the lane
    values: list[float]
    fork: int | None  # index of the lane's fork commit in this series, when it records the metric


@dataclass(frozen=True)
class Metric:
    name: str
    maximize: bool
    series: list[Series]  # one curve per lane
    best: ObjectId
    best_value: float
    x_label: str  # "step", "epoch"… when every point records it, else "commit"


@dataclass
class ReportData:
    commits: list[CommitRow]  # lane by lane, each lane's own commits oldest first
    groups: Groups  # heatmap and table rows: modules, optimizer state per parameter, counters
    metrics: list[Metric]
    flags: list[Flag]
    retention: list[tuple[str, int, int, int]]  # (policy, commits it deletes, bytes freed now, with --prune-now)
    branches: dict[str, ObjectId] = field(default_factory=dict)
    tags: dict[str, ObjectId] = field(default_factory=dict)
    tracking: dict[str, ObjectId] = field(default_factory=dict)  # REMOTE/BRANCH -> commit
    head: str = ""
    lanes: list[Lane] = field(default_factory=list)


def torch_save_estimate(commit: Commit) -> int:
    """Bytes ``torch.save`` of the commit's tensors (and its other files as they are) would take:
    each storage as a zip member aligned to 64 bytes (PyTorch's alignment) with its local and
    central headers, plus a pickle of the names. An estimate, to set the stored figure beside."""
    total = 0
    for f in commit.files:
        if f.kind != "safetensors":
            total += f.size
            continue
        for i, t in enumerate(f.tensors):
            member = len(f"archive/data/{i}")
            total += -(-t.nbytes // 64) * 64 + 30 + 46 + 2 * member + 64  # data, headers, extra field
            total += len(t.name) + 64  # its entry in data.pkl
    return total + 512  # data.pkl framing, version, byteorder, end of central directory


def _label(lane: Lane, entry: LogEntry) -> str:
    counter = counter_of(entry)
    where = f"{counter[0]} {counter[1]}" if counter else f"#{lane.position(entry.id)}"
    return f"{lane.name} {where} {entry.id[:7]}"


def _flags(rows: list[CommitRow]) -> list[Flag]:
    flags: list[Flag] = []
    first: dict[TensorKey, float] = {}
    peak: dict[TensorKey, float] = {}
    still: dict[TensorKey, int] = {}  # commits in a row without change
    for row in rows:
        for key, s in row.stats.items():
            if s.nonfinite:
                flags.append(Flag("non-finite", row.id, key, f"{s.nonfinite} NaN/inf value(s)"))
            if s.l2 is not None:
                start = first.setdefault(key, s.l2)
                if start > 0 and s.l2 > EXPLODING * start:
                    flags.append(
                        Flag("exploding", row.id, key, f"norm {s.l2:.4g}, {s.l2 / start:.3g}x its first {start:.4g}")
                    )
                top = peak.get(key, 0.0)
                if top > 0 and s.l2 < VANISHING * top:
                    flags.append(
                        Flag("vanishing", row.id, key, f"norm {s.l2:.4g}, below {VANISHING:g} of its peak {top:.4g}")
                    )
                peak[key] = max(top, s.l2)
            if s.change == 0.0:
                still[key] = still.get(key, 0) + 1
            elif s.change is not None:
                if still.get(key, 0) >= FROZEN_RUN:
                    flags.append(
                        Flag(
                            "frozen changed",
                            row.id,
                            key,
                            f"changed by {s.change:.3g} after {still[key]} commits without change",
                        )
                    )
                still[key] = 0
    return flags


def _x(lane: Lane, entry: LogEntry, x_label: str) -> float:
    counter = counter_of(entry)
    return float(counter[1]) if counter and x_label != "commit" else float(lane.position(entry.id))


def _metrics(ways: list[Lane]) -> list[Metric]:
    entries = {e.id: e for lane in ways for e in lane.history}
    values: dict[str, dict[ObjectId, float]] = {}  # metric -> commit -> value
    for e in entries.values():
        for key in e.commit.decoded_metadata():
            value = metric_value(e, key) if key not in COUNTERS else None
            if value is not None:
                values.setdefault(key, {})[e.id] = value
    out = []
    for name, by_id in values.items():
        if len(by_id) < 2:
            continue  # a single point: no curve
        maximize = bool(_HIGHER_IS_BETTER.search(name))
        keys = {c[0] if (c := counter_of(entries[oid])) else None for oid in by_id}
        named = {k for k in keys if k is not None}
        x_label = next(iter(named)) if len(keys) == 1 and named else "commit"
        series = []
        for lane in ways:
            mine = [e for e in lane.history if e.id in by_id]
            fork = next((i for i, e in enumerate(mine) if e.id == lane.fork), None)
            xs = [_x(lane, e, x_label) for e in mine]
            series.append(Series(lane.name, [e.id for e in mine], xs, [by_id[e.id] for e in mine], fork))
        # Ties go to the newer commit, as ``ckstore best`` decides them.
        top = max(by_id, key=lambda oid: (by_id[oid] if maximize else -by_id[oid], entries[oid].commit.timestamp))
        out.append(Metric(name, maximize, series, top, by_id[top], str(x_label)))
    return out


def _retention(ctx: RepoContext, count: int, metrics: list[Metric]) -> list[tuple[str, int, int, int]]:
    policies: list[tuple[str, RetentionPolicy]] = [
        (f"--keep-last {n}", RetentionPolicy(keep_last=n)) for n in (1, 3, 10) if n < count
    ]
    if metrics:
        m = metrics[0]
        policies += [
            (
                f"--keep-best {n} --metric {m.name}{' --max' if m.maximize else ''}",
                RetentionPolicy(keep_best=n, metric=m.name, maximize=m.maximize),
            )
            for n in (1, 3)
            if n < count
        ]
    out = []
    for label, policy in policies:
        now = collect_garbage(ctx, policy, dry_run=True, force=True)
        expired = collect_garbage(ctx, policy, dry_run=True, force=True, prune_now=True)
        out.append((label, len(now.pruned_commits), now.freed_bytes, expired.freed_bytes))
    return out


def gather(ctx: RepoContext, refs: Sequence[str]) -> ReportData:
    """Everything the report shows about the commits reachable from ``refs`` (default HEAD)."""
    ways = lanes(ctx.graph, refs or ["HEAD"])
    entries = {e.id: e for lane in ways for e in lane.history}
    order = [(lane, entries[oid]) for lane in ways for oid in lane.own]
    sizes = commit_sizes(ctx, [e.id for _, e in order])
    rows: list[CommitRow] = []
    for lane, e in order:
        parent = e.commit.parents[0] if e.commit.parents and ctx.store.has(e.commit.parents[0]) else None
        parent_commit = ctx.graph.read_commit(parent) if parent else None
        rows.append(
            CommitRow(
                e.id,
                e.commit,
                parent,
                sizes[e.id],
                stored_bytes(ctx.store, {c.id for c in e.commit.all_chunks()}),
                torch_save_estimate(e.commit),
                commit_stats(ctx.store, e.commit, parent_commit, (e.id, parent) if parent else None),
                lane.name,
                _label(lane, e),
            )
        )
    metrics = _metrics(ways)
    return ReportData(
        rows,
        group(r.commit for r in rows),
        metrics,
        _flags(sorted(rows, key=lambda r: (r.commit.timestamp, r.id))),
        _retention(ctx, len(rows), metrics),
        branches=ctx.refs.list(HEADS),
        tags=ctx.refs.list(TAGS),
        tracking=ctx.refs.list(REMOTES),
        head=ctx.refs.head_branch(),
        lanes=ways,
    )


def group_change(rows: list[CommitRow], index: int, members: Sequence[TensorKey]) -> float | None:
    """A module's relative change at commit ``index``: ||Δ|| / ||parent|| over all its tensors
    together (each tensor's ||Δ||² is its change² × its parent's norm²); None if any is unknown.
    Give it ``Groups.changing(members)``: a counter's change is no change of the module."""
    row = rows[index]
    parent = next((r for r in rows if r.id == row.parent), None)
    if parent is None:
        return None
    diff_sq = base_sq = 0.0
    present = False
    for key in members:
        s, p = row.stats.get(key), parent.stats.get(key)
        if s is None or p is None:
            continue
        if s.change is None or p.l2 is None:
            return None
        present = True
        diff_sq += (s.change * p.l2) ** 2
        base_sq += p.l2**2
    if not present:
        return None
    if base_sq == 0.0:
        return 0.0 if diff_sq == 0.0 else None
    return math.sqrt(diff_sq / base_sq)
