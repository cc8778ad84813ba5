"""Lazy reads from a remote: objects this repository lacks are read on demand, one ranged read
of a pack each, and kept in a local cache (``remote-cache/<name>/objects/``).

``attach`` adds a ``RemoteObjects`` source to the sources the repository's store reads through
(``repository/sources.py``, the seam overlays use for their base repositories), so checkout, ``open`` and ``load_state`` of a
commit only the remote holds fetch exactly the chunks they decode (a delta's base too) and
nothing else: ``checkout REF --only 'model.*' --remote origin`` never transfers the optimizer
state. The cache is separate from ``objects/`` on purpose: a commit whose objects are only
partly here must never look complete to fetch, gc or fsck. Every object read is decoded and
re-hashed by the store as any other read.
"""

from __future__ import annotations

from collections.abc import Mapping

from ckstore.errors import IntegrityError, ObjectMissingError, RefNotFoundError
from ckstore.format.ids import ObjectId
from ckstore.remote.layout import Holdings, Located, RemoteRepo, pack_key, retry_when_gone
from ckstore.remote.names import cache_backend, default_name, open_remote
from ckstore.repository.context import RepoContext
from ckstore.repository.reader import VerifiedReader
from ckstore.repository.refs import HEADS, TAGS
from ckstore.repository.store import ObjectStore, object_key

# Rounds of other copies a read tries when the chosen ones do not decode (a cycle of copies).
MAX_COPY_ROUNDS = 8


class RemoteObjects:
    """An object source (``sources.ObjectSource``) that reads what its cache lacks from a
    remote's packs."""

    def __init__(self, remote: RemoteRepo, cache: ObjectStore, prefix_reads: bool = False) -> None:
        # ``prefix_reads``: a header asked for is read alone (a ranged read of its bytes) rather
        # than with its object, which is then cached: for readers that look at many headers and
        # few bodies (remote compaction's chain heights); a checkout reads both.
        self.prefix_reads = prefix_reads
        self.backend = cache.backend
        self.remote = remote
        self._where: Holdings | None = None
        self.fetched_bytes = 0  # bytes read from the remote (benchmarks and tests)
        self.fetched_objects = 0
        # Where the chosen copies chained into a cycle: the copy read instead, and those tried.
        self._override: dict[str, Located] = {}
        self._tried: dict[str, set[str]] = {}
        self._walk: list[str] = []  # objects downloaded by the read in progress

    def where(self) -> Holdings:
        if self._where is None:
            self._where = self.remote.holdings()
        return self._where

    def has(self, oid: str) -> bool:
        return self.backend.exists(object_key(oid)) or oid in self.where()

    def has_durable(self, oid: str) -> bool:
        return False  # a cached copy is not this repository's: writes never deduplicate against it

    def read_stored(self, oid: str, n: int | None, context: str) -> bytes:
        key = object_key(oid)
        try:
            return self.backend.get(key) if n is None else self.backend.get_prefix(key, n)
        except KeyError:
            pass
        if n is not None and self.prefix_reads:
            # A header only: unverified, as a local header read is; verified when read whole.
            return retry_when_gone(lambda: self._download_prefix(oid, n, context), self._forget_holdings)
        for _ in range(MAX_COPY_ROUNDS):
            self._walk = []
            data, where = self._download(oid, context)
            # Verified before it is cached (a damaged copy never sticks), by one reader whose chain
            # walk spans the remote: bases come raw from the remote on the same path, so a cycle or
            # an overlong chain there is refused like a local one; each verified link is cached.
            try:
                VerifiedReader(self._stored, on_verified=self._keep).verify(oid, data, context + where)
            except IntegrityError:
                # Copies sent at different moments may chain into a cycle (chains.py): the next
                # copy of an object on the walk breaks it; with none left, the error stands.
                if self._other_copies(self._walk):
                    continue
                raise
            return data if n is None else data[:n]
        raise IntegrityError(f"object {oid}{context}: no copy on remote {self.remote.name} decodes")

    def _other_copies(self, walk: list[str]) -> bool:
        """Count on the next copy of each object the failed read walked (that has one left)."""
        where = self.where()
        changed = False
        for o in dict.fromkeys(walk):
            tried = self._tried.setdefault(o, set())
            current = self._override.get(o) or where.get(o)
            if current is not None:
                tried.add(current.pack_id)
            if (loc := where.next_copy(o, tried)) is not None:
                self._override[o] = loc
                changed = True
        return changed

    def _stored(self, oid: str, context: str) -> bytes:
        """An object's stored bytes, unverified: from the cache, else from the remote."""
        try:
            return self.backend.get(object_key(oid))
        except KeyError:
            return self._download(oid, context)[0]

    def _download(self, oid: str, context: str) -> tuple[bytes, str]:
        """Its stored bytes, read from the remote, and where they were read (for errors); a pack
        deleted since the holdings were read (a push superseded it) sends it to the holdings
        again: the object is in another pack."""
        return retry_when_gone(lambda: self._download_once(oid, context), self._forget_holdings)

    def _forget_holdings(self) -> None:
        self._where = None
        self._override.clear()
        self._tried.clear()

    def _download_once(self, oid: str, context: str) -> tuple[bytes, str]:
        loc = self._override.get(oid) or self.where().get(oid)
        self._walk.append(oid)
        if loc is None:
            raise ObjectMissingError(f"object {oid} is missing{context} (not on remote {self.remote.name} either)")
        ((_, view),) = self.remote.read_objects(loc.pack_id, [loc.entry])
        data = bytes(view)
        self.fetched_bytes += len(data)
        self.fetched_objects += 1
        return data, f" (read from {self.remote.describe(pack_key(loc.pack_id))})"

    def _download_prefix(self, oid: str, n: int, context: str) -> bytes:
        loc = self.where().get(oid)
        if loc is None:
            raise ObjectMissingError(f"object {oid} is missing{context} (not on remote {self.remote.name} either)")
        (data,) = self.remote.read_ranges(loc.pack_id, [(loc.entry.offset, min(n, loc.entry.length))])
        self.fetched_bytes += len(data)
        return bytes(data)

    def _keep(self, oid: str, data: bytes | memoryview) -> None:
        self.backend.put_if_absent(object_key(oid), bytes(data))


