"""Landing fetched objects (fetch.py): downloaded a few packs at a time, each object decoded and
re-hashed against its name on a worker as it arrives, then staged into rolling ``Backend.batch``es
that land on a background thread while later packs download. No commit names anything here:
fetch writes the commits once every batch landed (fetch.py says why).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack

from ckstore.codecs.objects import ENCODINGS_BY_REPO_VERSION, Encoding, delta_bases, parse_header
from ckstore.errors import CkstoreError, IntegrityError
from ckstore.format.ids import ObjectId
from ckstore.format.manifest import ChunkReader, Commit, chunks_beyond
from ckstore.format.settings import NEW_REPO_VERSION
from ckstore.remote.layout import Holdings, Located, RemoteRepo, pack_key
from ckstore.repository.reader import VerifiedReader, delta_closure
from ckstore.repository.store import ObjectStore, object_key

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


def read_objects(
    remote: RemoteRepo, where: Mapping[str, Located], oids: Iterable[str]
) -> Iterator[tuple[str, str, bytes | memoryview]]:
    """(object id, pack id, stored bytes) of each object, by ranged reads grouped per pack; a few
    packs are read at once, so memory stays a few packs' worth of wanted ranges."""
    by_pack: dict[str, list[Located]] = {}
    for oid in dict.fromkeys(oids):
        loc = where[oid]
        by_pack.setdefault(loc.pack_id, []).append(loc)

    def read(pack_id: str) -> list[tuple[str, bytes | memoryview]]:
        return [(e.id, data) for e, data in remote.read_objects(pack_id, [loc.entry for loc in by_pack[pack_id]])]

    pending: list[tuple[str, Future[list[tuple[str, bytes | memoryview]]]]] = []
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


class _Batch:
    """One open ``Backend.batch`` and the staging writes still going into it."""

    def __init__(self, store: ObjectStore) -> None:
        self.stack = ExitStack()
        self.view = self.stack.enter_context(store.batch(LAND_BATCH))
        self.bytes = 0
        self.writers = 0


class Batches:
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

    def put(self, oid: str, data: bytes | memoryview) -> None:
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


