"""``gc --remote``: delete the packs of a remote that no kept commit needs, two-phase.

A remote has no lock that pushes take, so gc cannot stop the world as local gc does. Instead
(docs/design.md, "Remote gc"; docs/format.md 15.9), each run:

1. takes ``gc/lock.json`` (put-if-absent: one gc at a time; pushes never look at it), and sends
   again the objects local compaction made smaller since they were pushed (remote repack,
   repack.py), so that the packs holding their old copies hold nothing live below;
2. reads the refs and computes what is live: the commits the retention policy keeps (all
   reachable ones without a policy), their chunks, and every delta base of those as stored on
   the remote (read from the objects' headers there, since a local copy may be encoded
   differently);
3. sweeps: claims (compare-and-swap on ``gc/condemned.json``) every entry condemned at least
   ``grace`` seconds ago whose pack is still not live, deletes its index, then its pack, then
   drops the entries; entries whose packs became live again are dropped unclaimed;
4. marks: condemns every pack that holds no live object and was written more than ``grace``
   ago (a younger one may belong to a push that has not moved its ref yet), and records the
   commits the policy dropped in ``gc/pruned`` so pushes stop sending them.

Deletion therefore happens at least ``grace`` after condemnation, by a run that re-read the refs.
A push relies on a pack only after checking the list (and rescuing its entry), and it re-checks
when its last check is older than grace / 2 before moving a ref: whichever way a push and a gc
interleave, the sweep's fresh read of the refs sees any ref that names a condemned pack. A pack
holding both live and dead objects is kept whole; one whose objects a push sent again smaller
holds nothing live once they arrive (step 1), and goes the same way.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

from ckstore.backend.fsio import dead_owner, mutating_step, process_owner
from ckstore.backend.memory import MemoryBackend
from ckstore.errors import IntegrityError, LockedError
from ckstore.format.ids import ObjectId
from ckstore.format.pruned import encode_pruned
from ckstore.maintenance.retention import RetentionPolicy, select
from ckstore.remote.chains import breakers
from ckstore.remote.layout import (
    DEFAULT_GRACE,
    GC_LOCK_KEY,
    MAX_GC_LOCK,
    PACKS,
    Condemned,
    RemoteRepo,
    index_key,
    pack_key,
    retry_when_gone,
)
from ckstore.remote.lazy import RemoteObjects
from ckstore.remote.names import open_remote
from ckstore.remote.push import send_superseded
from ckstore.repository.context import RepoContext
from ckstore.repository.graph import PRUNED_KEY, CommitGraph
from ckstore.repository.refs import RefStore, encode_ref
from ckstore.repository.store import ObjectStore
from ckstore.transport.base import ObjectInfo

# S3 reports Last-Modified in whole seconds: a pack may be up to this much younger than it looks.
MTIME_RESOLUTION = 1.0


@dataclass
class RemoteGcReport:
    remote: str
    dry_run: bool
    live_objects: int = 0
    pruned_commits: list[ObjectId] = field(default_factory=list)  # dropped by the retention policy
    condemned: list[str] = field(default_factory=list)  # packs condemned by this run
    deleted: list[str] = field(default_factory=list)  # packs deleted by this run
    freed_bytes: int = 0
    rescued: list[str] = field(default_factory=list)  # condemned packs found live again
    resent_objects: int = 0  # objects sent again smaller (remote repack, repack.py)
    resent_bytes: int = 0


@contextmanager
def _gc_lock(remote: RemoteRepo) -> Iterator[None]:
    owner = json.dumps(process_owner()).encode()
    if not remote.transport.put_if_absent(GC_LOCK_KEY, owner) and not _take_over_dead_gc_lock(remote, owner):
        try:
            info = json.loads(remote.get(GC_LOCK_KEY, MAX_GC_LOCK))
            who = f" (started {time.ctime(info['time'])} by process {info['pid']} on {info['host']})"
        except (KeyError, ValueError, TypeError, IntegrityError):
            who = ""
        raise LockedError(
            f"remote {remote.name}: another remote gc is running{who}; if none is, delete "
            f"{remote.describe(GC_LOCK_KEY)}"
        )
    try:
        yield
    finally:
        remote.transport.delete(GC_LOCK_KEY)


def _take_over_dead_gc_lock(remote: RemoteRepo, owner: bytes) -> bool:
    """Take the gc lock of a remote gc killed on this machine (its process proven gone, as for
    ref locks): a compare-and-swap from the bytes judged stale to ours, so of two takers one
    wins, and a lock a live gc took meanwhile is never replaced. Every gc phase is safe to
    resume from where a killed one stopped (section "Remote gc" of docs/format.md)."""
    try:
        stale, token = remote.transport.get_versioned(GC_LOCK_KEY, MAX_GC_LOCK)
    except (KeyError, IntegrityError):
        return False
    return dead_owner(stale) is not None and remote.transport.put_if_match(GC_LOCK_KEY, owner, token)


def remote_graph(ctx: RepoContext, remote: RemoteRepo, refs: Mapping[str, str]) -> CommitGraph:
    """The remote's commit graph: its refs and pruned record in memory, commits read from the
    local store when here (same name, same bytes) and from the remote otherwise."""
    backend = MemoryBackend()
    for ref, oid in refs.items():
        backend.replace(encode_ref(ref), f"{oid}\n".encode())
    pruned = remote.read_pruned()
    if pruned:
        backend.replace(PRUNED_KEY, encode_pruned(pruned))
    store = ObjectStore(MemoryBackend(), ctx.store.settings)
    store.sources = [ctx.store, RemoteObjects(remote, ObjectStore(MemoryBackend()))]
    return CommitGraph(backend, store, RefStore(backend))


def collect_remote(
    ctx: RepoContext,
    remote_name: str | None = None,
    *,
    keep_last: int | None = None,
    keep_best: int | None = None,
    metric: str | None = None,
    maximize: bool = False,
    keep_every: int | None = None,
    grace: float = DEFAULT_GRACE,
    dry_run: bool = False,
) -> RemoteGcReport:
    policy = RetentionPolicy(keep_last, keep_best, metric, maximize, keep_every)
    policy.validate()
    remote = open_remote(ctx, remote_name)
    remote.require_format()
    report = RemoteGcReport(remote.name, dry_run)
    with _gc_lock(remote):
        if not dry_run:
            # Remote repack first: what local compaction made smaller goes up again, so the packs
            # holding the old copies hold nothing live below and go the way unreferenced ones do.
            sent = send_superseded(ctx, remote)
            report.resent_objects, report.resent_bytes = sent.objects, sent.bytes
        # A push may delete a pack it superseded while this reads (its objects are in other
        # packs): then everything is read again.
        state = retry_when_gone(lambda: _liveness(ctx, remote, policy), lambda: None)
        packs, condemned, graph, reachable, kept, live, live_packs = state
        report.pruned_commits = sorted(reachable - kept)
        report.live_objects = len(live)
        now = time.time()
        due = {
            p
            for p, (since, claimed) in condemned.packs.items()
            if p not in live_packs and (claimed or now - since >= grace)
        }
        fresh = sorted(
            p
            for p, info in packs.items()
            if p not in live_packs
            and p not in condemned.packs
            and now - info.last_modified.timestamp() - MTIME_RESOLUTION >= grace
        )
        report.rescued = sorted(p for p, (_, claimed) in condemned.packs.items() if p in live_packs and not claimed)
        report.condemned = fresh
        if dry_run:
            report.deleted = sorted(due)
            report.freed_bytes = sum(packs[p].size for p in due if p in packs)
            return report
        if policy.active and report.pruned_commits:
            # Before any pack goes: pushes stop sending these commits, fetches stop at them.
            remote.add_pruned(graph.pruned_after(kept, reachable))
        claimed = update_condemned(remote, lambda c: _claim(c, due, live_packs))
        for p in sorted(claimed):
            _delete_pack(remote, p)
            report.deleted.append(p)
            report.freed_bytes += packs[p].size if p in packs else 0
        update_condemned(remote, lambda c: _settle(c, claimed, fresh, now))
    return report


_Liveness = tuple[dict[str, ObjectInfo], Condemned, CommitGraph, set[ObjectId], set[ObjectId], set[str], set[str]]


def _liveness(ctx: RepoContext, remote: RemoteRepo, policy: RetentionPolicy) -> _Liveness:
    """(every pack key's listing, the condemned list, the remote's graph, the reachable commits,
    those the policy keeps, the live objects, the packs holding their chosen copies)."""
    refs = remote.list_refs()
    packs = {
        info.key[len(PACKS) : -len(".pack")]: info
        for info in remote.transport.list(PACKS)
        if info.key.endswith(".pack")
    }
    condemned = remote.read_condemned()
    remote.catalogue()
    # An object in a condemned pack and in another counts in the other: the condemned one may
    # go; so does a pack whose copies push has sent again smaller (repack.py).
    where = remote.locate(avoid=condemned.packs)
    graph = remote_graph(ctx, remote, refs)
    reachable = graph.reachable_from(graph.tips())
    if policy.active:
        selection = select(graph, policy)
        selection.check(policy, force=True)  # a metric no commit records ranks nothing: refused
        kept = selection.kept
    else:
        kept = reachable
    chunks = {c.id for oid in kept for c in graph.read_commit(oid).all_chunks()}
    # Where the chosen copies form a delta cycle, every copy of its objects stays: one breaks it.
    live, live_packs = breakers(remote, remote.catalogue(refresh=False), where, chunks)
    live |= kept
    live_packs |= {where[o].pack_id for o in kept if o in where}
    return packs, condemned, graph, reachable, kept, live, live_packs


def update_condemned(remote: RemoteRepo, change: Callable[[Condemned], set[str]]) -> set[str]:
    """Apply ``change`` to the condemned list by compare-and-swap until it sticks."""
    while True:
        condemned = remote.read_condemned()
        result = change(condemned)
        if remote.write_condemned(condemned):
            return result
        time.sleep(0.01)


def _claim(condemned: Condemned, due: set[str], live_packs: set[str]) -> set[str]:
    """Claim the due entries still listed (a push may have rescued some meanwhile); drop entries
    whose packs are live again."""
    for p in [p for p, (_, c) in condemned.packs.items() if p in live_packs and not c]:
        del condemned.packs[p]
    claimed = {p for p in due if p in condemned.packs}
    for p in claimed:
        condemned.packs[p] = (condemned.packs[p][0], True)
    return claimed


def _settle(condemned: Condemned, deleted: set[str], fresh: list[str], now: float) -> set[str]:
    for p in deleted:
        condemned.packs.pop(p, None)
    for p in fresh:
        condemned.packs.setdefault(p, (now, False))
    return set()


def condemn(remote: RemoteRepo, packs: set[str], now: float) -> None:
    """Add ``packs`` to the condemned list, unclaimed, as of ``now`` (an entry already listed
    keeps its older time): the first phase, the one a remote gc's mark takes."""
    update_condemned(remote, lambda c: _settle(c, set(), sorted(packs), now))


def sweep(remote: RemoteRepo, pick: Callable[[Condemned], set[str]]) -> set[str]:
    """The second phase: claim, by one compare-and-swap, the entries ``pick`` chooses from the
    list as read at that moment, delete each one's index, then its pack, then drop the entries;
    the packs deleted."""
    return delete_claimed(remote, update_condemned(remote, pick))


def delete_claimed(remote: RemoteRepo, claimed: set[str]) -> set[str]:
    """Delete each claimed pack's index, then the pack, then drop the entries; ``claimed``."""
    for p in sorted(claimed):
        _delete_pack(remote, p)
    if claimed:
        update_condemned(remote, lambda c: _settle(c, claimed, [], time.time()))
    return claimed


def _delete_pack(remote: RemoteRepo, pack_id: str) -> None:
    mutating_step()
    remote.transport.delete(index_key(pack_id))  # first: nothing names a pack that is going
    mutating_step()
    remote.transport.delete(pack_key(pack_id))
