"""``fetch``, ``pull`` and ``clone``: bring a remote's commits and the objects they need here.

Every object is checked on arrival, before any ref names it: a commit is decoded and re-hashed
in memory as soon as its bytes come; its chunks (and the delta bases they need) are decoded and
re-hashed against their names as they arrive, by the one verified reader (reader.py), whatever
the pack's version (a version 2 entry's digest is checked as the bytes are read, but it comes
from the same party as the bytes: it proves they arrived intact, not that they are the object
named), and only then staged in rolling ``Backend.batch``es that
land on a background thread while later packs download. A corrupt or truncated remote object
raises an IntegrityError naming the object and its pack. The commit objects are written last,
oldest first, once every batch landed, so the local invariant holds at every moment (a commit
present means its objects and its history are present) and an interrupted fetch resumes where
it stopped: a commit already here is never fetched again, and objects that landed are skipped.
Every later read decodes and verifies each object again (store.py), as does ``fsck``.

Remote-tracking refs ``refs/remotes/NAME/BRANCH`` (resolvable as ``NAME/BRANCH``) record each
remote branch as last seen; remote tags become local tags unless a local tag of that name exists.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from ckstore.codecs.objects import ENCODINGS_BY_REPO_VERSION, Encoding, delta_bases, parse_header
from ckstore.format.settings import NEW_REPO_VERSION, RepoConfig, version_for
from ckstore.repository.context import RepoContext, init_context
from ckstore.errors import (
    CkstoreError,
    ConflictError,
    IntegrityError,
    InvalidInputError,
    InvalidRefNameError,
    ObjectMissingError,
    RefExistsError,
    RefNotFoundError,
)
from ckstore.format.ids import ObjectId
from ckstore.format.manifest import ChunkReader, Commit, decode_commit
from ckstore.repository.refs import DEFAULT_BRANCH, HEADS, REMOTES, TAGS, check_ref_name
from ckstore.repository.writing import writing
from ckstore.remote.awsconfig import endpoint_problem
from ckstore.remote.layout import Located, RemoteRepo, pack_key
from ckstore.remote.names import add, open_remote, tracking_ref
from ckstore.repository.reader import VerifiedReader, delta_closure, verified_commit
from ckstore.repository.store import ObjectStore, object_key
from ckstore.write.pipeline import ProgressBar, ProgressFactory

READ_WORKERS = 4
# Objects land in batches of about this many bytes, each on a background thread while later
# packs download: a batch costs two durability barriers, and an interrupted fetch loses at most
# the batches not landed yet (the next fetch skips objects that landed).
LAND_BATCH = 64 << 20
# Downloads pause while verification workers hold this many stored and decoded bytes (memory
# stays bounded).
MAX_IN_FLIGHT = 64 << 20
# Verified raw bytes of delta bases kept for the deltas waiting on them.
BASE_CACHE = 64 << 20


@dataclass(frozen=True)
class SkippedRef:
    """A remote ref that fetch left alone, and why: ``damaged`` when the remote is broken there
    (the command fails, naming it), else a name this repository cannot hold (a warning)."""

    ref: str
    reason: str
    damaged: bool


@dataclass
class FetchReport:
    remote: str
    updated: list[tuple[str, ObjectId | None, ObjectId]] = field(default_factory=list)  # local ref, old, new
    commits: int = 0
    objects: int = 0
    bytes: int = 0  # object bytes transferred
    skipped: list[SkippedRef] = field(default_factory=list)

    def check(self) -> None:
        """Raise IntegrityError naming every ref skipped because the remote is damaged there
        (called once the refs that could move have moved, and the report was shown)."""
        damaged = [s for s in self.skipped if s.damaged]
        if damaged:
            raise IntegrityError(f"remote {self.remote}: {len(damaged)} ref(s) not fetched (the others were): "
                                 + "; ".join(f"{s.ref}: {s.reason}" for s in damaged))
    progress: ProgressBar | None = field(default=None, repr=False, compare=False)  # the CLI's bar

    def received(self, n: int) -> None:
        self.bytes += n
        if self.progress is not None:
            self.progress.update(n)


def read_objects(remote: RemoteRepo, where: dict[str, Located], oids: Iterable[str]) -> Iterator[tuple[str, str, bytes]]:
    """(object id, pack id, stored bytes) of each object, by ranged reads grouped per pack; a few
    packs are read at once, so memory stays a few packs' worth of wanted ranges."""
    by_pack: dict[str, list[Located]] = {}
    for oid in dict.fromkeys(oids):
        loc = where[oid]
        by_pack.setdefault(loc.pack_id, []).append(loc)

    def read(pack_id: str) -> list[tuple[str, bytes]]:
        return [(e.id, data) for e, data in remote.read_objects(pack_id, [loc.entry for loc in by_pack[pack_id]])]

    pending: list[tuple[str, Future[list[tuple[str, bytes]]]]] = []
    with ThreadPoolExecutor(READ_WORKERS) as pool:
        packs = iter(by_pack)
        for pack_id in packs:
            pending.append((pack_id, pool.submit(read, pack_id)))
            while len(pending) >= READ_WORKERS:
                done_id, fut = pending.pop(0)
                for oid, data in fut.result():
                    yield oid, done_id, data
        for done_id, fut in pending:
            for oid, data in fut.result():
                yield oid, done_id, data