class Lander:
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

    def __init__(
        self,
        view: ObjectStore,
        batches: Batches,
        remote: RemoteRepo,
        where: Holdings,
        pool: ThreadPoolExecutor,
        received: Callable[[int], None],
    ) -> None:
        self.view, self.remote, self.where, self.pool = view, remote, where, pool
        self.received = received  # called with each downloaded object's stored length
        self.batches = batches
        self.queued: dict[str, str] = {}  # object -> the commit that first needed it (for errors)
        self.queued_bytes = 0
        self.origin: dict[str, str] = {}  # object -> pack id, every object downloaded here
        self.verified: set[str] = set()  # objects of this fetch verified and staged
        # Verified raw bytes of bases deltas wait for, at most BASE_CACHE of them; a base dropped
        # is read again through the store (it landed), so memory never grows with the fetch.
        self.reader = VerifiedReader(self._stored, base_cache=BASE_CACHE)
        self.waiting: dict[str, list[tuple[str, str, bytes | memoryview]]] = {}  # base -> deltas waiting for it
        self.late: list[tuple[str, str, bytes | memoryview]] = []  # deltas on a local base whose chain is incomplete
        self.tried: dict[str, set[str]] = {}  # object -> packs whose copy waited on a cycle
        self.lock = threading.Condition()
        self.futures: list[Future[None]] = []
        self.in_flight = 0  # stored and decoded bytes handed to workers and not yet done (memory bound)
        self.failed = False
        # Before an object in an encoding newer than format 2 (a predicted or context-sorted delta) is staged.
        self.on_newer_encoding: Callable[[Encoding], None] = lambda encoding: None

    def want_commit(
        self, oid: ObjectId, commit: Commit, pieces: set[ObjectId] | None = None, read: ChunkReader | None = None
    ) -> None:
        """Queue what ``commit`` needs that is not here. ``pieces``: file-list pieces (format.md
        5.3) of commits here or wanted before, whose chunks are here or queued (extended with
        this commit's); ``read`` reads this commit's other pieces."""
        named = commit.all_chunks() if pieces is None or read is None else chunks_beyond(commit, pieces, read)
        chunks = {c.id for c in named} - self.queued.keys()
        if pieces is not None:
            pieces.update(p.id for p in commit.file_list)
        todo: list[str] = [c for c in chunks if not self.view.has_durable(c)]
        todo += missing_bases(self.view, chunks - set(todo))
        for o in dict.fromkeys(todo):
            if o not in self.queued:
                self.queued[o] = oid
                loc = self.where.get(o)
                self.queued_bytes += loc.entry.length if loc is not None else 0

    def run(self) -> None:
        try:
            self._download(list(self.queued))
            self._drain()
            while self.waiting and self._other_copies():
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
        if self.waiting:  # a real check, not an assert: it must hold under python -O
            stuck = sorted(o for items in self.waiting.values() for o, _, _ in items)
            raise IntegrityError(
                f"remote {self.remote.name}: object {stuck[0]}"
                + (f" and {len(stuck) - 1} more" if len(stuck) > 1 else "")
                + " never resolved: its delta bases form a cycle or never came"
            )

    def _download(self, todo: list[str], first: Mapping[str, Located] | None = None) -> None:
        """Download ``todo`` (from the copies ``first`` names, else the chosen ones), then the
        bases they lack, level by level."""
        copies = dict(first or {})
        while todo:
            absent = [o for o in dict.fromkeys(todo) if o in copies or self._absent(o)]
            for o in absent:
                if o not in copies and o not in self.where:
                    needer = self.queued.get(o, "?")
                    raise IntegrityError(
                        f"remote {self.remote.name}: object {o} (needed by commit {needer[:12]}) is in no pack there"
                    )
            chosen = {o: copies.get(o) or self.where[o] for o in absent}
            for o, loc in chosen.items():
                self.origin[o] = loc.pack_id
            todo, copies = [], {}
            for o, pack_id, data in read_objects(self.remote, chosen, absent):
                self.received(len(data))
                todo += self._arrive(o, pack_id, data)

    def _absent(self, o: str) -> bool:
        return o not in self.origin and not self.view.has_durable(o)

    def _other_copies(self) -> bool:
        """Deltas still waiting once everything came wait on a cycle of the copies chosen
        (writers at different moments each sent a sound copy; chains.py): read the next copy of
        each, one of which breaks the cycle. False when none is left to try."""
        stuck = {o: pack_id for items in self.waiting.values() for o, pack_id, _ in items}
        retry: dict[str, Located] = {}
        for o, pack_id in stuck.items():
            if (loc := self.where.next_copy(o, self.tried.setdefault(o, {pack_id}))) is not None:
                retry[o] = loc
        if not retry:
            return False
        with self.lock:
            for base in list(self.waiting):
                self.waiting[base] = [item for item in self.waiting[base] if item[0] not in retry]
                if not self.waiting[base]:
                    del self.waiting[base]
        for o, loc in retry.items():
            self.tried[o].add(loc.pack_id)
        self._download(list(retry), retry)
        return True

    def _fail(self, o: str, pack_id: str, reason: str) -> IntegrityError:
        said = f"object {o} is corrupt: "
        reason = reason.removeprefix(said)  # the reader's own error names the object already
        return IntegrityError(f"{said}{reason} (fetched from {self.remote.describe(pack_key(pack_id))})")

    def _arrive(self, o: str, pack_id: str, data: bytes | memoryview) -> list[str]:
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
        incomplete = missing_bases(self.view, {b for b in bases if b not in self.origin and b not in absent})
        if incomplete:
            self.late.append((o, pack_id, data))  # verified once its bases' chains are staged
            return absent + incomplete
        if not self._park_unverified(o, pack_id, data, bases, absent):
            self._submit(o, pack_id, data, wait=True)
        return absent

    def _park_unverified(
        self, o: str, pack_id: str, data: bytes | memoryview, bases: Sequence[str], absent: Sequence[str]
    ) -> bool:
        """Park the object on one of its bases that came (or comes) in this fetch and is not
        verified yet; False when there is none (it can be verified now)."""
        with self.lock:
            waiting = [b for b in bases if b in self.origin and b not in self.verified] + list(absent)
            if waiting:
                self._park(waiting[0], (o, pack_id, data))
            return bool(waiting)

    def _park(self, base: str, item: tuple[str, str, bytes | memoryview]) -> None:
        self.waiting.setdefault(base, []).append(item)

    def _submit(self, o: str, pack_id: str, data: bytes | memoryview, wait: bool) -> None:
        with self.lock:
            # Downloads pause while workers hold this much; a worker releasing waiting deltas
            # never waits (the bytes are in memory already).
            while wait and self.in_flight > MAX_IN_FLIGHT and not self.failed:
                self.lock.wait()
            self.in_flight += _cost(data)
            self.futures.append(self.pool.submit(self._verify, o, pack_id, data))

    def _verify(self, o: str, pack_id: str, data: bytes | memoryview) -> None:
        try:
            if not self.failed:
                self._verify_one(o, pack_id, data)
        finally:
            with self.lock:
                self.in_flight -= _cost(data)
                self.lock.notify_all()

    def _verify_one(self, o: str, pack_id: str, data: bytes | memoryview) -> None:
        # Every object is decoded and re-hashed against its name before it is staged, whatever
        # its pack's version: a version 2 digest comes from the same party as the bytes, so it
        # proves only that they arrived intact, not that they are the object named.
        try:
            raw, depth = self.reader.chunk_depth(o, None, "", data)
        except CkstoreError as exc:
            raise self._fail(o, pack_id, str(exc)) from None
        self.batches.put(o, data)
        with self.lock:
            self.verified.add(o)
            released = self.waiting.pop(o, [])
        if released:  # kept for the deltas waiting on it, within BASE_CACHE (never unbounded)
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


def missing_bases(view: ObjectStore, present: AbstractSet[str]) -> list[str]:
    """Delta bases that objects already here lack: a crash while an earlier fetch's batch was
    landing can leave an object in place without its base (and without any commit naming it)."""
    return sorted(
        b for b in delta_closure(present, view.bases_of, follow=view.has_durable) - present if not view.has_durable(b)
    )


def _cost(data: bytes | memoryview) -> int:
    """Memory a worker holds verifying one object: its stored and its decoded bytes (the header
    declares the latter; a 10 KB frame of 256 MiB counts as 256 MiB)."""
    try:
        return len(data) + parse_header(data).raw_len
    except IntegrityError:
        return len(data)
