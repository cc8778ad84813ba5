"""Lazy reads from a remote: objects this repository lacks are read on demand, one ranged read
of a pack each, and kept in a local cache (``remote-cache/<name>/objects/``).

``attach`` adds a ``RemoteObjects`` store to the repository's read-through alternates (the same
seam overlays use for their base repositories), so checkout, ``open`` and ``load_state`` of a
commit only the remote holds fetch exactly the chunks they decode (a delta's base too) and
nothing else: ``checkout REF --only 'model.*' --remote origin`` never transfers the optimizer
state. The cache is separate from ``objects/`` on purpose: a commit whose objects are only
partly here must never look complete to fetch, gc or fsck. Every object read is decoded and
re-hashed by the store as any other read.
"""

from __future__ import annotations

from .context import RepoContext
from .errors import ObjectMissingError
from .refs import HEADS, TAGS
from .remote.layout import Located, RemoteRepo
from .remotes import cache_backend, default_name, open_remote, tracking_ref
from .store import ObjectStore, object_key


class RemoteObjects(ObjectStore):
    """An object store that reads what its cache lacks from a remote's packs."""

    def __init__(self, remote: RemoteRepo, cache: ObjectStore) -> None:
        super().__init__(cache.backend, cache.settings)
        self.remote = remote
        self._where: dict[str, Located] | None = None
        self.fetched_bytes = 0  # bytes read from the remote (benchmarks and tests)
        self.fetched_objects = 0

    def where(self) -> dict[str, Located]:
        if self._where is None:
            self.remote.catalogue()
            self._where = self.remote.locate(exclude=self.remote.read_condemned().claimed())
        return self._where

    def has(self, oid: str) -> bool:
        return self.has_local(oid) or oid in self.where()

    def _read_any(self, oid: str, n: int | None, context: str) -> bytes:
        key = object_key(oid)
        try:
            return self.backend.get(key) if n is None else self.backend.get_prefix(key, n)
        except KeyError:
            pass
        loc = self.where().get(oid)
        if loc is None:
            raise ObjectMissingError(f"object {oid} is missing{context} (not on remote {self.remote.name} either)")
        ((_, data),) = self.remote.read_objects(loc.pack_id, [loc.entry])
        self.fetched_bytes += len(data)
        self.fetched_objects += 1
        # Cached as fetched; the store decodes and re-hashes it on every use, so a damaged
        # copy is an IntegrityError, never data.
        self.backend.put_if_absent(key, data)
        return data if n is None else data[:n]


def attach(ctx: RepoContext, name: str | None = None) -> RemoteObjects:
    """Make ``ctx`` read missing objects from remote ``name`` and resolve its refs as NAME/BRANCH
    (the remote's current refs are recorded as remote-tracking refs, without fetching objects)."""
    name = default_name(ctx) if name is None else name
    remote = open_remote(ctx, name)
    remote.require_format()
    lazy = RemoteObjects(remote, ObjectStore(cache_backend(ctx, name), ctx.store.settings))
    ctx.store.alternates.append(lazy)
    for ref, oid in remote.list_refs().items():
        local = tracking_ref(name, ref)
        if local is not None and ctx.refs.read(local) != oid:
            ctx.refs.update(local, oid, reason=f"remote {name}: refs read for a lazy read")
        elif ref.startswith(TAGS) and ctx.refs.read(ref) is None:
            ctx.refs.update(ref, oid, expected=None, reason=f"remote {name}: tag read for a lazy read")
    return lazy


__all__ = ["HEADS", "RemoteObjects", "attach"]
