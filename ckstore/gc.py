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
from .repack import repack_locked
from .retention import RetentionPolicy, select_kept


@dataclass
class GcReport:
    dry_run: bool
    pruned_commits: list[ObjectId] = field(default_factory=list)  # deleted by the retention policy
    deleted_objects: int = 0
    freed_bytes: int = 0
    temp_files: int = 0


def collect_garbage(
    ctx: RepoContext, policy: RetentionPolicy | None = None, dry_run: bool = False, repack: bool = False,
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
        reachable = set(graph.reachable_commits())
        keep = select_kept(graph, policy) if policy.active else set(reachable)
        needed_commits, needed_objects = external_needs(ctx)
        keep = graph.with_overlay_bases(keep | {c for c in needed_commits if store.has_local(c)})
        report.pruned_commits = sorted(reachable - keep)
        if repack and not dry_run:
            repack_locked(ctx, keep)
        chunks: set[str] = {c for c in needed_objects if store.has_local(c)}
        for oid in keep:
            chunks.update(c.id for c in graph.read_commit(oid).all_chunks())
        pruned = graph.pruned_after(keep, reachable)
        live = store.with_delta_bases(chunks) | set(keep)
        victims = [oid for oid in store.iter_ids() if oid not in live]
        report.deleted_objects = len(victims)
        report.freed_bytes = sum(store.stored_size(oid) or 0 for oid in victims)
        if dry_run:
            return report
        graph.write_pruned(pruned)
        for oid in victims:
            store.delete(oid)
        report.temp_files = ctx.backend.clean_temporary()
    return report
