"""Garbage collection: reflog expiry and retention of commits, then removal of every object no
kept commit needs.

gc holds the repository lock exclusively for its whole run, while every commit holds it shared
from its first object write to its ref update. So gc never sees a half-written commit, and never
deletes an object that a running commit is about to reference (docs/design.md explains why a
lock was chosen over git's grace period). Order: the ``pruned`` list and the expired reflogs are
written before any object is deleted, so an interrupted gc leaves history that reads correctly
and no reflog entry naming a deleted commit.

What is kept: every commit reachable from a branch or tag (or, with a retention policy, what the
policy selects there), and every commit an unexpired reflog entry names, with its history (so
a deleted branch or a reset can be undone until the entry expires; reflog.py). A gc that would
leave no commit at all refuses without ``force``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ckstore.errors import ForceRequiredError
from ckstore.format.ids import ObjectId
from ckstore.maintenance import sizes
from ckstore.maintenance.kept import kept_commits, live_objects
from ckstore.maintenance.retention import RetentionPolicy
from ckstore.repository.change_record import prune_records
from ckstore.repository.context import RepoContext

if TYPE_CHECKING:
    from ckstore.runtime.progress import ProgressFactory


@dataclass
class GcReport:
    dry_run: bool
    pruned_commits: list[ObjectId] = field(default_factory=list)  # deleted by the retention policy
    unreachable_commits: list[ObjectId] = field(default_factory=list)  # deleted: nothing names them any more
    reflog_commits: list[ObjectId] = field(default_factory=list)  # kept only because the reflog names them
    overlay_commits: list[ObjectId] = field(default_factory=list)  # outside the policy, kept: overlays' bases
    expired_entries: int = 0  # reflog entries dropped
    deletes_every_commit: bool = False  # no commit is left (refused without force)
    deleted_objects: int = 0
    freed_bytes: int = 0  # "stored" bytes of the deleted objects (docs/design.md, "Size figures") + temp_bytes
    temp_files: int = 0  # temporary files left by interrupted writes (a killed commit's pack), deleted
    temp_bytes: int = 0


def collect_garbage(
    ctx: RepoContext,
    policy: RetentionPolicy | None = None,
    dry_run: bool = False,
    repack: bool = False,
    prune_now: bool = False,
    force: bool = False,
    progress: ProgressFactory | None = None,
) -> GcReport:
    """Expire reflog entries, prune commits the policy drops and delete every object no kept
    commit needs.

    Kept deltas keep their bases. With ``repack`` the kept chunks are re-encoded first (newest
    whole, see repack.py), so bases that only pruned commits needed can go too. ``prune_now``
    expires every reflog entry whose commits the ref no longer reaches, whatever its age.
    """
    policy = policy or RetentionPolicy()
    policy.validate()
    report = GcReport(dry_run)
    started = time.time()
    graph, store = ctx.graph, ctx.store
    with ctx.backend.exclusive_lock():
        if not dry_run:
            ctx.backend.unpack()  # repack rewrites large objects, which rest loose (backend/local_settle.py)
        kept = kept_commits(ctx, policy, prune_now)
        report.pruned_commits = sorted(kept.reachable - kept.commits)
        report.reflog_commits = sorted(kept.logged - kept.reachable)
        report.overlay_commits = sorted((kept.pinned & kept.reachable) - kept.chosen)
        if not kept.commits and not force and not dry_run:
            _refuse_deleting_every_commit(ctx, prune_now)
        report.expired_entries = sum(len(kept.logs[ref]) - len(kept.alive[ref]) for ref in kept.logs)
        if repack and not dry_run:
            from ckstore.maintenance.repack import repack_locked  # gc --repack only: status and stats use gc's kept set

            repack_locked(ctx, kept.commits, progress)
        pruned = graph.pruned_after(kept.commits, kept.reachable | kept.logged)
        live = live_objects(ctx, kept)
        stored = store.stored_sizes()
        victims = {oid: size for oid, size in stored.items() if oid not in live}
        by_policy = set(report.pruned_commits)
        report.unreachable_commits = sorted(store.commits_among([v for v in victims if v not in by_policy]))
        report.deletes_every_commit = not kept.commits and bool(report.pruned_commits or report.unreachable_commits)
        report.deleted_objects = len(victims)
        temporaries = ctx.backend.temporary_sizes()  # all leftovers: no writer holds the lock now
        report.temp_files, report.temp_bytes = len(temporaries), sum(temporaries)
        report.freed_bytes = sum(victims.values()) + report.temp_bytes
        if dry_run:
            return report
        graph.write_pruned(pruned)
        for ref, entries in kept.alive.items():
            if len(entries) != len(kept.logs[ref]):
                ctx.refs.logs.rewrite(ref, entries)
        # Packed victims leave with their packs' rewrite, before the loose ones are deleted; the
        # loose small objects that stay are gathered into that pack (backend/local_settle.py).
        ctx.backend.unpack(drop=victims.keys(), gather=repack)
        bar = progress(report.freed_bytes - report.temp_bytes, "gc") if progress and victims else None
        try:
            for oid, size in victims.items():
                store.delete(oid)
                if bar:
                    bar.update(size)
        finally:
            if bar:
                bar.close()
        prune_records(ctx.backend, kept.commits)  # the change records of deleted commits (format.md 5.2)
        ctx.backend.clean_temporary()
        # status right after shows exact figures at once (sizes.record_after_gc), still under the
        # lock: nothing else can change the store before they are keyed to its state.
        sizes.record_after_gc(ctx, kept, live, {oid: n for oid, n in stored.items() if oid not in victims}, started)
    return report


def _refuse_deleting_every_commit(ctx: RepoContext, prune_now: bool) -> None:
    commits = len(ctx.store.commits_among(list(ctx.store.iter_ids())))
    if commits:
        why = (
            "--prune-now expires the reflog entries that name them"
            if prune_now
            else "no branch, tag or unexpired reflog entry names any of them"
        )
        raise ForceRequiredError(
            f"gc would delete every commit of this repository ({commits}): {why}; restore a branch first"
            " ('ckstore reflog' lists earlier values, 'ckstore branch NAME ID' names one) or pass --force"
        )
