"""Supersession by push: a remote fed by ``ckstore push`` alone keeps the size of the local store,
right after every push.

Local compaction re-encodes each previous epoch as deltas of the next one after the push that
sent it, so a remote that kept the first copy of every object would grow by a whole epoch per
epoch. Every push therefore, after its refs moved (docs/format.md 15.9, "Supersession by push"):

1. sweeps: claims, by compare-and-swap, each entry of the condemned list that was condemned at
   least ``grace`` ago and whose pack is still superseded (below), with every pack it leans on
   still off the list; deletes its index, then its pack (``gc.sweep``); finishes the drops (3)
   a killed push left claimed; and deletes packs without an index older than twice ``grace``;
2. sends again, as stored here and verified like any push, what local compaction stores
   markedly smaller than the remote does (``repack.superseded``: what remote gc's repack sends),
   in packs of its own, and keeps the packs the new copies' delta bases are in off the list;
3. drops (``drop_superseded``) at once every pack, among those holding an object it sent, that
   is *strictly* superseded: each of its objects is held in another pack, off the list, in a
   copy strictly smaller than its own or sent by step 2 of this push, and that pack existed
   before step 2 sent anything (step 1's own packs included: compaction can re-encode smaller
   what this push sent while it was in flight); every delta base of those copies is held off the list. The
   drop claims the pack (compare-and-swap; refused when a pack it leans on is listed), checks
   that every pack it leans on still has its index, then deletes the index, then the pack;
4. condemns (``gc.condemn``) every other pack now superseded: the two-phase grace decides.

Deleting a superseded pack can only break a reader that located an object in it before: readers
(fetch, clone, lazy reads, remote gc) read the holdings again and retry when a pack they located
is gone (``layout.retry_when_gone``). Two pushers never delete each other's copies: a copy is
only dropped for a strictly smaller one, or for one sent after the dropped pack existed (of two
equal copies, at most one pusher can see the other's as older than its own), and the claim's
compare-and-swap with the check after it refuses to lean on a pack another drop took meanwhile.

A pack is *superseded* when it holds no copy anybody counts on: for each of its objects the copy
``RemoteRepo.locate`` chooses (the rule every pusher, reader and remote gc chooses by) is in
another pack, and every delta base of that copy, as stored on the remote, is held in a pack off
the list. Such a pack holds nothing the remote needs whatever the refs are, so no ref walk is
needed. A push that finds nothing new (the last epoch, after ``ckstore wait``) still does all
four, so a push that ran while the detached compaction was still re-encoding is caught up by the
next one.

``drop_superseded`` is the reusable piece: a writer that put smaller copies on the remote by
other means (remote compaction, compaction.py) drops what they replace the same way.
"""

from __future__ import annotations

import time
from collections import ChainMap
from collections.abc import Collection, Mapping, MutableMapping, Sequence
from typing import cast

from ckstore.backend.fsio import mutating_step
from ckstore.format.pack import DEFAULT_TARGET_SIZE, PackTable
from ckstore.remote.chains import chain_closure
from ckstore.remote.gc import MTIME_RESOLUTION, condemn, delete_claimed, sweep, update_condemned
from ckstore.remote.layout import (
    DEFAULT_GRACE,
    PACKS,
    Condemned,
    Holdings,
    Located,
    RemoteRepo,
    choose_copies,
    pack_name,
    retry_when_gone,
)
from ckstore.remote.names import open_remote
from ckstore.remote.push import PushReport, push, resend_superseded
from ckstore.repository.context import RepoContext
from ckstore.runtime.progress import ProgressFactory


def push_and_supersede(
    ctx: RepoContext,
    remote_name: str | None = None,
    names: Sequence[str] = (),
    force: bool = False,
    target_size: int = DEFAULT_TARGET_SIZE,
    grace: float = DEFAULT_GRACE,
    progress: ProgressFactory | None = None,
) -> PushReport:
    """``push``, then bring the remote level with what local compaction re-encoded since."""
    report = push(ctx, remote_name, names, force, target_size, grace, progress)
    supersede(ctx, open_remote(ctx, remote_name), report, grace, target_size, progress)
    return report


