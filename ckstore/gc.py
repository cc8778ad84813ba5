"""Garbage collection: retention of commits, then removal of every object no kept commit needs.

gc holds the repository lock exclusively for its whole run, while every commit holds it shared
from its first object write to its ref update. So gc never sees a half-written commit, and never
deletes an object that a running commit is about to reference (docs/design.md explains why a
lock was chosen over git's grace period). Order: the ``pruned`` list is written before any
object is deleted, so an interrupted gc leaves history that reads correctly.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .errors import IntegrityError, ObjectMissingError
from .ids import ObjectId
from .overlay import external_needs
from .retention import RetentionPolicy, select_kept
from .store import ObjectStore

if TYPE_CHECKING:
    from .repo import Repo

GC_LOCK_TIMEOUT = 600.0


@dataclass
class GcReport:
    dry_run: bool
    pruned_commits: list[ObjectId] = field(default_factory=list)  # deleted by the retention policy
    deleted_objects: int = 0
    freed_bytes: int = 0
    temp_files: int = 0


def _with_bases(repo: Repo, keep: set[ObjectId]) -> set[ObjectId]:
    """``keep`` plus the base commit (in this repository) of every kept overlay, transitively."""
    todo = list(keep)
    out = set(keep)
    while todo:
        base = repo.read_commit(todo.pop()).base
        if base is not None and base["repo"] is None and base["commit"] not in out:
            out.add(ObjectId(base["commit"]))
            todo.append(ObjectId(base["commit"]))
    return out


def with_bases(store: ObjectStore, chunks: Iterable[str]) -> set[str]:
    """``chunks`` plus every delta base they need, transitively (reads object headers only)."""
    live = set(chunks)
    todo = list(live)
    while todo:
        oid = todo.pop()
        try:
            base = store.base_of(oid)
        except ObjectMissingError:
            continue  # nothing to follow; fsck reports the missing object
        except IntegrityError as exc:
            # Without its header we cannot know what it needs, so deleting anything could lose
            # data: stop rather than guess.
            raise IntegrityError(f"{exc}; gc stopped, run 'ckstore fsck'") from None
        if base is not None and base not in live:
            live.add(base)
            todo.append(base)
    return live


def _pruned_after(repo: Repo, keep: set[ObjectId], reachable: set[ObjectId]) -> dict[ObjectId, tuple[ObjectId, ...]]:
    """The ``pruned`` record after this gc: every deleted commit that a kept commit still reaches
    through its parents, with the deleted commit's own parents, so history stays connected."""
    graph = dict(repo.pruned())
    for oid in reachable - keep:
        graph[oid] = repo.read_commit(oid).parents
    out: dict[ObjectId, tuple[ObjectId, ...]] = {}
    todo = [p for oid in keep for p in repo.read_commit(oid).parents]
    while todo:
        oid = todo.pop()
        if oid in graph and oid not in out:
            out[oid] = graph[oid]
            todo.extend(graph[oid])
    return out


def collect_garbage(
    repo: Repo, policy: RetentionPolicy | None = None, dry_run: bool = False, repack: bool = False,
) -> GcReport:
    """Prune commits the policy drops and delete every object no kept commit needs.

    Kept deltas keep their bases. With ``repack`` the kept chunks are re-encoded first (newest
    whole, see repack.py), so bases that only pruned commits needed can go too.
    """
    policy = policy or RetentionPolicy()
    policy.validate()
    report = GcReport(dry_run)
    with repo.backend.repo_lock(exclusive=True, timeout=GC_LOCK_TIMEOUT):
        reachable = set(repo.reachable_commits())
        keep = select_kept(repo, policy) if policy.active else set(reachable)
        needed_commits, needed_objects = external_needs(repo)
        keep = _with_bases(repo, keep | {c for c in needed_commits if repo.store.has_local(c)})
        report.pruned_commits = sorted(reachable - keep)
        if repack and not dry_run:
            from .repack import repack_locked

            repack_locked(repo, keep)
        chunks: set[str] = {c for c in needed_objects if repo.store.has_local(c)}
        for oid in keep:
            chunks.update(c.id for c in repo.read_commit(oid).all_chunks())
        pruned = _pruned_after(repo, keep, reachable)
        live = with_bases(repo.store, chunks) | set(keep)
        victims = [oid for oid in repo.store.iter_ids() if oid not in live]
        report.deleted_objects = len(victims)
        report.freed_bytes = sum(repo.store.stored_size(oid) or 0 for oid in victims)
        if dry_run:
            return report
        repo.write_pruned(pruned)
        for oid in victims:
            repo.store.delete(oid)
        report.temp_files = repo.backend.clean_temporary()
    return report
