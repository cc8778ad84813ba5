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

from .errors import IntegrityError, InvalidInputError, ObjectMissingError
from .ids import ObjectId
from .refs import HEADS
from .store import ObjectStore

if TYPE_CHECKING:
    from .repo import Repo

GC_LOCK_TIMEOUT = 600.0


@dataclass(frozen=True)
class RetentionPolicy:
    """Which commits survive; ``None`` everywhere keeps every commit reachable from a ref."""

    keep_last: int | None = None

    def validate(self) -> None:
        if self.keep_last is not None and self.keep_last < 1:
            raise InvalidInputError("--keep-last must be at least 1")

    @property
    def active(self) -> bool:
        return self.keep_last is not None


@dataclass
class GcReport:
    dry_run: bool
    pruned_commits: list[ObjectId] = field(default_factory=list)  # deleted by the retention policy
    deleted_objects: int = 0
    freed_bytes: int = 0
    temp_files: int = 0


def select_kept(repo: Repo, policy: RetentionPolicy) -> set[ObjectId]:
    """Commits the policy keeps: per branch the newest ``keep_last``, plus every tagged commit."""
    keep = set(repo.tags().values())
    for name in repo.branches():
        history = [entry.id for entry in repo.log(HEADS + name)]
        keep.update(history[: policy.keep_last])
    return keep


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
        keep = select_kept(repo, policy) if policy.active else reachable
        report.pruned_commits = sorted(reachable - keep)
        if repack and not dry_run:
            from .repack import repack_locked

            repack_locked(repo, keep)
        chunks: set[str] = set()
        pruned_parents: set[ObjectId] = set()
        for oid in keep:
            commit = repo.read_commit(oid)
            chunks.update(c.id for c in commit.all_chunks())
            pruned_parents.update(p for p in commit.parents if p not in keep)
        live = with_bases(repo.store, chunks) | set(keep)
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
