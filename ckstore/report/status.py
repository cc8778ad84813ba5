"""``ckstore status``: where HEAD is, what is pending, what storage holds, which links and remotes lag.

Everything is read from refs and commit headers. The storage figures are ``stats``' last
measurement while the repository has not changed since (sizes_cache.py); otherwise status measures
them itself when that measurement took under ``MEASURE_SECONDS``, and else shows them as of when
they were measured: at 10^5 objects measuring costs 10 CPU seconds, a status should not.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from ckstore.compaction.at_rest import is_at_rest
from ckstore.errors import IntegrityError
from ckstore.format.ids import ObjectId
from ckstore.maintenance import sizes
from ckstore.repository.context import RepoContext
from ckstore.repository.refs import HEADS, REMOTES


@dataclass(frozen=True)
class BaseStatus:
    location: str
    reachable: bool
    reason: str = ""  # why it does not open, with the command that repairs it


@dataclass(frozen=True)
class TrackingStatus:
    remote: str
    branch: str
    tracking: ObjectId  # refs/remotes/REMOTE/BRANCH, as of the last push or fetch
    local: ObjectId | None  # the local branch of the same name, if any
    ahead: int  # commits the local branch has that the tracking ref lacks
    behind: int  # and the other way round


@dataclass(frozen=True)
class Status:
    branch: str
    head: ObjectId | None  # None: the branch has no commits yet
    compaction_running: bool  # another process holds the compaction lock
    stats: sizes.Stats
    bases: list[BaseStatus] = field(default_factory=list)
    remotes: dict[str, str] = field(default_factory=dict)  # name -> url
    tracking: list[TrackingStatus] = field(default_factory=list)
    stats_measured: float = 0.0  # when ``stats`` were measured (seconds since the epoch)
    stats_current: bool = True  # False: the repository changed since (``ckstore stats`` measures again)
    # Every chunk of HEAD's commit and its parent in its best encoding (compaction/at_rest.py):
    # False while a compaction runs, waits, or was cut short by a newer commit.
    at_rest: bool = True
    # Why the storage figures could not be measured (a damaged object: fsck names them all); "" when they were.
    storage_problem: str = ""


# status measures storage itself when the last measurement took less than this (wall seconds).
MEASURE_SECONDS = 0.25


def compaction_running(ctx: RepoContext) -> bool:
    """Whether a compaction holds ``compact.lock`` now (this process's own compactions finish first)."""
    return ctx.backend.compaction_running()


def _storage(ctx: RepoContext) -> tuple[sizes.Stats, float, bool]:
    """(figures, when measured, whether current): see the module's docstring."""
    last = sizes.last_stats(ctx)
    if last is not None:
        figures, measured, seconds, current = last
        if current or seconds >= MEASURE_SECONDS:
            return figures, measured, current
    started = time.time()
    return sizes.stats(ctx), started, True


def _counted(ctx: RepoContext, figures: sizes.Stats) -> sizes.Stats:
    """``figures`` with the commits and their logical bytes as they are now: a walk over commit
    headers (no file lists, no object sizes), cheap where a new measurement is not. The stored
    bytes and what gc would free stay as measured."""
    reachable = ctx.graph.reachable_from(ctx.graph.tips())
    logical = sum(ctx.graph.read_commit(c, files=False).logical_bytes for c in reachable)
    return replace(figures, commits=len(reachable), logical_bytes=logical)


def _first_parent_distance(ctx: RepoContext, start: ObjectId, target: ObjectId, limit: int = 1000) -> int | None:
    """Commits from ``start`` back to ``target`` when history between them is a single line of
    commits with one parent each (no merge can bring in commits the target also has), else None."""
    oid, steps = start, 0
    while oid != target and steps < limit:
        parents = ctx.graph.read_commit(oid, files=False).parents
        if len(parents) != 1 or not ctx.store.has(parents[0]):
            return None
        oid, steps = parents[0], steps + 1
    return steps if oid == target else None


def _counts(ctx: RepoContext, local: ObjectId | None, tracking: ObjectId) -> tuple[int, int]:
    if local is None:
        return 0, 0
    # The usual cases, in what they touch: up to date, or one side a few commits past the other.
    if local == tracking:
        return 0, 0
    ahead = _first_parent_distance(ctx, local, tracking)
    if ahead is not None:
        return ahead, 0
    behind = _first_parent_distance(ctx, tracking, local)
    if behind is not None:
        return 0, behind
    mine = ctx.graph.reachable_from([local])
    theirs = ctx.graph.reachable_from([tracking])
    return len(mine - theirs), len(theirs - mine)


def status(ctx: RepoContext, remotes: dict[str, str]) -> Status:
    branch = ctx.refs.head_branch()
    bases = [BaseStatus(b.location, True) for b in ctx.bases]
    bases += [BaseStatus(broken.link.location, False, str(broken)) for broken in ctx.broken_alternates]
    tracking = []
    for name in sorted(remotes):
        for remote_branch, oid in sorted(ctx.refs.list(f"{REMOTES}{name}/").items()):
            local = ctx.refs.read(HEADS + remote_branch)
            ahead, behind = _counts(ctx, local, oid)
            tracking.append(TrackingStatus(name, remote_branch, oid, local, ahead, behind))
    problem = ""
    try:
        figures, measured, current = _storage(ctx)
        if not current:
            figures = _counted(ctx, figures)
    except IntegrityError as exc:  # the branch and HEAD are still worth showing, and the damage named
        figures, measured, current, problem = sizes.Stats(0, 0, 0, 0, None, None), 0.0, False, str(exc)
    head = ctx.refs.read(HEADS + branch)
    running = compaction_running(ctx)
    return Status(
        branch,
        head,
        running,
        figures,
        bases,
        dict(remotes),
        tracking,
        measured,
        current,
        at_rest=head is None or (not running and is_at_rest(ctx.backend, head)),
        storage_problem=problem,
    )
