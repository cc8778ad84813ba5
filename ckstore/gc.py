"""Garbage collection: retention of commits, then removal of every object no kept commit needs.

gc holds the repository lock exclusively for its whole run, while every commit holds it shared
from its first object write to its ref update. So gc never sees a half-written commit, and never
deletes an object that a running commit is about to reference (docs/design.md explains why a
lock was chosen over git's grace period). Order: the ``pruned`` list is written before any
object is deleted, so an interrupted gc leaves history that reads correctly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .ids import ObjectId
from .overlay import external_needs
from .retention import RetentionPolicy, select_kept

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


def collect_garbage(repo: Repo, policy: RetentionPolicy | None = None, dry_run: bool = False) -> GcReport:
    policy = policy or RetentionPolicy()
    policy.validate()
    report = GcReport(dry_run)
    with repo.backend.repo_lock(exclusive=True, timeout=GC_LOCK_TIMEOUT):
        reachable = set(repo.reachable_commits())
        keep = select_kept(repo, policy) if policy.active else set(reachable)
        needed_commits, needed_objects = external_needs(repo)
        keep = _with_bases(repo, keep | {c for c in needed_commits if repo.store.has_local(c)})
        report.pruned_commits = sorted(reachable - keep)
        live: set[str] = set(keep) | needed_objects
        pruned_parents: set[ObjectId] = set()
        for oid in keep:
            commit = repo.read_commit(oid)
            live.update(c.id for c in commit.all_chunks())
            pruned_parents.update(p for p in commit.parents if p not in keep)
        victims = [oid for oid in repo.store.iter_ids() if oid not in live]
        report.deleted_objects = len(victims)
        report.freed_bytes = sum(repo.store.stored_size(oid) or 0 for oid in victims)
        if dry_run:
            return report
        repo.write_pruned(pruned_parents)
        for oid in victims:
            repo.store.delete(oid)
        report.temp_files = repo.backend.clean_temporary()
    return report
