"""Delta chains as a remote stores them, and the rule that keeps them finite.

A remote may hold several copies of one object, each a valid encoding of its name but made at
different moments: a push reads the objects it sends one by one while a local compaction
re-encodes them, two pushers send one object at once, a push sends again what compaction made
smaller. Copies chosen by size alone (``layout.choose_copies``) can then form a delta cycle
(X a delta of Z, Z of Y, Y of X) that no reader can decode, though every copy is sound. So
(docs/format.md 15.7, "Delta cycles"):

- a push never sends a set of copies with a cycle in it: a delta whose bases' copies, as this
  push sends them, lead back to it goes whole (``SentChains``);
- a push sends again a smaller copy only when, with the copies sent with it and the remote's
  chosen copies of its other bases, it ends in a whole object (``acyclic_resends``);
- a remote gc, and a push dropping what it superseded, keep every copy of an object whose
  chosen copies cycle, with what those copies need (``breakers``), so whatever cycle
  concurrent writers made, the copy that breaks it stays; a reader that meets a cycle reads
  another copy (landing.py).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from collections.abc import Set as AbstractSet

from ckstore.codecs.objects import BASES_PREFIX_SIZE, delta_bases
from ckstore.errors import IntegrityError
from ckstore.format.pack import PackTable
from ckstore.remote.layout import Located, RemoteRepo, all_copies, pack_key
from ckstore.repository.reader import delta_closure_many, in_cycles
from ckstore.repository.store import ObjectStore


def remote_bases(
    remote: RemoteRepo,
    where: Mapping[str, Located],
    chunks: AbstractSet[str],
    edges: dict[str, tuple[str, ...]] | None = None,
    stop: Collection[str] = (),
) -> set[str]:
    """``chunks`` plus every delta base they need as stored on the remote in the copies
    ``where`` chooses (headers read there, one ranged read per pack and level). ``edges``
    receives each copy read and its bases; objects in ``stop`` are not read."""
    return delta_closure_many(
        chunks,
        lambda todo: _bases_on_remote(remote, [where[o] for o in todo]),
        lambda o: o in where and o not in stop,
        edges,
    )


def _bases_on_remote(remote: RemoteRepo, copies: list[Located]) -> Iterator[tuple[str, tuple[str, ...]]]:
    """Each copy's object id and delta bases, read from its header on the remote."""
    by_pack: dict[str, list[Located]] = {}
    for loc in copies:
        by_pack.setdefault(loc.pack_id, []).append(loc)
    for pack_id, locs in by_pack.items():
        ranges = [(loc.entry.offset, min(loc.entry.length, BASES_PREFIX_SIZE)) for loc in locs]
        for loc, head in zip(locs, remote.read_ranges(pack_id, ranges)):
            try:
                yield loc.entry.id, delta_bases(head)
            except IntegrityError as exc:
                raise IntegrityError(
                    f"object {loc.entry.id} in {remote.describe(pack_key(pack_id))} is corrupt: {exc}"
                ) from None


class SentChains:
    """The delta bases of the copies one upload has sent, to keep that set free of cycles."""

    def __init__(self) -> None:
        self._bases: dict[str, tuple[str, ...]] = {}

    def closes_cycle(self, oid: str, bases: tuple[str, ...]) -> bool:
        """Whether sending ``oid`` as a delta of ``bases`` would close a cycle with what was sent:
        a base's copy sent here leads back to ``oid``. Bases not sent here are on the remote
        already, closed under references without ``oid`` (it is missing there), so no chain
        through them returns."""
        seen: set[str] = set()
        todo = list(bases)
        while todo:
            b = todo.pop()
            if b == oid:
                return True
            if b not in seen:
                seen.add(b)
                todo.extend(self._bases.get(b, ()))
        return False

    def sent(self, oid: str, bases: tuple[str, ...]) -> None:
        self._bases[oid] = bases


def acyclic_resends(
    store: ObjectStore, remote: RemoteRepo, where: Mapping[str, Located], again: list[str]
) -> dict[str, tuple[str, ...]]:
    """The objects of ``again`` (held on the remote, stored smaller here) whose copy here, once
    sent, ends in whole objects, with the bases judged: over the copies sent with it (whole
    packs are sent again together and their old packs dropped, supersede.py) and, for the bases
    not sent again, the remote's chosen copies, which could lead back to it (compaction turned a
    delta's base into a delta of it since). The sender sends such an object only while it
    still has the bases judged."""
    resent = set(again)
    local = {oid: tuple(store.bases_of(oid)) for oid in again}
    while True:
        roots = {b for o in resent for b in local[o] if b not in resent and b in where}
        edges: dict[str, tuple[str, ...]] = {}
        remote_bases(remote, where, roots, edges, stop=resent)
        cyclic = in_cycles({**edges, **{o: local[o] for o in resent}}) & resent
        if not cyclic:
            return {oid: local[oid] for oid in again if oid in resent}
        resent -= cyclic  # their copies on the remote stay the ones counted on


def breakers(
    remote: RemoteRepo, tables: Mapping[str, PackTable], where: Mapping[str, Located], objects: AbstractSet[str]
) -> tuple[set[str], set[str]]:
    """Close ``objects`` under delta bases over the copies ``where`` chooses, and where those
    copies cycle, over every copy of the objects on a cycle too (one of them breaks it, and a
    reader falls back to it): the objects so needed, and the packs holding the copies that are
    counted on (chosen ones, and every copy of an object on a cycle)."""
    edges: dict[str, tuple[str, ...]] = {}
    needed = remote_bases(remote, where, set(objects), edges)
    packs = {where[o].pack_id for o in needed if o in where}
    settled: set[str] = set()
    while cyclic := in_cycles(edges) - settled:
        settled |= cyclic
        others = [c for oid in sorted(cyclic) for c in all_copies(sorted(tables.items()), oid) if c != where.get(oid)]
        packs |= {loc.pack_id for loc in others}
        bases = {b for _, bs in _bases_on_remote(remote, others) for b in bs}
        needed |= remote_bases(remote, where, bases - needed, edges)
        packs |= {where[o].pack_id for o in needed if o in where}
    return needed, packs


def chain_closure(
    remote: RemoteRepo, where: Mapping[str, Located], objects: AbstractSet[str]
) -> tuple[set[str], set[str]]:
    """``objects`` with every delta base their chosen copies need (``remote_bases``), and those
    of them on or behind a cycle of chosen copies."""
    edges: dict[str, tuple[str, ...]] = {}
    needed = remote_bases(remote, where, set(objects), edges)
    return needed, in_cycles(edges)


__all__ = ["SentChains", "acyclic_resends", "breakers", "chain_closure", "remote_bases"]
