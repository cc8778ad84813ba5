"""Supersession by push: a remote fed by ``ckstore push`` alone keeps the size of the local store.

Local compaction re-encodes each previous epoch as deltas of the next one after the push that
sent it, so a remote that kept the first copy of every object would grow by a whole epoch per
epoch. Every push therefore, after its refs moved (docs/format.md 15.9, "Supersession by push"):

1. sweeps: claims, by compare-and-swap, each entry of the condemned list that was condemned at
   least ``grace`` ago and whose pack is still superseded (below), with every pack it leans on
   still off the list; deletes its index, then its pack (``gc.sweep``);
2. sends again, as stored here and verified like any push, what local compaction stores
   markedly smaller than the remote does (``repack.superseded``: what remote gc's repack sends),
   in packs of its own, and keeps the packs the new copies' delta bases are in off the list;
3. condemns (``gc.condemn``) every pack now superseded.

A pack is *superseded* when it holds no copy anybody counts on: for each of its objects the copy
``RemoteRepo.locate`` chooses (the rule every pusher, reader and remote gc chooses by) is in
another pack, and every delta base of that copy, as stored on the remote, is held in a pack off
the list. Such a pack holds nothing the remote needs whatever the refs are, so no ref walk is
needed, and it is condemned whatever its age. The same two phases as remote gc keep readers
safe: one that located an object in the pack before the new copy arrived still finds it for the
grace period, and a pusher that counted on it rescues it before its refs move (push.py).
A push that finds nothing new (the last epoch, after ``ckstore wait``) still does all three, so a
push that ran while the detached compaction was still re-encoding is caught up by the next one.
"""

from __future__ import annotations

import time
from collections import ChainMap
from collections.abc import Collection, MutableMapping, Sequence
from typing import cast

from ckstore.format.pack import DEFAULT_TARGET_SIZE
from ckstore.remote.gc import condemn, remote_bases, sweep
from ckstore.remote.layout import DEFAULT_GRACE, Condemned, Located, RemoteRepo, choose_copies
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
    """Sweep what earlier pushes condemned, send again what is smaller here, condemn what that
    superseded (the module docstring); recorded in ``report``."""
    _sweep(remote, grace, report)
    objects, sent = report.objects, report.bytes
    resend_superseded(ctx, remote, target_size, report, progress)
    report.resent_objects += report.objects - objects
    report.resent_bytes += report.bytes - sent
    condemned = remote.read_condemned()
    tables = remote.catalogue(refresh=False)
    sent_ids = {oid for p in report.sent_packs if p in tables for oid in tables[p].ids()}
    # The packs holding an object sent here (the copies those sent again replace)
    others = [p for p, t in tables.items() if p not in condemned.packs and p not in report.sent_packs]
    touched = [p for p in others if sent_ids and len(tables[p].locate_many(sorted(sent_ids))[0])]
    fresh = set(_superseded(remote, condemned, touched))
    if fresh:
        condemn(remote, fresh, time.time())
        report.condemned = sorted(fresh)


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
    for pack_id in candidates:
        if pack_id in counted:
            continue
        # Delta bases may be anywhere: looked up one by one beyond the packs involved.
        # Only looked up: a read-only mapping serves as ChainMap's second map.
        held = ChainMap(where, cast(MutableMapping[str, Located], remote.holdings(claimed, condemned)))
        needs = remote_bases(remote, held, set(tables[pack_id].ids()))
        if any(oid not in held for oid in needs):
            continue  # a base no pack holds (damage): keep every copy there is
        leans = {held[oid].pack_id for oid in needs}
        if pack_id not in leans and not leans & set(condemned.packs):
            out[pack_id] = leans
    return out


def _sweep(remote: RemoteRepo, grace: float, report: PushReport) -> None:
    """Delete the condemned packs that have been so for ``grace`` and are still superseded."""
    condemned = remote.read_condemned()
    now = time.time()
    due = {p for p, (since, claimed) in condemned.packs.items() if not claimed and now - since >= grace}
    if not due:
        return
    sizes = {p: t.pack_size for p, t in remote.catalogue().items()}
    leans = _superseded(remote, condemned, due)

    def pick(current: Condemned) -> set[str]:
        # Claimed only if, as the list stands at the swap, nothing it leans on is listed.
        listed = set(current.packs)
        chosen = {p for p, lean in leans.items() if p in listed and not current.packs[p][1] and not lean & listed}
        for p in chosen:
            current.packs[p] = (current.packs[p][0], True)
        return chosen

    deleted = sweep(remote, pick)
    report.deleted = sorted(deleted)
    report.freed_bytes = sum(sizes.get(p, 0) for p in deleted)
