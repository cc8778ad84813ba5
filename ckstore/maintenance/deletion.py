"""Deleting gc's victims so that gc can be stopped anywhere (SIGKILL, Ctrl-C, an I/O error).

Two readers trust presence: a commit deduplicates against a chunk that is here (store.py
``put_chunk``), and fetch takes a commit that is here as whole, with its objects and history
(fetch.py). So at every instant of a gc, what is left must deserve that trust: every object
left decodes (the bases of each of its copies are left too) and every commit left has its
chunks and its parents. Victims therefore go in dependency order, dependents first:

1. commits, each before the commits it names as parents (or as an overlay's base);
2. then chunks, each before the chunks any copy of it is a delta of (a loose copy and a packed
   one may be encoded differently: the bases of both count).

A loose copy goes with one unlink. Packed copies go by rewriting only the packs that hold them
(``Backend.drop_packed``), a set of victims at a time that none of the victims still left
depends on; what a rewrite drops vanishes when its old pack is unlinked. Victims that need no
rewrite go first, so space is freed before any is needed. When a rewrite fails for want of
space, its victims stay, and so does everything they need; the rest still goes, and gc reports
what it left (the next gc, with the space this one freed, takes it).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from ckstore.errors import CkstoreError, StorageError
from ckstore.format.ids import ObjectId, object_key
from ckstore.repository.context import RepoContext
from ckstore.repository.store import BASES_PREFIX_SIZE, bases_in


@dataclass
class Deleted:
    objects: int = 0
    bytes: int = 0
    left: dict[str, int] = field(default_factory=dict)  # victims kept for want of space, with sizes
    no_space: str = ""  # the error that stopped a rewrite, when one did


def delete_in_order(
    ctx: RepoContext, victims: Mapping[str, int], commits: Collection[str], advance: Callable[[int], object]
) -> Deleted:
    """Delete ``victims`` (object id -> stored size; ``commits`` are those that are commits)."""
    packed = ctx.backend.packed_prefixes(list(victims), BASES_PREFIX_SIZE)
    run = _Run(ctx, victims, packed, advance)
    run.order(set(commits), _commit_needs(ctx, victims, commits))
    chunks = {oid for oid in victims if oid not in commits}
    blocked = _needed_by_commits_left(ctx, run.result.left, chunks)
    run.order(chunks, _chunk_needs(ctx, chunks, packed), blocked)
    return run.result


class _Run:
    def __init__(
        self,
        ctx: RepoContext,
        victims: Mapping[str, int],
        packed: Mapping[str, list[bytes]],
        advance: Callable[[int], object],
    ) -> None:
        self.ctx, self.victims, self.packed, self.advance = ctx, victims, packed, advance
        self.result = Deleted()

    def order(self, nodes: set[str], needs: dict[str, set[str]], blocked: Collection[str] = ()) -> None:
        """Delete ``nodes`` dependents first (``needs[x]``: the nodes that must outlive x); a
        node in ``blocked`` stays, and so does everything it needs."""
        waiting = dict.fromkeys(nodes, 0)  # how many nodes still here need each node
        for x in nodes:
            for d in needs.get(x, ()):
                waiting[d] += 1
        for x in blocked:
            if x in nodes:
                self.result.left[x] = self.victims[x]
        ready = sorted(x for x in nodes if not waiting[x] and x not in blocked)
        stuck: set[str] = set(blocked)

        def gone(x: str) -> None:
            for d in needs.get(x, ()):
                waiting[d] -= 1
                if not waiting[d] and d not in stuck:
                    ready.append(d)

        pending_packed: list[str] = []
        while ready or pending_packed:
            while ready:  # loose-only victims first: an unlink each, no space needed
                x = ready.pop()
                if x in self.packed:
                    pending_packed.append(x)
                    continue
                self._unlink(x)
                gone(x)
            if not pending_packed:
                break
            # Ready together, so none of them needs another: one rewrite may drop them all.
            batch, pending_packed = sorted(pending_packed), []
            if self._drop_packed(batch):
                for x in batch:
                    gone(x)
            else:
                stuck.update(batch)
                self.result.left.update({x: self.victims[x] for x in batch})
        for x in nodes:
            if waiting[x] and x not in stuck:
                self.result.left[x] = self.victims[x]  # needed by a victim left (or a damaged cycle)

    def _unlink(self, oid: str) -> None:
        if self.ctx.backend.delete(object_key(oid)):
            self._count(oid)

    def _drop_packed(self, batch: list[str]) -> bool:
        for oid in batch:  # a loose copy shadows the packed ones: it goes first, they stay readable
            self.ctx.backend.delete(object_key(oid))
        try:
            self.ctx.backend.drop_packed(batch)
        except StorageError as exc:
            if not exc.no_space:
                raise
            self.result.no_space = str(exc)
            return False
        for oid in batch:
            self._count(oid)
        return True

    def _count(self, oid: str) -> None:
        self.result.objects += 1
        self.result.bytes += self.victims[oid]
        self.advance(self.victims[oid])


def _commit_needs(ctx: RepoContext, victims: Mapping[str, int], commits: Collection[str]) -> dict[str, set[str]]:
    """For each victim commit, the victim commits it names (parents, an overlay's base)."""
    out: dict[str, set[str]] = {}
    for oid in commits:
        try:
            commit = ctx.graph.read_commit(oid, files=False)
        except CkstoreError:
            continue  # unreadable: nothing can rely on it, and it names nothing we can read
        named = [*commit.parents, *([commit.base.commit] if commit.base is not None else [])]
        out[oid] = {p for p in named if p in commits and p in victims}
    return out


def _chunk_needs(ctx: RepoContext, chunks: set[str], packed: Mapping[str, list[bytes]]) -> dict[str, set[str]]:
    """For each victim chunk, the victim chunks any of its copies is a delta of."""
    out: dict[str, set[str]] = {}
    for oid, bases in ctx.store.bases_or_errors(sorted(chunks)):
        found = set(bases) if isinstance(bases, tuple) else set()
        for prefix in packed.get(oid, ()):
            more = bases_in(oid, prefix)
            if isinstance(more, tuple):
                found.update(more)
        out[oid] = {b for b in found if b in chunks and b != oid}
    return out


def _needed_by_commits_left(ctx: RepoContext, left: Mapping[str, int], chunks: set[str]) -> set[str]:
    """The victim chunks that commits gc had to leave still name (none, unless a rewrite found
    no space)."""
    if not left:
        return set()
    from ckstore.maintenance.kept import commit_chunk_ids  # only on a full disk

    named: set[str] = set()
    for oid in left:
        try:
            named.update(commit_chunk_ids(ctx, oid))
        except CkstoreError:
            return set(chunks)  # cannot tell what it names: keep every chunk
    return {ObjectId(c) for c in named if c in chunks}