class RemoteNames:
    """A name source (``sources.NameSource``): the remote's branch and tag names (``NAME/BRANCH``,
    and ``BRANCH`` or ``TAG`` when this repository has no such name), without writing any ref here:
    a ref naming a commit whose objects are not here would look like damage to fsck."""

    def __init__(self, name: str, refs: Mapping[str, str]) -> None:
        self.names: dict[str, ObjectId] = {}
        for ref, oid in refs.items():
            for prefix in (HEADS, TAGS):
                if ref.startswith(prefix):
                    short = ref[len(prefix) :]
                    self.names.setdefault(short, ObjectId(oid))
                    if prefix == HEADS:
                        self.names[f"{name}/{short}"] = ObjectId(oid)

    def resolve_name(self, name: str) -> ObjectId:
        if name in self.names:
            return self.names[name]
        raise RefNotFoundError(f"unknown revision {name!r} (not a branch, tag or commit id, here or on the remote)")


def attach(ctx: RepoContext, name: str | None = None) -> RemoteObjects:
    """Make ``ctx`` read missing objects from remote ``name`` and resolve its branch and tag names."""
    name = default_name(ctx) if name is None else name
    remote = open_remote(ctx, name)
    remote.require_format()
    lazy = RemoteObjects(remote, ObjectStore(cache_backend(ctx, name), ctx.store.settings))
    ctx.store.sources.append(lazy)
    # A damaged remote ref is left out (fetch names it); the others still resolve.
    ctx.graph.name_sources.append(RemoteNames(name, remote.list_refs(problems={})))
    return lazy


__all__ = ["RemoteNames", "RemoteObjects", "attach"]
