"""Garbage collection: reflog expiry and retention of commits, then removal of every object no
kept commit needs. In two parts, as restic's prune: a plan, then its execution.

``plan_gc`` decides, under the shared repository lock (beside running commits and compactions,
waiting only for another gc or repack, and saying so): which commits the policy drops, which
reflog entries expire, which objects go and the bytes that frees. ``gc --dry-run``, the report's
retention preview and every figure of what gc would free ask only for a plan. Executing takes
the exclusive lock, which every commit holds shared from its first object write to its ref
update, so gc never sees a half-written commit, and re-validates the plan there: when the
repository changed since the plan was made (a commit landed, a ref moved, a compaction re-encoded
objects), the plan is made again under the exclusive lock; what gc deletes is always decided
under the lock it deletes under (docs/design.md explains why a lock was chosen over git's grace
period).

Order, so that gc can be stopped anywhere: temporary leftovers go first (no one needs them, and
on a full disk they are the space the rest needs); the ``pruned`` list and the expired reflogs
are written before any object is deleted (history reads correctly, no reflog entry names a
deleted commit); then the victims go dependents first (deletion.py): commits before their
chunks and parents, deltas before their bases, so what is left at any instant decodes and a
commit left has its chunks.

What is kept: every commit reachable from a branch or tag (or, with a retention policy, what the
policy selects there), and every commit an unexpired reflog entry names, with its history (so
a deleted branch or a reset can be undone until the entry expires; reflog.py). A gc that would
leave no commit at all refuses without ``force``, as does a ``--keep-best`` that cannot rank the
commits it would delete (retention.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from ckstore.errors import ForceRequiredError, LockedError, StorageError
from ckstore.format.ids import ObjectId
from ckstore.maintenance import sizes
from ckstore.maintenance.deletion import delete_in_order
from ckstore.maintenance.kept import Kept, kept_commits, live_objects
from ckstore.maintenance.retention import RetentionPolicy
from ckstore.repository.change_record import prune_records
from ckstore.repository.context import RepoContext
from ckstore.repository.graph import ROOT_PREFIXES
from ckstore.runtime.progress import watching

if TYPE_CHECKING:
    from ckstore.runtime.progress import ProgressFactory

# Told when gc must wait for the repository lock (the CLI prints it).
Notify = Callable[[str], object]


@dataclass
class GcReport:
    dry_run: bool
    pruned_commits: list[ObjectId] = field(default_factory=list)  # deleted by the retention policy
    unreachable_commits: list[ObjectId] = field(default_factory=list)  # deleted: nothing names them any more
    reflog_commits: list[ObjectId] = field(default_factory=list)  # kept only because the reflog names them
    overlay_commits: list[ObjectId] = field(default_factory=list)  # outside the policy, kept: overlays' bases
    unranked_commits: list[ObjectId] = field(default_factory=list)  # dropped by --keep-best without a value
    expired_entries: int = 0  # reflog entries dropped
    deletes_every_commit: bool = False  # no commit is left (refused without force)
    deleted_objects: int = 0
    freed_bytes: int = 0  # "stored" bytes of the deleted objects (docs/design.md, "Size figures") + temp_bytes
    temp_files: int = 0  # temporary files left by interrupted writes (a killed commit's pack), deleted
    temp_bytes: int = 0
    left_objects: int = 0  # victims left for want of space (a full disk): the next gc takes them
    left_bytes: int = 0
    no_space: str = ""  # the error that left them


@dataclass
class GcPlan:
    """What a gc would do, decided from the repository as it was when ``signature`` was taken."""

    report: GcReport  # the figures as a dry run states them
    kept: Kept
    pruned: dict[ObjectId, tuple[ObjectId, ...]]  # the ``pruned`` record after the run
    live: set[str]
    stored: dict[ObjectId, int]  # every object with its stored size
    victims: dict[ObjectId, int]  # the objects that go
    victim_commits: AbstractSet[str]
    signature: object  # the repository's state (refs, objects, reflogs) before the plan was made
    taken: float  # when: a change from then on makes the signature differ (or be None)


def plan_gc(
    ctx: RepoContext,
    policy: RetentionPolicy | None = None,
    prune_now: bool = False,
    force: bool = False,
    notify: Notify | None = None,
) -> GcPlan:
    """What gc would delete and free, decided under the shared repository lock."""
    with _lock(ctx, exclusive=False, notify=notify):
        return _plan(ctx, policy or RetentionPolicy(), prune_now, force, dry_run=True)


def collect_garbage(
    ctx: RepoContext,
    policy: RetentionPolicy | None = None,
    dry_run: bool = False,
    repack: bool = False,
    prune_now: bool = False,
    force: bool = False,
    progress: ProgressFactory | None = None,
    notify: Notify | None = None,
) -> GcReport:
    """Expire reflog entries, prune commits the policy drops and delete every object no kept
    commit needs (``dry_run``: only say so, from a plan).

    Kept deltas keep their bases. With ``repack`` the kept chunks are re-encoded first (newest
    whole, see repack.py), so bases that only pruned commits needed can go too. ``prune_now``
    expires every reflog entry whose commits the ref no longer reaches, whatever its age.
    """
    policy = policy or RetentionPolicy()
    policy.validate()
    # First under the shared lock: a refusal comes at once, without waiting for running commits.
    plan = plan_gc(ctx, policy, prune_now, force, notify)
    if dry_run:
        return plan.report
    _refusals(ctx, plan, policy, prune_now, force)
    with _lock(ctx, exclusive=True, notify=notify):
        started = time.time()
        # Re-validated: a change since the plan (a commit landed, a ref moved, a compaction
        # re-encoded) means it is made again, here, under the lock gc deletes under.
        if plan.signature is None or plan.signature != _signature(ctx, plan.taken):
            plan = _plan(ctx, policy, prune_now, force, dry_run=False)
        if repack:
            from ckstore.maintenance.repack import repack_locked  # gc --repack only: status and stats use gc's kept set

            ctx.backend.unpack()  # repack rewrites large objects, which rest loose (backend/local_settle.py)
            repack_locked(ctx, plan.kept.commits, progress)
            plan = _plan(ctx, policy, prune_now, force, dry_run=False)  # bases only pruned commits needed go too
        return _execute(ctx, plan, repack, progress, started)


def _plan(ctx: RepoContext, policy: RetentionPolicy, prune_now: bool, force: bool, dry_run: bool) -> GcPlan:
    """The plan; the caller holds a repository lock (shared for a plan, exclusive to execute)."""
    policy.validate()
    taken = time.time()
    signature = _signature(ctx, taken)
    report = GcReport(dry_run)
    graph, store = ctx.graph, ctx.store
    kept = kept_commits(ctx, policy, prune_now)
    if kept.selection is not None:
        kept.selection.check(policy, force=True)  # a metric nothing records: even a dry run refuses
        report.unranked_commits = sorted({c for ids in kept.selection.unranked.values() for c in ids})
    report.pruned_commits = sorted(kept.reachable - kept.commits)
    report.reflog_commits = sorted(kept.logged - kept.reachable)
    report.overlay_commits = sorted((kept.pinned & kept.reachable) - kept.chosen)
    report.expired_entries = sum(len(kept.logs[ref]) - len(kept.alive[ref]) for ref in kept.logs)
    live = live_objects(ctx, kept)
    stored = store.stored_sizes()
    victims = {oid: size for oid, size in stored.items() if oid not in live}
    by_policy = set(report.pruned_commits)
    victim_commits = store.commits_among(list(victims))
    report.unreachable_commits = sorted(c for c in victim_commits if c not in by_policy)
    report.deletes_every_commit = not kept.commits and bool(report.pruned_commits or report.unreachable_commits)
    report.deleted_objects = len(victims)
    temporaries = ctx.backend.temporary_sizes()  # under the shared lock some may be a running write's
    report.temp_files, report.temp_bytes = len(temporaries), sum(temporaries)
    report.freed_bytes = sum(victims.values()) + report.temp_bytes
    pruned = graph.pruned_after(kept.commits, kept.reachable | kept.logged)
    plan = GcPlan(report, kept, pruned, live, stored, victims, victim_commits, signature, taken)
    if not dry_run:
        _refusals(ctx, plan, policy, prune_now, force)
    return plan


def _refusals(ctx: RepoContext, plan: GcPlan, policy: RetentionPolicy, prune_now: bool, force: bool) -> None:
    """What a gc (not a dry run, which shows what a forced run would delete) refuses without
    ``force``: deleting every commit, or commits --keep-best cannot rank."""
    if plan.kept.selection is not None:
        plan.kept.selection.check(policy, force)
    if not plan.kept.commits and not force:
        _refuse_deleting_every_commit(ctx, prune_now)


def _execute(
    ctx: RepoContext, plan: GcPlan, repack: bool, progress: ProgressFactory | None, started: float
) -> GcReport:
    """Carry out ``plan`` under the exclusive lock (module docstring: the order)."""
    report, kept = plan.report, plan.kept
    report.dry_run = False
    # First, the space the writes below need on a full disk: temporary leftovers and the
    # reserve set aside for this moment (set aside again at the end, space allowing).
    temporaries = ctx.backend.temporary_sizes()  # all leftovers now: no writer holds the lock
    report.temp_files, report.temp_bytes = len(temporaries), sum(temporaries)
    ctx.backend.clean_temporary()
    ctx.backend.release_reserve()
    if plan.pruned != ctx.graph.pruned():
        ctx.graph.write_pruned(plan.pruned)
    for ref, entries in kept.alive.items():
        if len(entries) != len(kept.logs[ref]):
            ctx.refs.logs.rewrite(ref, entries)
    freed = sum(plan.victims.values())
    with watching(progress if plan.victims else None, freed, "gc") as advance:
        # Read-only by id: a mapping keyed by ObjectId serves where text keys are asked for.
        deleted = delete_in_order(ctx, cast(Mapping[str, int], plan.victims), plan.victim_commits, advance)
    report.deleted_objects = len(plan.victims) - len(deleted.left)
    report.left_objects, report.left_bytes, report.no_space = (
        len(deleted.left),
        sum(deleted.left.values()),
        deleted.no_space,
    )
    report.freed_bytes = report.temp_bytes + freed - report.left_bytes
    prune_records(ctx.backend, kept.commits)  # the change records of deleted commits (format.md 5.2)
    _settle_after(ctx, repack)
    ctx.backend.keep_reserve()
    # status right after shows exact figures at once (sizes.record_after_gc), still under the
    # lock: nothing else can change the store before they are keyed to its state.
    gone = plan.victims.keys() - deleted.left.keys()
    remaining = {oid: n for oid, n in plan.stored.items() if oid not in gone}
    sizes.record_after_gc(ctx, kept, plan.live | deleted.left.keys(), remaining, started)
    return report


def _settle_after(ctx: RepoContext, repack: bool) -> None:
    """Settle the packs once the victims are gone (old copies of replaced objects go too; with
    ``repack`` loose small objects are gathered). On a full disk this waits for a later gc:
    nothing depends on it, and the space deleting freed is better left to the user's next commit."""
    try:
        ctx.backend.unpack(gather=repack)
    except StorageError as exc:
        if not exc.no_space:
            raise


def _signature(ctx: RepoContext, before: float) -> object:
    """What the plan depends on: every ref (and HEAD) and the backend's state signature (object
    folders, packs, reflogs, pruned record, links, config); None when that cannot be told."""
    backend = ctx.backend.state_signature(before)
    if backend is None:
        return None
    refs = {prefix: ctx.refs.list(prefix) for prefix in ROOT_PREFIXES}
    return (backend, refs, ctx.refs.head_branch())


@contextmanager
def _lock(ctx: RepoContext, exclusive: bool, notify: Notify | None) -> Iterator[None]:
    """The repository lock; when it is not free at once, ``notify`` says what gc waits for."""
    with ExitStack() as stack:
        try:
            stack.enter_context(ctx.backend.repo_lock(exclusive=exclusive, timeout=0))
        except LockedError:
            if notify is not None:
                notify(
                    "waiting for running commits or a compaction to finish (they hold the repository lock)"
                    if exclusive
                    else "waiting for a running gc or repack to finish"
                )
            stack.enter_context(ctx.backend.exclusive_lock() if exclusive else ctx.backend.shared_lock())
        yield


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