def supersede(
    ctx: RepoContext,
    remote: RemoteRepo,
    report: PushReport,
    grace: float = DEFAULT_GRACE,
    target_size: int = DEFAULT_TARGET_SIZE,
    progress: ProgressFactory | None = None,
) -> None:
    """Sweep what earlier pushes condemned, send again what is smaller here, drop or condemn
    what that superseded (the module docstring); recorded in ``report``."""
    sweep_superseded(remote, grace, report)
    resend_and_replace(ctx, remote, report, target_size, progress)


def resend_and_replace(
    ctx: RepoContext,
    remote: RemoteRepo,
    report: PushReport,
    target_size: int = DEFAULT_TARGET_SIZE,
    progress: ProgressFactory | None = None,
) -> None:
    """Steps 2 to 4: send again what ``ctx``'s store holds markedly smaller than the remote does
    (whole packs' worth, ``repack.superseded``), delete at once the packs that strictly
    superseded, condemn those superseded otherwise; recorded in ``report``. Every pack on the
    remote before this step is a candidate, the packs this push sent before it included. ``ctx`` may be a scratch repository holding only a
    few packs' objects (remote/compaction.py): a pack is sent again only when every object of it
    is held there."""
    before = set(remote.catalogue())
    first, objects, sent = len(report.sent_packs), report.objects, report.bytes
    resend_superseded(ctx, remote, target_size, report, progress)
    report.resent_objects += report.objects - objects
    report.resent_bytes += report.bytes - sent
    own = set(report.sent_packs[first:])
    sharing = _sharing(remote, remote.read_condemned())
    dropped = drop_superseded(remote, sharing & before, own)
    report.deleted += sorted(dropped)
    report.freed_bytes += sum(dropped.values())
    # What is superseded but could not go at once (equal copies that two pushers sent at once,
    # or copies a killed push sent) is left to the grace; both choose the same copy to keep.
    condemned = remote.read_condemned()
    left = [p for p in sharing if p not in dropped and p not in condemned.packs]
    fresh = set(retry_when_gone(lambda: _superseded(remote, condemned, left), remote.catalogue))
    if fresh:
        condemn(remote, fresh, time.time())
        report.condemned = sorted(fresh)


def _sharing(remote: RemoteRepo, condemned: Condemned) -> set[str]:
    """The packs (not claimed) holding an object that another such pack holds too: those that
    may be superseded, whichever push sent the other copy (this one, or one killed before it
    deleted what it replaced)."""
    claimed = condemned.claimed()
    seen: dict[str, str] = {}
    out: set[str] = set()
    for pack_id, table in sorted(remote.catalogue(refresh=False).items()):
        if pack_id in claimed:
            continue
        for oid in table.ids():
            first = seen.setdefault(oid, pack_id)
            if first != pack_id:
                out.update((first, pack_id))
    return out


def drop_superseded(remote: RemoteRepo, candidates: Collection[str], own: Collection[str] = ()) -> dict[str, int]:
    """Delete at once each pack of ``candidates`` that is strictly superseded: every object in it
    is held in another pack off the condemned list in a copy strictly smaller, or in one of
    ``own`` (packs the caller sent after every candidate existed), and every delta base of those
    copies is held off the list (docs/format.md 15.9, "Supersession by push"). Claimed first by
    compare-and-swap (refused while a pack it leans on is listed), checked after the claim (each
    pack it leans on still indexed: another drop may have deleted one meanwhile; then the claim
    is given back), then its index, then the pack. Pack id -> bytes freed."""
    condemned = remote.read_condemned()
    leans = retry_when_gone(lambda: _droppable(remote, condemned, candidates, set(own)), remote.catalogue)
    if not leans:
        return {}
    sizes = {p: t.pack_size for p, t in remote.catalogue(refresh=False).items() if p in leans}
    before: dict[str, tuple[float, bool] | None] = {}

    def claim(current: Condemned) -> set[str]:
        listed = set(current.packs)
        chosen = {p for p, lean in leans.items() if not lean & listed and not (p in listed and current.packs[p][1])}
        before.clear()
        before.update({p: current.packs.get(p) for p in chosen})
        now = time.time()
        for p in chosen:
            current.packs[p] = (now, True)
        return chosen

    claimed = update_condemned(remote, claim)
    indexed = set(remote.indexed_packs())
    broken = {p for p in claimed if not leans[p] <= indexed}
    if broken:
        update_condemned(remote, lambda c: _give_back(c, {p: before[p] for p in broken}))
    gone = delete_claimed(remote, claimed - broken)
    return {p: sizes.get(p, 0) for p in gone}