def verify_commit(oid: str, data: bytes, where: str, read: ChunkReader | None = None) -> Commit:
    """The commit, every field verified; ``read`` reads a version-4 file list (format.md 5.3)."""
    try:
        return decode_commit(verified_commit(oid, data), read=read)
    except IntegrityError as exc:
        raise IntegrityError(f"commit {oid} from {where} is corrupt: {exc}") from None


def file_list_reader(store: ObjectStore, remote: RemoteRepo, where: dict[str, Located]) -> ChunkReader:
    """Reads a fetched commit's file list pieces, verified: from here when held here (a piece
    an earlier commit shares), else from the remote's packs. The pieces are then fetched with
    the commit's other chunks (they are in its ``all_chunks``): read twice, stored once."""
    def stored(oid: str, context: str) -> bytes:
        if store.has_durable(oid):
            return store.read_raw(oid)
        if oid not in where:
            raise ObjectMissingError(f"object {oid}{context} is in no pack on remote {remote.name}")
        return next(iter(read_objects(remote, where, [oid])))[2]

    reader = VerifiedReader(stored)
    return lambda ref: reader.chunk(ref.id, ref.size, " (a file list piece)")


def fetch_history(ctx: RepoContext, remote: RemoteRepo, tips: Sequence[ObjectId], report: FetchReport) -> set[ObjectId]:
    """Fetch every commit reachable from ``tips`` that is not here, with its objects; returns
    the tips no pack on the remote holds (nothing of their history is fetched).

    A tip is never "pruned": a ref value is fetched even when the remote's pruned record lists
    it (a push of an old epoch after a remote gc put it back), and is missing when no pack
    holds it (docs/format.md 15.6)."""
    store, graph = ctx.store, ctx.graph
    where = remote.holdings()
    theirs = remote.read_pruned()
    commits: dict[ObjectId, Commit] = {}
    stored: dict[ObjectId, bytes] = {}  # each commit's stored bytes, verified
    boundary: set[ObjectId] = set()  # parents the remote no longer has (its gc pruned them)
    wanted = [t for t in dict.fromkeys(tips) if not store.has_durable(t)]
    missing = {t for t in wanted if t not in where}
    frontier = [t for t in wanted if t not in missing]
    named = set(frontier)
    read_list = file_list_reader(store, remote, where)
    while frontier:
        # A pruned commit may still lie in a pack that holds live objects too: not fetched.
        present = [oid for oid in frontier if oid in where and (oid not in theirs or oid in named)]
        boundary.update(oid for oid in frontier if oid not in present)
        for oid, pack_id, data in read_objects(remote, where, present):
            commit = verify_commit(oid, data, remote.describe(pack_key(pack_id)), read_list)
            commits[ObjectId(oid)] = commit
            stored[ObjectId(oid)] = bytes(data)
            report.received(len(data))
        nxt = []
        for oid in boundary.intersection(frontier):  # the remote gc pruned it: history goes on with its parents
            for p in theirs.get(oid, ()):
                if p not in commits and p not in nxt and not store.has_durable(p):
                    nxt.append(ObjectId(p))
        for oid in present:
            c = commits[ObjectId(oid)]
            for p in [*c.parents, *([c.base.commit] if c.base is not None else [])]:
                if p not in commits and p not in nxt and not store.has_durable(p):
                    nxt.append(p)
        frontier = nxt
    if boundary:  # history continues through the remote gc's record of what it pruned
        pruned = graph.pruned()
        graph.write_pruned({**pruned, **{b: pruned.get(b, tuple(theirs.get(b, ()))) for b in boundary}})
    order = _oldest_first(commits)
    # Hashing, decoding and staging writes release the GIL: every core works while the next
    # packs download, and full batches land on another thread meanwhile.
    with ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="verify") as pool:
        batches = _Batches(store)
        try:
            lander = _Lander(store, batches, remote, where, pool, report)
            lander.on_newer_encoding = lambda encoding: _allow_encoding(ctx, encoding)
            for oid in order:
                lander.want_commit(oid, commits[oid])
            lander.run()
            batches.land_all()
        except BaseException:
            batches.abandon()
            raise
        batches.lander.shutdown()
    # The commits only once every object is durable, oldest first, each durable before the next:
    # a commit here always has its objects and its history.
    for oid in order:
        store.backend.put_if_absent(object_key(oid), stored[oid])
        graph.remember(oid, commits[oid])
        report.commits += 1
        report.objects += 1
    pruned = graph.pruned()
    if named & pruned.keys():  # fetched as a ref's value (an earlier fetch recorded it pruned): here now
        graph.write_pruned({o: p for o, p in pruned.items() if o not in named})
    return missing


