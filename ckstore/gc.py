"""Garbage collection: retention of commits, then removal of every object no kept commit needs.

gc holds the repository lock exclusively for its whole run, while every commit holds it shared
from its first object write to its ref update. So gc never sees a half-written commit, and never
deletes an object that a running commit is about to reference (docs/design.md explains why a
lock was chosen over git's grace period). Order: the ``pruned`` list is written before any
object is deleted, so an interrupted gc leaves history that reads correctly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .context import RepoContext
from .ids import ObjectId
from .overlay import external_needs
from .pipeline import ProgressFactory
from .repack import repack_locked
from .retention import RetentionPolicy, select_kept


@dataclass
class GcReport:
    dry_run: bool
    pruned_commits: list[ObjectId] = field(default_factory=list)  # deleted by the retention policy
    deleted_objects: int = 0
    freed_bytes: int = 0  # "stored" bytes of the deleted objects (docs/design.md, "Size figures")
    temp_files: int = 0


@dataclass(frozen=True)
class Kept:
    """The commits gc keeps, and why; what they need is ``live_objects``."""

    reachable: set[ObjectId]
    chosen: set[ObjectId]  # kept by the policy (without one: every reachable commit)
    pinned: set[ObjectId]  # needed by dependent (overlay) repositories, whatever the policy
    commits: set[ObjectId]  # chosen + pinned + the in-repository bases of kept overlays
    external: set[str]  # local objects that dependent repositories need


def kept_commits(ctx: RepoContext, policy: RetentionPolicy) -> Kept:
    graph, store = ctx.graph, ctx.store
    reachable = set(graph.reachable_commits())
    chosen = select_kept(graph, policy) if policy.active else set(reachable)
    needed_commits, needed_objects = external_needs(ctx)
    pinned = {c for c in needed_commits if store.has_local(c)}
    return Kept(reachable, chosen, pinned, graph.with_overlay_bases(chosen | pinned),
                {c for c in needed_objects if store.has_local(c)})


def live_objects(ctx: RepoContext, kept: Kept) -> set[str]:
    """Every object the kept commits need: themselves, their chunks, and kept deltas' bases."""
    chunks = set(kept.external)
    for oid in kept.commits:
        chunks.update(c.id for c in ctx.graph.read_commit(oid).all_chunks())
    return ctx.store.with_delta_bases(chunks) | kept.commits


def collect_garbage(
    ctx: RepoContext, policy: RetentionPolicy | None = None, dry_run: bool = False, repack: bool = False,
    progress: ProgressFactory | None = None,
) -> GcReport:
    """Prune commits the policy drops and delete every object no kept commit needs.

    Kept deltas keep their bases. With ``repack`` the kept chunks are re-encoded first (newest
    whole, see repack.py), so bases that only pruned commits needed can go too.
    """
    policy = policy or RetentionPolicy()
    policy.validate()
    report = GcReport(dry_run)
    graph, store = ctx.graph, ctx.store
    with ctx.backend.exclusive_lock():
        kept = kept_commits(ctx, policy)
        report.pruned_commits = sorted(kept.reachable - kept.commits)
        if repack and not dry_run:
            repack_locked(ctx, kept.commits, progress)
        pruned = graph.pruned_after(kept.commits, kept.reachable)
        live = live_objects(ctx, kept)
        victims = {oid: store.stored_size(oid) or 0 for oid in store.iter_ids() if oid not in live}
        report.deleted_objects = len(victims)
        report.freed_bytes = sum(victims.values())
        if dry_run:
            return report
        graph.write_pruned(pruned)
        bar = progress(report.freed_bytes, "gc") if progress and victims else None
        try:
            for oid, size in victims.items():
                store.delete(oid)
                if bar:
                    bar.update(size)
        finally:
            if bar:
                bar.close()
        report.temp_files = ctx.backend.clean_temporary()
    return report
