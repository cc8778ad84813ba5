"""What a remote holds, looked up per object (``RemoteRepo.holdings``, remote/layout.py): the
same copy of each object as the whole map (``RemoteRepo.locate``) chooses, whatever packs hold
it, which of them a gc condemned or claimed, and how long each copy is."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from ckstore.codecs.objects import Kind, encode
from ckstore.format.pack_build import PackBuilder
from ckstore.remote.layout import Condemned, RemoteRepo
from ckstore.transport.directory import DirectoryTransport

IDS = [bytes([i]).hex() * 32 for i in range(6)]
# Stored lengths a copy can have (random bytes stay raw: header + these many bytes).
LENGTHS = (20, 40)

packs_strategy = st.lists(
    st.dictionaries(st.sampled_from(range(len(IDS))), st.sampled_from(LENGTHS), min_size=1), min_size=1, max_size=4
)


def _upload(remote: RemoteRepo, objects: dict[int, int]) -> str:
    """A pack holding ``IDS[i]`` as ``n`` random stored bytes for each ``i: n``; its id."""
    builder = PackBuilder()
    parts = [builder.header]
    for i, n in sorted(objects.items()):
        stored = encode(os.urandom(n), Kind.CHUNK, 1)
        builder.add(IDS[i], stored)
        parts.append(stored)
    tail, index = builder.close()
    remote.upload_pack(builder.pack_id, [*parts, tail], index.to_bytes)
    return builder.pack_id


@settings(max_examples=40, deadline=None)
@given(packs_strategy, st.data())
def test_holdings_choose_the_copy_locate_chooses(packs: list[dict[int, int]], data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as root:
        remote = RemoteRepo(DirectoryTransport(Path(root)), lambda r: r, lambda k: k)
        ids = [_upload(remote, objects) for objects in packs]
        condemned = Condemned({p: (0.0, data.draw(st.booleans())) for p in ids if data.draw(st.booleans())})
        forget = {p for p in ids if data.draw(st.booleans())}
        held = remote.holdings(forget, condemned)
        whole = remote.locate(exclude=condemned.claimed() | forget, avoid=condemned.packs)
        for oid in IDS:
            assert (oid in held) == (oid in whole)
            assert held.get(oid) == whole.get(oid)
        assert dict(held) == whole