def _give_back(condemned: Condemned, entries: Mapping[str, tuple[float, bool] | None]) -> set[str]:
    """Undo a drop's claim: each entry as it was before (absent, or merely condemned)."""
    for p, entry in entries.items():
        if entry is None:
            condemned.packs.pop(p, None)
        else:
            condemned.packs[p] = entry
    return set()


def _droppable(
    remote: RemoteRepo,
    condemned: Condemned,
    candidates: Collection[str],
    own: set[str],
    reclaim: Collection[str] = (),
) -> dict[str, set[str]]:
    """Strictly superseded pack (``drop_superseded``'s rule) -> the packs it leans on (those
    holding the copies that replace its objects, and their delta bases). Taken in pack-id order,
    each as if those before it were gone. ``reclaim``: claimed packs considered as candidates
    (drops a killed push left claimed): already absent to everyone, so nobody leans on them and
    any copy elsewhere replaces theirs (strictness keeps two live drops apart; a claim is one)."""
    tables = remote.catalogue(refresh=False)
    claimed = condemned.claimed() - set(reclaim)
    listed = set(condemned.packs)
    chosen = sorted(p for p in candidates if p in tables and p not in claimed and p not in own)
    if not chosen:
        return {}
    ids = sorted({oid for p in chosen for oid in tables[p].ids()})
    involved = [(p, t) for p, t in sorted(tables.items()) if p not in claimed and len(t.locate_many(ids)[0])]
    out: dict[str, set[str]] = {}
    for pack_id in chosen:
        if any(pack_id in lean for lean in out.values()):
            continue  # an earlier one's copies or bases are here: it stays
        gone = {pack_id, *out}
        where = choose_copies([(p, t) for p, t in involved if p not in gone], listed)
        own_table = tables[pack_id]
        for e in own_table.entries:
            copy = where.get(e.id)
            if copy is None or copy.pack_id in listed:
                break
            if copy.entry.length >= e.length and copy.pack_id not in own and pack_id not in reclaim:
                break
        else:
            held = _held(where, tables, claimed | gone, listed)
            needs, cyclic = chain_closure(remote, held, set(own_table.ids()))
            if cyclic or any(oid not in held for oid in needs):
                continue  # a base no pack holds (damage), or a cycle it may break: keep every copy there is
            lean = {held[oid].pack_id for oid in needs}
            if not lean & (listed | gone):
                out[pack_id] = lean
    return out


def _held(
    where: Mapping[str, Located], tables: Mapping[str, PackTable], exclude: set[str], avoid: set[str]
) -> Mapping[str, Located]:
    """``where`` (the copies chosen among the packs involved), then every other object of the
    packs not in ``exclude``: delta bases may be anywhere, and are looked up one by one."""
    # Only looked up: a read-only mapping serves as ChainMap's second map.
    rest = Holdings({p: t for p, t in tables.items() if p not in exclude}, avoid)
    return ChainMap(cast(MutableMapping[str, Located], where), cast(MutableMapping[str, Located], rest))


