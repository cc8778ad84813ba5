"""``ckstore status``: where HEAD is, what is pending, what storage holds, which links and remotes lag.

Everything is read from refs, manifests and object headers (no chunk is decoded), so it answers in
the time ``stats`` takes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ckstore.errors import LockedError
from ckstore.format.ids import ObjectId
from ckstore.maintenance import sizes
from ckstore.repository.refs import REMOTES
from ckstore.repository.context import RepoContext
from ckstore.repository.refs import HEADS


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


def compaction_running(ctx: RepoContext) -> bool:
    """Whether a compaction holds ``compact.lock`` now (this process's own compactions finish first)."""
    try:
        with ctx.backend.compaction_lock(timeout=0):
            return False
    except LockedError:
        return True


def _counts(ctx: RepoContext, local: ObjectId | None, tracking: ObjectId) -> tuple[int, int]:
    if local is None:
        return 0, 0
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
    return Status(branch, ctx.refs.read(HEADS + branch), compaction_running(ctx), sizes.stats(ctx), bases,
                  dict(remotes), tracking)
