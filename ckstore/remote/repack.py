"""Remote repack: a remote keeps pace with local compaction.

Local compaction re-encodes the previous epoch's chunks as deltas of the new epoch's after they
were pushed, so a remote that kept the first copy of every object would hold each epoch whole.
A remote's packs are immutable; instead of rewriting one, remote gc first sends again
(``superseded``, push.send_superseded) the objects of every pack that local compaction has made markedly smaller (the whole pack's objects,
in their local encodings, verified like any other), and every reader that chooses among copies
(push's reliance, fetch, remote gc's liveness) prefers the same copy (``RemoteRepo.locate``):
the smallest, not in a pack that holds a superseded copy. The old pack then holds no object anybody
counts on, and remote gc condemns it and deletes it after its grace period (gc.py): two-phase, so
a reader or pusher that located an object there before still finds it for the grace period.
Every copy is a valid encoding of its name (push decodes and re-hashes each before sending).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from ckstore.remote.layout import RemoteRepo

# A pack is re-sent when local compaction stores its objects in at least this much less: below
# it the upload would cost more than it saves (a 1.1x bound tolerates the rest).
MIN_SAVING = 0.10


def superseded(remote: RemoteRepo, local_size: Callable[[str], int | None], skip: Collection[str] = ()) -> list[str]:
    """Objects to send again so that whole packs become superseded: for every pack (not in
    ``skip``) whose objects are all here and would store in at least ``MIN_SAVING`` less as
    encoded here, each of its objects that no other pack holds in as few bytes as here."""
    catalogue = {p: i for p, i in remote.catalogue(refresh=False).items() if p not in skip}
    columns = {p: (ids, lengths) for p, i in catalogue.items() for ids, _, lengths in [i.columns()]}
    lengths: dict[str, list[tuple[int, str]]] = {}
    for pack_id, (ids, sizes) in columns.items():
        for oid, n in zip(ids, sizes):
            lengths.setdefault(oid, []).append((n, pack_id))

    def elsewhere(oid: str, pack_id: str) -> float:
        return min((n for n, p in lengths[oid] if p != pack_id), default=float("inf"))

    out: dict[str, None] = {}
    for pack_id, index in sorted(catalogue.items()):
        ids, stored = columns[pack_id]
        local_sizes = {oid: local_size(oid) for oid in ids}
        here: Mapping[str, int] = {k: v for k, v in local_sizes.items() if v is not None}
        if len(here) < len(local_sizes):
            continue  # objects only the remote has keep this pack live whatever is sent
        send = [(oid, n) for oid, n in zip(ids, stored) if elsewhere(oid, pack_id) > here[oid]]
        saving = sum(n - here[oid] for oid, n in send if here[oid] < n)
        if saving > 0 and saving >= MIN_SAVING * index.pack_size:
            out.update(dict.fromkeys(oid for oid, _ in send))
    return list(out)