def _superseded(remote: RemoteRepo, condemned: Condemned, candidates: Collection[str]) -> dict[str, set[str]]:
    """Superseded pack (among ``candidates``) -> the packs it leans on: those holding the chosen
    copies of its objects and, transitively, their delta bases. Only the packs that hold some
    object of a candidate are looked at (a push does not parse every index of a large remote);
    a tie between copies is then broken among them, and a condemned pack is avoided by every
    reader whatever the tie."""
    tables = remote.catalogue()
    claimed = condemned.claimed()
    candidates = sorted(p for p in candidates if p in tables and p not in claimed)
    if not candidates:
        return {}
    ids = sorted({oid for p in candidates for oid in tables[p].ids()})
    involved = [(p, t) for p, t in sorted(tables.items()) if p not in claimed and len(t.locate_many(ids)[0])]
    where = choose_copies(involved, set(condemned.packs))
    counted = {loc.pack_id for loc in where.values()}
    out: dict[str, set[str]] = {}
    held = _held(where, tables, claimed, set(condemned.packs))
    for pack_id in candidates:
        if pack_id in counted:
            continue
        needs, cyclic = chain_closure(remote, held, set(tables[pack_id].ids()))
        if cyclic or any(oid not in held for oid in needs):
            continue  # a base no pack holds (damage), or a cycle it may break: keep every copy there is
        leans = {held[oid].pack_id for oid in needs}
        if pack_id not in leans and not leans & set(condemned.packs):
            out[pack_id] = leans
    return out


def sweep_superseded(remote: RemoteRepo, grace: float, report: PushReport) -> None:
    """Delete the condemned packs that have been so for ``grace`` and are still superseded, and
    finish the drops a killed push left claimed (claimed ``grace`` ago or more)."""
    leftovers = _delete_leftovers(remote, grace)
    report.deleted += sorted(leftovers)
    report.freed_bytes += sum(leftovers.values())
    condemned = remote.read_condemned()
    now = time.time()
    due = {p for p, (since, claimed) in condemned.packs.items() if not claimed and now - since >= grace}
    stale = {p for p, (since, claimed) in condemned.packs.items() if claimed and now - since >= grace}
    if not due and not stale:
        return
    sizes = {p: t.pack_size for p, t in remote.catalogue().items()}
    deleted = _finish_drops(remote, condemned, stale) if stale else set()
    leans = retry_when_gone(lambda: _superseded(remote, condemned, due), remote.catalogue) if due else {}

    def pick(current: Condemned) -> set[str]:
        # Claimed only if, as the list stands at the swap, nothing it leans on is listed.
        listed = set(current.packs)
        chosen = {p for p, lean in leans.items() if p in listed and not current.packs[p][1] and not lean & listed}
        for p in chosen:
            current.packs[p] = (current.packs[p][0], True)
        return chosen

    deleted |= sweep(remote, pick) if leans else set()
    report.deleted += sorted(deleted)
    report.freed_bytes += sum(sizes.get(p, 0) for p in deleted)


def _delete_leftovers(remote: RemoteRepo, grace: float) -> dict[str, int]:
    """Delete the packs without an index written at least twice ``grace`` ago: what a push
    killed between a pack and its index, or a drop between the index and the pack, left (a
    pack without an index holds nothing; a live push writes its index right after its pack).
    Pack id -> bytes freed."""
    indexed = remote.indexed_packs()
    now = time.time()
    gone: dict[str, int] = {}
    for info in remote.transport.list(PACKS):
        pack_id = pack_name(info.key)
        age = now - info.last_modified.timestamp() - MTIME_RESOLUTION
        if pack_id is not None and pack_id not in indexed and age >= 2 * grace:
            mutating_step()
            remote.transport.delete(info.key)
            gone[pack_id] = info.size
    return gone


def _finish_drops(remote: RemoteRepo, condemned: Condemned, stale: set[str]) -> set[str]:
    """Claimed entries long since claimed whose owner stopped: deleted when the index is gone
    already (the drop got that far) or the pack is still strictly superseded; any other claim
    stays for remote gc (it may be a gc's, whose claim nobody else may give back)."""
    indexed = remote.catalogue(refresh=False)
    finish = {p for p in stale if p not in indexed}
    finish |= set(
        retry_when_gone(lambda: _droppable(remote, condemned, stale - finish, set(), stale), remote.catalogue)
    )
    return delete_claimed(remote, finish)