def _oldest_first(commits: dict[ObjectId, Commit]) -> list[ObjectId]:
    out: list[ObjectId] = []
    done: set[ObjectId] = set()
    for start in commits:
        stack = [(start, False)]
        while stack:
            oid, expanded = stack.pop()
            if oid in done or oid not in commits:
                continue
            if expanded:
                done.add(oid)
                out.append(oid)
                continue
            stack.append((oid, True))
            c = commits[oid]
            stack.extend((p, False) for p in [*c.parents, *([c.base.commit] if c.base is not None else [])] if p not in done)
    return out


class _Batch:
    """One open ``Backend.batch`` and the staging writes still going into it."""

    def __init__(self, store: ObjectStore) -> None:
        self.stack = ExitStack()
        self.view = self.stack.enter_context(store.batch(LAND_BATCH))
        self.bytes = 0
        self.writers = 0


class _Batches:
    """Rolling batches: verified objects are staged into the open batch; once it holds LAND_BATCH
    bytes it is closed and lands (two durability barriers, the links between them) on a
    background thread, in order, while downloads go on. A landed object is durable but no commit
    names it until ``land_all``; a failure discards every batch not landed yet."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self.lock = threading.Condition()
        self.current = _Batch(store)
        self.lander = ThreadPoolExecutor(1, thread_name_prefix="land")
        self.landing: list[Future[None]] = []
        self.failed = False

    def put(self, oid: str, data: bytes) -> None:
        with self.lock:
            batch = self.current
            batch.writers += 1
        try:
            batch.view.backend.put_new(object_key(oid), data)  # the lander found it absent
        finally:
            with self.lock:
                batch.writers -= 1
                batch.bytes += len(data)
                self.lock.notify_all()
        if batch.bytes >= LAND_BATCH:
            self.roll(batch)

    def roll(self, batch: _Batch | None = None) -> None:
        """Close the open batch (if it is still ``batch``) and queue it to land."""
        with self.lock:
            if batch is not None and batch is not self.current:
                return
            closed, self.current = self.current, _Batch(self.store)
            self.landing.append(self.lander.submit(self._land, closed))

    def _land(self, batch: _Batch) -> None:
        with self.lock:
            while batch.writers:
                self.lock.wait()
            failed = self.failed
        if failed:
            batch.stack.__exit__(CkstoreError, CkstoreError("fetch failed"), None)  # discards it
        else:
            batch.stack.close()

    def land_all(self) -> None:
        """Make every object staged so far durable (returns once every batch has landed)."""
        self.roll()
        for fut in list(self.landing):
            fut.result()

    def abandon(self) -> None:
        """After a failure: discard what has not landed; return once no batch is landing."""
        with self.lock:
            self.failed = True
            self.landing.append(self.lander.submit(self._land, self.current))
        for fut in self.landing:
            try:
                fut.result()
            except BaseException:
                pass  # the first error is the one raised
        self.lander.shutdown()


class _Lander:
    """The objects of the commits wanted, into rolling batches: downloaded a few packs at a time,
    each object checked on a worker as soon as it arrives (while later packs download), then
    staged. Every object is decoded and re-hashed here (``VerifiedReader``); one from a version 2
    pack was also checked against its entry's digest as it was read (``RemoteRepo.read_objects``).
    Nothing is staged unchecked, and no commit is written before ``run`` returned and every
    batch landed, so a failure leaves no commit naming anything missing.

    A delta whose base came in this fetch waits for that base's verification and is decoded
    against the base's raw bytes kept in memory (at most BASE_CACHE bytes of them, least recently
    used out); otherwise its base is read through the store once it landed. Chains are bounded by
    the reader (MAX_CHAIN_DEPTH, cycles refused), so nothing lands that the store would refuse;
    a delta whose bases never resolve (a cycle across objects of this fetch) is an IntegrityError.
    """

    def __init__(self, view: ObjectStore, batches: _Batches, remote: RemoteRepo, where: dict[str, Located],
                 pool: ThreadPoolExecutor, report: FetchReport) -> None:
        self.view, self.remote, self.where, self.pool, self.report = view, remote, where, pool, report
        self.batches = batches
        self.queued: dict[str, str] = {}  # object -> the commit that first needed it (for errors)
        self.queued_bytes = 0
        self.origin: dict[str, str] = {}  # object -> pack id, every object downloaded here
        self.verified: set[str] = set()  # objects of this fetch verified and staged
        # Verified raw bytes of bases deltas wait for, at most BASE_CACHE of them; a base dropped
        # is read again through the store (it landed), so memory never grows with the fetch.
        self.reader = VerifiedReader(self._stored, base_cache=BASE_CACHE)
        self.waiting: dict[str, list[tuple[str, str, bytes]]] = {}  # base -> deltas waiting for it
        self.late: list[tuple[str, str, bytes]] = []  # deltas on a local base whose chain is incomplete
        self.lock = threading.Condition()
        self.futures: list[Future[None]] = []
        self.in_flight = 0  # stored and decoded bytes handed to workers and not yet done (memory bound)
        self.failed = False
        # Before an object in an encoding newer than format 2 (a predicted or context-sorted delta) is staged.
        self.on_newer_encoding: Callable[[Encoding], None] = lambda encoding: None

    def want_commit(self, oid: ObjectId, commit: Commit) -> None:
        chunks = {c.id for c in commit.all_chunks()} - self.queued.keys()
        todo = [c for c in chunks if not self.view.has_durable(c)]
        todo += _missing_bases(self.view, chunks - set(todo))
        for o in dict.fromkeys(todo):
            if o not in self.queued:
                self.queued[o] = oid
                loc = self.where.get(o)
                self.queued_bytes += loc.entry.length if loc is not None else 0

    def run(self) -> None:
        todo = list(self.queued)
        try:
            while todo:
                absent = [o for o in dict.fromkeys(todo) if o not in self.origin and not self.view.has_durable(o)]
                for o in absent:
                    if o not in self.where:
                        needer = self.queued.get(o, "?")
                        raise IntegrityError(f"remote {self.remote.name}: object {o} (needed by commit {needer[:12]}) "
                                             "is in no pack there")
                    self.origin[o] = self.where[o].pack_id
                todo = []
                for o, pack_id, data in read_objects(self.remote, self.where, absent):
                    self.report.received(len(data))
                    self.report.objects += 1
                    todo += self._arrive(o, pack_id, data)
            self._drain()
            if self.late:
                self.batches.land_all()  # their bases' chains came in this fetch: readable once landed
            for item in self.late:
                self._submit(*item, wait=False)
            self._drain()
        except BaseException:
            with self.lock:
                self.failed = True
            self._drain(quiet=True)
            raise
        if self.waiting:  # a real check, not an assert: it must hold under python -O (F11)
            stuck = sorted(o for items in self.waiting.values() for o, _, _ in items)
            raise IntegrityError(
                f"remote {self.remote.name}: object {stuck[0]}"
                + (f" and {len(stuck) - 1} more" if len(stuck) > 1 else "")
                + " never resolved: its delta bases form a cycle or never came")

    def _fail(self, o: str, pack_id: str, reason: str) -> IntegrityError:
        return IntegrityError(f"object {o} is corrupt: {reason} (fetched from {self.remote.describe(pack_key(pack_id))})")

    def _arrive(self, o: str, pack_id: str, data: bytes) -> list[str]:
        """Hand one downloaded object to a worker, or park it until its bases are verified; the
        bases to download next (a delta's bases the remote has and this store lacks)."""
        try:
            bases = delta_bases(data)
        except IntegrityError as exc:
            raise self._fail(o, pack_id, str(exc)) from None
        if not bases:
            self._submit(o, pack_id, data, wait=True)
            return []
        encoding = parse_header(data).encoding
        if encoding not in ENCODINGS_BY_REPO_VERSION[NEW_REPO_VERSION]:
            self.on_newer_encoding(encoding)
        absent = [b for b in bases if b not in self.origin and not self.view.has_durable(b)]
        for base in absent:
            self.queued.setdefault(base, self.queued.get(o, "?"))
        incomplete = _missing_bases(self.view, {b for b in bases if b not in self.origin and b not in absent})
        if incomplete:
            self.late.append((o, pack_id, data))  # verified once its bases' chains are staged
            return absent + incomplete
        if not self._park_unverified(o, pack_id, data, bases, absent):
            self._submit(o, pack_id, data, wait=True)
        return absent

    def _park_unverified(self, o: str, pack_id: str, data: bytes, bases: Sequence[str], absent: Sequence[str]) -> bool:
        """Park the object on one of its bases that came (or comes) in this fetch and is not
        verified yet; False when there is none (it can be verified now)."""
        with self.lock:
            waiting = [b for b in bases if b in self.origin and b not in self.verified] + list(absent)
            if waiting:
                self._park(waiting[0], (o, pack_id, data))
            return bool(waiting)

    def _park(self, base: str, item: tuple[str, str, bytes]) -> None:
        self.waiting.setdefault(base, []).append(item)

    def _submit(self, o: str, pack_id: str, data: bytes, wait: bool) -> None:
        with self.lock:
            # Downloads pause while workers hold this much; a worker releasing waiting deltas
            # never waits (the bytes are in memory already).
            while wait and self.in_flight > MAX_IN_FLIGHT and not self.failed:
                self.lock.wait()
            self.in_flight += _cost(data)
            self.futures.append(self.pool.submit(self._verify, o, pack_id, data))

    def _verify(self, o: str, pack_id: str, data: bytes) -> None:
        try:
            if not self.failed:
                self._verify_one(o, pack_id, data)
        finally:
            with self.lock:
                self.in_flight -= _cost(data)
                self.lock.notify_all()

    def _verify_one(self, o: str, pack_id: str, data: bytes) -> None:
        # Every object is decoded and re-hashed against its name before it is staged, whatever
        # its pack's version: a version 2 digest comes from the same party as the bytes, so it
        # proves only that they arrived intact, not that they are the object named (F1).
        try:
            raw, depth = self.reader.chunk_depth(o, None, "", data)
        except CkstoreError as exc:
            raise self._fail(o, pack_id, str(exc)) from None
        self.batches.put(o, data)
        with self.lock:
            self.verified.add(o)
            released = self.waiting.pop(o, [])
        if released:  # kept for the deltas waiting on it, within BASE_CACHE (F9: never unbounded)
            self.reader.remember(o, raw, depth)
        del raw
        for item in released:
            # A predicted delta parked on one base may still wait for another of this fetch.
            if not self._park_unverified(*item, delta_bases(item[2]), ()):
                self._submit(*item, wait=False)

    def _stored(self, oid: str, context: str) -> bytes:
        """A delta base's stored bytes: one that came in this fetch is readable once its batch
        landed (it was verified before it was staged)."""
        if oid in self.origin:
            self.batches.land_all()
        return self.view.read_raw(oid)

    def _drain(self, quiet: bool = False) -> None:
        """Wait for every worker task, including those that tasks submitted; the first error
        raises (unless ``quiet``)."""
        i = 0
        while True:
            with self.lock:
                if i >= len(self.futures):
                    return
                fut = self.futures[i]
            i += 1
            try:
                fut.result()
            except BaseException:
                if not quiet:
                    with self.lock:
                        self.failed = True
                    self._drain(quiet=True)
                    raise


def _allow_encoding(ctx: RepoContext, encoding: Encoding) -> None:
    """A repository of format 2 or newer is upgraded before it holds an object whose encoding its
    version lacks: 4 for a predicted delta, 6 for a context-sorted one (docs/format.md)."""
    ctx.upgrade(version_for(encoding))


def _missing_bases(view: ObjectStore, present: set[str]) -> list[str]:
    """Delta bases that objects already here lack: a crash while an earlier fetch's batch was
    landing can leave an object in place without its base (and without any commit naming it)."""
    return sorted(b for b in delta_closure(present, view.bases_of, follow=view.has_durable) - present if not view.has_durable(b))


def _cost(data: bytes) -> int:
    """Memory a worker holds verifying one object: its stored and its decoded bytes (the header
    declares the latter; a 10 KB frame of 256 MiB counts as 256 MiB, F9)."""
    try:
        return len(data) + parse_header(data).raw_len
    except IntegrityError:
        return len(data)


def fetch(ctx: RepoContext, remote_name: str | None = None, progress: ProgressFactory | None = None) -> FetchReport:
    """Fetch every ref of the remote that can be fetched; the report names those skipped (a
    damaged one: ``FetchReport.check`` raises for it once the caller has shown the report)."""
    # The writers' locks from the first landed object to the last tracking ref (writing.py):
    # a gc in between would delete what landed before any ref names it (F2).
    with writing(ctx):
        return _fetch_locked(ctx, remote_name, progress)


def _fetch_locked(ctx: RepoContext, remote_name: str | None, progress: ProgressFactory | None) -> FetchReport:
    remote = open_remote(ctx, remote_name)
    report = FetchReport(remote.name)
    remote.require_format()
    problems: dict[str, str] = {}
    refs = remote.list_refs(problems)
    report.skipped += [SkippedRef(ref, why, damaged=True) for ref, why in sorted(problems.items())]
    for ref in list(refs):
        problem = _local_name_problem(ref)
        if problem:
            report.skipped.append(SkippedRef(ref, problem, damaged=False))
            del refs[ref]
    # The total is not known before the commits are read: the bar counts bytes and their rate.
    report.progress = progress(0, f"fetch {remote.name}") if progress else None
    try:
        missing = fetch_history(ctx, remote, list(refs.values()), report)
    finally:
        if report.progress is not None:
            report.progress.close()
    for ref, oid in sorted(refs.items()):
        if oid in missing:
            report.skipped.append(SkippedRef(ref, f"it names commit {oid[:12]}, which no pack there holds", damaged=True))
            continue
        local = tracking_ref(remote.name, ref)
        if local is None:
            if not ref.startswith(TAGS) or ctx.refs.read(ref) is not None:
                continue  # a local tag of that name wins, as in git
            local = ref
        old = ctx.refs.read(local)
        if old != oid:
            try:
                ctx.refs.update(local, oid, reason=f"fetch {remote.name}")
            except RefExistsError as exc:  # "exp" here and "exp/x" there, which S3 allows
                report.skipped.append(SkippedRef(ref, str(exc), damaged=False))
                continue
            report.updated.append((local, old, oid))
    # Branches deleted on the remote: their tracking refs go (the reflog keeps what they held).
    # A branch skipped above is still there: its tracking ref stays as last seen.
    prefix = f"{REMOTES}{remote.name}/"
    skipped = {s.ref for s in report.skipped}
    for branch in ctx.refs.list(prefix):
        if HEADS + branch not in refs and HEADS + branch not in skipped:
            ctx.refs.delete(prefix + branch, reason=f"fetch {remote.name}: gone from the remote")
    return report


def _local_name_problem(ref: str) -> str | None:
    """Why a remote branch or tag cannot become a ref here (``HEAD``, ``-x``: names the local
    rules forbid, which the CLI could then neither name nor delete), or None."""
    for prefix in (HEADS, TAGS):
        if ref.startswith(prefix):
            try:
                check_ref_name(ref[len(prefix):], "branch" if prefix == HEADS else "tag")
            except InvalidRefNameError as exc:
                return str(exc)
    return None


def pull(ctx: RepoContext, remote_name: str | None = None,
         progress: ProgressFactory | None = None) -> tuple[FetchReport, ObjectId | None, ObjectId | None]:
    """Fetch, then fast-forward the current branch to its remote-tracking ref; (report, old, new)."""
    with writing(ctx):
        return _pull_locked(ctx, remote_name, progress)


def _pull_locked(ctx: RepoContext, remote_name: str | None,
                 progress: ProgressFactory | None) -> tuple[FetchReport, ObjectId | None, ObjectId | None]:
    report = fetch(ctx, remote_name, progress)
    branch = ctx.refs.head_branch()
    theirs = ctx.refs.read(f"{REMOTES}{report.remote}/{branch}")
    if theirs is None:
        report.check()  # the branch may be there, damaged: say so rather than "no branch"
        raise RefNotFoundError(f"remote {report.remote} has no branch {branch!r}")
    ours = ctx.refs.read(HEADS + branch)
    # The fast-forward first: each walk stops where it finds the other commit, so the usual
    # pull costs the commits it brings, not the branch's whole history.
    behind = ours is None or ctx.graph.reaches(theirs, ours)
    if ours == theirs or (ours is not None and not behind and ctx.graph.reaches(ours, theirs)):
        return report, ours, ours  # up to date (or ahead)
    if not behind:
        raise ConflictError(
            f"branch {branch!r} and {report.remote}/{branch} have diverged; ckstore does not merge: "
            f"'ckstore reset {report.remote}/{branch}' takes theirs, 'ckstore push --force' keeps yours"
        )
    ctx.refs.update(HEADS + branch, theirs, expected=ours, reason=f"pull {report.remote}: fast-forward")
    return report, ours, theirs


def clone(url: str, path: str | os.PathLike[str], endpoint_url: str | None = None,
          config: RepoConfig | None = None, progress: ProgressFactory | None = None) -> tuple[RepoContext, FetchReport]:
    """A new repository at ``path`` with remote "origin", every remote branch as a local branch,
    and HEAD on "main" (or the first branch)."""
    from ckstore.remote.names import RemoteSpec, open_spec

    # Refuse bad input, then an empty or foreign remote, before creating anything.
    problem = endpoint_problem(endpoint_url) if endpoint_url is not None else None
    if problem:
        raise InvalidInputError(problem)
    open_spec(RemoteSpec("origin", url, endpoint_url)).require_format()
    target = Path(path)
    existed = target.exists()
    ctx = init_context(path, config or RepoConfig())  # refuses a folder with anything in it: the rest is ours
    try:
        add(ctx, "origin", url, endpoint_url)
        with writing(ctx):
            report = fetch(ctx, "origin", progress)
            branches = ctx.refs.list(f"{REMOTES}origin/")
            for branch, oid in branches.items():
                ctx.refs.update(HEADS + branch, oid, expected=None, reason=f"clone: from {url}")
        if branches:
            ctx.refs.set_head_branch(DEFAULT_BRANCH if DEFAULT_BRANCH in branches else min(branches))
    except BaseException:
        _remove_failed_clone(target, existed)
        raise
    return ctx, report


def _remove_failed_clone(target: Path, existed: bool) -> None:
    """What a failed clone made goes, as git does, so that running it again works: the folder,
    or only its contents when it existed before (empty: init refuses any other)."""
    if not existed:
        shutil.rmtree(target, ignore_errors=True)
        return
    for child in target.iterdir() if target.is_dir() else ():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
