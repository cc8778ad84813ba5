"""``push``: send the objects a remote lacks, in packs, then move its refs by compare-and-swap.

Order (docs/format.md 15.7): every pack, then its index, then the refs. A ref is swapped only
with the token read before the objects went up (``If-Match``), so of two pushers to one branch
exactly one wins and the other is told to fetch first; a branch whose remote tip is not an
ancestor of the pushed commit is refused up front for the same reason (``force`` skips that
check but not the swap: a force push still loses to a concurrent one rather than erase it
unseen). An interrupted push leaves packs with indexes (or a pack without one, which nothing
names); run again, it learns from the indexes what arrived and sends only the rest.

Nothing leaves unverified: each object is read as stored here, decoded and re-hashed against its
name on worker threads (``_Verifier``; a delta against its base's verified bytes) while earlier
packs are built and uploaded, and the pack index records the BLAKE3 of those exact stored bytes.
A fetch checks arriving objects against that digest and decodes them again (fetch.py): the
digest proves the bytes arrived as sent, decoding proves they are the objects named.

What a remote has (``RemoteRepo.holdings``): the objects the indexes list, minus packs a remote
gc has claimed for deletion. Packs a gc merely condemned are rescued (taken off its list) before the refs move, and
the check is repeated when it is older than half the grace period, so a concurrent gc never
deletes an object a ref is about to need (docs/design.md, "Remote gc").
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Collection, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import blake3

from ckstore.codecs.objects import Kind, delta_bases, encode, parse_header
from ckstore.errors import (
    ConflictError,
    IntegrityError,
    ObjectCorruptError,
    RefChangedError,
    RefNotFoundError,
    StorageError,
)
from ckstore.format.ids import ObjectId
from ckstore.format.manifest import chunks_beyond
from ckstore.format.pack import DEFAULT_TARGET_SIZE
from ckstore.remote.chains import SentChains, acyclic_resends
from ckstore.remote.layout import DEFAULT_GRACE, Condemned, Located, RemoteRepo
from ckstore.remote.names import open_remote, tracking_ref
from ckstore.remote.repack import superseded
from ckstore.remote.uploads import PackUploads
from ckstore.repository.context import RepoContext
from ckstore.repository.graph import kept_parents
from ckstore.repository.reader import VerifiedReader
from ckstore.repository.refs import HEADS, REFS, REMOTES, TAGS
from ckstore.repository.store import ObjectStore
from ckstore.runtime.progress import ProgressFactory, watching

UPLOAD_WORKERS = 4
# Objects read and verified ahead of the pack being built (memory: this many stored objects).
VERIFY_AHEAD = 16
# Verified raw bytes of delta bases kept for the deltas that follow (a chain decodes once).
BASE_CACHE = 64 << 20


@dataclass
class PushReport:
    remote: str
    updated: list[tuple[str, ObjectId | None, ObjectId]] = field(default_factory=list)  # ref, old, new
    up_to_date: list[str] = field(default_factory=list)
    objects: int = 0  # objects sent
    packs: int = 0  # packs sent
    bytes: int = 0  # pack and index bytes sent
    pack_sizes: list[int] = field(default_factory=list)
    sent_packs: list[str] = field(default_factory=list)  # ids of the packs sent
    # Supersession by push (supersede.py): copies sent again smaller, packs condemned and deleted.
    resent_objects: int = 0
    resent_bytes: int = 0
    condemned: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    freed_bytes: int = 0


class FetchFirstError(RefChangedError):
    """The remote branch holds commits the local one does not: fetch (and merge) first."""


def full_ref(ctx: RepoContext, name: str) -> str:
    """The local ref a push argument names: a branch, else a tag, else a full ref name."""
    for ref in [name] if name.startswith(REFS) else [HEADS + name, TAGS + name]:
        if ctx.refs.read(ref) is not None:
            return ref
    raise RefNotFoundError(f"no branch or tag {name!r} to push")


def needed_objects(
    ctx: RepoContext,
    tips: Sequence[ObjectId],
    remote_pruned: Mapping[ObjectId, Sequence[str]] = {},
    held: Collection[ObjectId] = frozenset(),
) -> tuple[list[str], list[ObjectId]]:
    """Every object the history of ``tips`` needs down to ``held`` (commits the remote holds
    with everything they need: the walk stops there), in a reader-friendly order: for each
    commit (oldest first) its chunks in file order, then the commit; then any delta base not
    listed. Also the commits walked. Commits pruned here or by a remote gc (``remote_pruned``)
    are skipped, except the tips themselves: a ref's value is never pruned (pushing a tag on an
    epoch a remote gc dropped sends that epoch again).

    A file-list piece (format.md 5.3) that a held commit, or a commit listed before, names too
    holds the same entries: its files' chunks are on the remote or listed already, so only the
    other pieces are read (a new epoch of 10^5 files with a few changed reads a few pieces,
    not 10^5 entries, and looks up and reads the headers of only their chunks)."""
    graph, store = ctx.graph, ctx.store
    pruned = {**{ObjectId(k): tuple(ObjectId(p) for p in v) for k, v in remote_pruned.items()}, **graph.pruned()}
    order: list[ObjectId] = []
    seen: set[ObjectId] = set(held)
    todo = list(dict.fromkeys(tips))
    while todo:
        oid = todo.pop()
        if oid in seen:
            continue
        seen.add(oid)
        order.append(oid)
        commit = graph.read_commit(oid, files=False)
        todo.extend(kept_parents(commit.parents, pruned))
        if commit.base is not None:
            todo.append(commit.base.commit)  # an overlay's base goes along: the remote stands alone
    pieces = {p.id for oid in held for p in graph.read_commit(oid, files=False).file_list}
    out: dict[str, None] = {}
    for oid in reversed(order):
        commit = graph.read_commit(oid, files=False)
        for chunk in chunks_beyond(commit, pieces, graph.file_list_reader(oid)):
            out.setdefault(chunk.id)
        pieces.update(p.id for p in commit.file_list)
        out.setdefault(oid)
    for base in sorted(store.with_delta_bases(out) - set(out)):
        out.setdefault(base)
    return list(out), order


def send_superseded(ctx: RepoContext, remote: RemoteRepo, target_size: int = DEFAULT_TARGET_SIZE) -> PushReport:
    """Send again, as stored here, the objects of the remote's packs that local compaction has
    made markedly smaller (remote/repack.py); what was sent."""
    report = PushReport(remote.name)
    _send_missing(ctx.store, remote, [], target_size, report, resend=True)
    return report


def resend_superseded(
    ctx: RepoContext,
    remote: RemoteRepo,
    target_size: int = DEFAULT_TARGET_SIZE,
    report: PushReport | None = None,
    progress: ProgressFactory | None = None,
) -> PushReport:
    """``send_superseded`` for a push, which a remote gc may run beside: every pack the new
    copies' delta bases are in is taken off the condemned list afterwards, and when a sweep has
    already claimed one, what that pack held is sent again (the bases must stay held)."""
    report = PushReport(remote.name) if report is None else report
    relied = _send_missing(ctx.store, remote, [], target_size, report, resend=True, progress=progress)
    tables = dict(remote.catalogue(refresh=False))
    while lost := remote.rescue(relied):
        again = [e.id for p in sorted(lost) if p in tables for e in tables[p].entries if ctx.store.has(e.id)]
        relied = _send_missing(ctx.store, remote, again, target_size, report, forget=lost)
        tables = dict(remote.catalogue(refresh=False))
    return report


def send_objects(
    store: ObjectStore, remote: RemoteRepo, wanted: list[str], target_size: int = DEFAULT_TARGET_SIZE
) -> tuple[PushReport, set[str]]:
    """Upload the objects of ``wanted`` (with their delta bases) that the remote lacks, as a
    push does, from ``store`` (a writer's staging store: push.py's rules need no commit graph),
    and rescue every pack the objects are in from a remote gc's condemned list, sending again
    what a sweep has claimed meanwhile. What was sent, and the packs relied on: the objects are
    all on the remote, in indexed packs no gc may delete before ``grace`` has passed again."""
    report = PushReport(remote.name)
    wanted = list(dict.fromkeys(wanted))  # a pack holds each object once
    relied = _send_missing(store, remote, wanted, target_size, report)
    while lost := remote.rescue(relied):
        where = remote.holdings(lost)
        gone = [oid for oid in wanted if oid not in where and not store.has(oid)]
        if gone:  # deduplicated against a pack a sweep is deleting: nothing here to send instead
            raise ConflictError(
                f"remote {remote.name}: a remote gc deleted a pack holding object {gone[0]} while it was "
                "being relied on; nothing was committed, save again"
            )
        relied = _send_missing(store, remote, wanted, target_size, report, forget=lost)
    return report, relied


def push(
    ctx: RepoContext,
    remote_name: str | None = None,
    names: Sequence[str] = (),
    force: bool = False,
    target_size: int = DEFAULT_TARGET_SIZE,
    grace: float = DEFAULT_GRACE,
    progress: ProgressFactory | None = None,
) -> PushReport:
    remote = open_remote(ctx, remote_name)
    report = PushReport(remote.name)
    refs = [full_ref(ctx, n) for n in (names or [ctx.refs.head_branch()])]
    if not (remote.transport.location_exists() and remote.check_format()):
        _refuse_vanished_remote(ctx, remote)
        remote.check_format(create=True)  # a first push: the remote starts here
    plan: list[tuple[str, ObjectId, ObjectId | None, str | None]] = []
    existing: list[str] | None = None
    for ref in dict.fromkeys(refs):
        new = ctx.refs.read(ref)
        assert new is not None  # full_ref found it
        old, token = remote.read_ref(ref)
        if old == new:
            report.up_to_date.append(ref)
            continue
        if old is None:
            existing = _remote_ref_names(remote) if existing is None else existing
            _refuse_conflict(remote, ref, existing)
        elif not force:
            _refuse_non_fast_forward(ctx, remote, ref, old, new)
        plan.append((ref, new, old, token))
    if not plan:
        return report
    tips = [new for _, new, _, _ in plan]
    theirs = remote.read_pruned()
    condemned = remote.read_condemned()
    where = remote.holdings(condemned=condemned)
    swapped, others = _held_by_remote(ctx, remote, plan, where)
    wanted, walked = needed_objects(ctx, tips, theirs, swapped | others)
    checked = time.monotonic()
    relied = _send_missing(ctx.store, remote, wanted, target_size, report, progress=progress, known=(where, condemned))
    while True:
        lost = remote.rescue(relied)
        if lost:  # a remote gc is deleting packs we counted on: send those objects again
            relied = _send_missing(ctx.store, remote, wanted, target_size, report, forget=lost)
            checked = time.monotonic()
            continue
        if time.monotonic() - checked > grace / 2:
            remote.catalogue()  # slow push: look again before the refs name anything
            relied = _send_missing(ctx.store, remote, wanted, target_size, report)
            checked = time.monotonic()
            continue
        if others and _condemned_long_ago(remote.read_condemned(), grace):
            # Another ref's history was counted on without rescuing its packs; a gc that could
            # claim one of them before the refs move may be under way: count on nothing but the
            # refs the swap itself checks, and send (and rescue) all the rest.
            others = set()
            wanted, walked = needed_objects(ctx, tips, theirs, swapped)
            relied = _send_missing(ctx.store, remote, wanted, target_size, report)
            checked = time.monotonic()
            continue
        break
    # Commits gc pruned here that the newly sent history reaches: the remote must know them as
    # pruned too, or its readers would look for them (below the held commits it knows them).
    here = ctx.graph.pruned_after(set(walked), set())
    if here:
        remote.add_pruned(here)
    for ref, new, old, token in plan:
        if not remote.swap_ref(ref, new, token):
            now, _ = remote.read_ref(ref)
            if now != new:
                raise FetchFirstError(
                    f"remote {remote.name}: {_short(ref)} moved to {str(now)[:12]} while pushing; "
                    f"fetch first ('ckstore pull {remote.name}'), then push again"
                )
        report.updated.append((ref, old, new))
        tracking = tracking_ref(remote.name, ref)
        if tracking is not None:
            ctx.refs.update(tracking, new, reason=f"push {remote.name}")
    return report


def _held_by_remote(
    ctx: RepoContext,
    remote: RemoteRepo,
    plan: Sequence[tuple[str, ObjectId, ObjectId | None, str | None]],
    where: Mapping[str, object],
) -> tuple[set[ObjectId], set[ObjectId]]:
    """Commits the remote holds with all they need, where push's walk stops: (the values of
    the refs being pushed, as read for their swap; the values of the remote's other branches
    that this repository tracks, read now). A ref there names only a commit whose history and
    objects are all there (docs/format.md 15.7), and each is checked to be in a pack there (a
    remote replaced or damaged behind our back is not taken at its tracking refs' word).

    A swapped ref's value cannot change unseen before the swap, so nothing it needs can be
    deleted meanwhile (a remote gc keeps what the refs name); another ref can move, so push
    checks the condemned list before its swap (``_condemned_long_ago``)."""
    mine = {ref for ref, *_ in plan}
    swapped = {old for _, _, old, _ in plan if old is not None}
    others: set[ObjectId] = set()
    if any(old is None for _, _, old, _ in plan):  # a new ref: the others' histories may hold most of it
        for tracking in ctx.refs.list(f"{REMOTES}{remote.name}/"):
            ref = HEADS + tracking
            if ref not in mine:
                value, _ = remote.read_ref(ref)
                if value is not None:
                    others.add(value)
    return (
        {c for c in swapped if c in where and ctx.store.has(c)},
        {c for c in others - swapped if c in where and ctx.store.has(c)},
    )


def _condemned_long_ago(condemned: Condemned, grace: float) -> bool:
    """Whether a remote gc could claim a condemned pack within ``grace / 2`` (the most a push
    takes between this check and moving its refs): one condemned more than half a grace ago.
    Pushes check this before counting on refs other than those they swap."""
    now = time.time()
    return any(now - since >= grace / 2 for since, _ in condemned.packs.values())


def _refuse_vanished_remote(ctx: RepoContext, remote: RemoteRepo) -> None:
    """The remote holds no repository, yet a tracking ref records that it had one: an unmounted
    share, an empty mount point, a moved folder. A push there would start a new, empty remote
    and report success while the real one never gets the commits."""
    seen = ctx.refs.list(f"{REMOTES}{remote.name}/")
    if seen:
        branch, oid = min(seen.items())
        raise StorageError(
            f"remote {remote.name}: {remote.describe()} holds no ckstore repository, but {remote.name}/{branch} was at "
            f"{oid[:12]} there (is it unmounted or moved?); to start a new remote there, "
            f"first run 'ckstore remote remove {remote.name}' and add it again"
        )


def _remote_ref_names(remote: RemoteRepo) -> list[str]:
    """Every ref name on the remote (including refs whose files are damaged)."""
    return [ref for info in remote.transport.list(REFS) if (ref := remote.decode_ref(info.key)) is not None]


def _refuse_conflict(remote: RemoteRepo, ref: str, existing: Sequence[str]) -> None:
    """Refuse a new remote ref that shares a name with a folder of refs there, or the reverse
    ("exp" and "exp/x"): S3 would store both, and no repository could fetch both."""
    for other in existing:
        if ref.startswith(other + "/"):
            raise ConflictError(
                f"remote {remote.name}: cannot create {_short(ref)}: {_short(other)} exists there "
                "(a ref cannot also be a folder of refs); choose another name"
            )
        if other.startswith(ref + "/"):
            raise ConflictError(
                f"remote {remote.name}: cannot create {_short(ref)}: refs exist below it there "
                f"({_short(other)}); choose another name"
            )


def _refuse_non_fast_forward(ctx: RepoContext, remote: RemoteRepo, ref: str, old: ObjectId, new: ObjectId) -> None:
    if ref.startswith(TAGS):
        raise ConflictError(
            f"remote {remote.name}: tag {ref[len(TAGS) :]!r} exists there at {old[:12]}; use --force to move it"
        )
    if not ctx.graph.reaches(new, old):
        raise FetchFirstError(
            f"remote {remote.name}: {_short(ref)} is at {old[:12]}, which the local branch does not contain; "
            f"fetch first ('ckstore pull {remote.name}'), or push --force to overwrite it"
        )


def _send_missing(
    store: ObjectStore,
    remote: RemoteRepo,
    wanted: list[str],
    target_size: int,
    report: PushReport,
    forget: frozenset[str] | set[str] = frozenset(),
    resend: bool = False,
    progress: ProgressFactory | None = None,
    known: tuple[Mapping[str, Located], Condemned] | None = None,
) -> set[str]:
    """Upload the wanted objects no usable pack holds (with ``resend``, also those of the packs
    local compaction has superseded: remote gc's repack); return every pack the wanted objects
    are in afterwards (those a push relies on). ``known``: the holdings and condemned list as
    the caller has just read them."""
    where: Mapping[str, Located]
    if known is None:
        condemned = remote.read_condemned()
        where = remote.holdings(forget, condemned)
    else:
        where, condemned = known
    claimed = condemned.claimed() | set(forget)
    missing = [oid for oid in wanted if oid not in where]
    # Objects local compaction has since stored smaller, with the rest of their packs: sent again
    # so that remote gc can drop those packs (repack.py); relied on in their new packs only.
    again = (
        [oid for oid in superseded(remote, store.stored_size, skip=set(condemned.packs) | claimed) if oid in where]
        if resend
        else []
    )
    judged = acyclic_resends(store, remote, where, again) if again else {}
    again = list(judged)
    missing += again
    resent = set(again)
    relied = {where[oid].pack_id for oid in wanted if oid in where and oid not in resent}

    verifier = _Verifier(store)
    chains = SentChains()
    breakers: list[tuple[str, bytes, bytes]] = []

    def objects() -> Iterator[tuple[str, bytes, bytes]]:
        # The delta bases are taken from the bytes actually sent: a compaction may have re-encoded
        # an object since the list was made, and the remote must hold every base it sends.
        queue, listed = deque(missing), set(missing)
        ahead: deque[Future[tuple[str, bytes, bytes, tuple[str, ...]]]] = deque()
        with ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="verify") as pool:
            try:
                while queue or ahead:
                    while queue and len(ahead) < VERIFY_AHEAD:
                        ahead.append(pool.submit(verifier.stored, queue.popleft()))
                    oid, data, digest, bases = ahead.popleft().result()
                    if oid in judged and bases != judged[oid]:
                        # Re-encoded since it was judged (a compaction runs beside): judged again.
                        if acyclic_resends(store, remote, where, [oid]).get(oid) != bases:
                            relied.add(where[oid].pack_id)  # its copy there stays the one counted on
                            continue
                    if bases and chains.closes_cycle(oid, bases):
                        # Read at another moment than the copies it would lean on (a compaction
                        # re-encoded them between the reads): sent whole, no cycle goes up.
                        data, digest, bases = verifier.whole(oid, data)
                        chains.sent(oid, bases)
                        breakers.append((oid, data, digest))  # in a pack of their own: repack.py
                        continue
                    chains.sent(oid, bases)
                    for base in bases:
                        if base in where and base not in resent:
                            relied.add(where[base].pack_id)
                        elif base not in listed:
                            listed.add(base)
                            queue.append(base)
                    yield oid, data, digest
            finally:
                pool.shutdown(cancel_futures=True)

    # The bar's total is what the missing objects take here; delta bases found on the way add to it.
    total = sum(store.stored_size(oid) or 0 for oid in missing) if progress and missing else 0
    with (
        watching(progress if missing else None, total, f"push {remote.name}") as advance,
        PackUploads(remote, target_size, UPLOAD_WORKERS) as uploads,
    ):
        apart = bool(again)
        for oid, data, digest in objects():
            if apart and oid in resent:
                apart = False
                # Sent again as re-encoded, these are final; whatever else goes in this upload
                # may be superseded later: separate packs, so that a pack re-sent once is never
                # re-sent again.
                uploads.cut()
            uploads.add(oid, data, digest)
            advance(len(data))
        # Whole copies that broke a cycle: once compaction is done the next push sends their
        # deltas again, and a pack holding only them is then superseded as a whole.
        uploads.cut()
        for oid, data, digest in breakers:
            uploads.add(oid, data, digest)
            advance(len(data))
    for index in uploads.sent:
        relied.add(index.pack_id)
        report.packs += 1
        report.objects += len(index)
        report.bytes += index.pack_size + len(index.to_bytes())
        report.pack_sizes.append(index.pack_size)
        report.sent_packs.append(index.pack_id)
    remote.catalogue()
    return relied


class _Verifier:
    """Reads objects as stored here and proves each decodes to its name before it is sent.

    ``ObjectStore.read_raw`` returns stored bytes unverified; sending those as they are would let
    a locally damaged object reach the remote under a digest that vouches for it. Thread-safe.
    """

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self.reader = VerifiedReader(lambda oid, _: store.read_raw(oid), base_cache=BASE_CACHE)

    def stored(self, oid: str) -> tuple[str, bytes, bytes, tuple[str, ...]]:
        """(id, stored bytes, their BLAKE3, delta bases) of one verified object."""
        data = self.store.read_raw(oid)
        try:
            bases = delta_bases(data)
            self.reader.verify(oid, data)
        except ObjectCorruptError as exc:
            which = "" if exc.oid == oid else f" (a delta base of {oid})"
            raise IntegrityError(
                f"object {exc.oid} is corrupt here{which}, so it is not sent: {exc.reason}; run 'ckstore fsck'"
            ) from None
        except IntegrityError as exc:
            raise IntegrityError(f"{exc}; it is not sent, run 'ckstore fsck'") from None
        return oid, data, blake3.blake3(data).digest(), bases

    def whole(self, oid: str, data: bytes) -> tuple[bytes, bytes, tuple[str, ...]]:
        """A whole encoding of the verified delta ``data`` of ``oid``: (bytes, BLAKE3, no bases)."""
        raw = self.reader.chunk(oid, parse_header(data).raw_len, "", data)
        whole = encode(raw, Kind.CHUNK, self.store.settings.zstd_level)
        return whole, blake3.blake3(whole).digest(), ()


def _short(ref: str) -> str:
    if ref.startswith(TAGS):
        return f"tag {ref[len(TAGS) :]!r}"
    return f"branch {ref[len(HEADS) :]!r}" if ref.startswith(HEADS) else ref
