"""What a fetch checks, and what a push refuses to send (docs/design.md, "Verification on arrival").

A version 2 pack index records the BLAKE3 of each object's stored bytes; a fetch checks arriving
objects against it instead of decoding them, which is sound only because a push decodes and
re-hashes every object before sending it. Remotes written before (version 1 packs and indexes)
stay readable, with every object decoded and re-hashed on arrival as before.
"""

from __future__ import annotations

import struct
from pathlib import Path

import blake3
import pytest

from ckstore.errors import IntegrityError
from ckstore.format.pack import parse_index, parse_pack
from ckstore.remote.layout import INDEXES, PACKS, index_key, pack_key, pack_name
from ckstore.repo import Repo
from ckstore.repository.store import object_key
from ckstore.transport import open_transport
from ckstore.transport.base import Transport
from ckstore.transport.testserver import S3Server
from tests.remote.epochs import digests, epoch_files, make_repo


def _transport(url: str, request: pytest.FixtureRequest) -> Transport:
    server: S3Server | None = request.getfixturevalue("s3_server") if url.startswith("s3://") else None
    return open_transport(url, server.options() if server else None)


def rewrite_as_version_1(t: Transport) -> list[str]:
    """Rewrite every pack of a remote as ckstore wrote them before digests (pack and index
    version 1, 40-byte entries, written here from docs/format.md 15.1-15.2); the new pack ids."""
    new = []
    for info in list(t.list(PACKS)):
        data = t.get(info.key)
        index = parse_pack(data, pack_name(info.key))
        assert index.version == 2
        table = b"".join(struct.pack("<32sII", bytes.fromhex(e.id), e.offset, e.length) for e in index.entries)
        end = min(e.offset for e in index.entries) + sum(e.length for e in index.entries)
        n = len(index.entries)
        trailer = struct.pack("<IB3s32s4s", n, 1, b"\0\0\0", blake3.blake3(table).digest(), b"CKPK")
        v1 = b"CKPK\x01\0\0\0" + data[8:end] + table + trailer
        pid = blake3.blake3(v1).hexdigest()
        body = struct.pack("<4sB3s32sQI4s", b"CKPI", 1, b"\0\0\0", bytes.fromhex(pid), len(v1), n, b"\0\0\0\0") + table
        t.put(pack_key(pid), v1)
        t.put(index_key(pid), body + blake3.blake3(body).digest())
        t.delete(index_key(index.pack_id))
        t.delete(info.key)
        new.append(pid)
    assert all(parse_index(t.get(i.key)).version == 1 for i in t.list(INDEXES))
    return new


def _flip_in_packs(t: Transport, oid: str) -> None:
    """Flip the last byte of ``oid``'s body (past its header) in every pack holding it."""
    for info in t.list(PACKS):
        data = t.get(info.key)
        entry = parse_pack(data, pack_name(info.key)).find(oid)
        if entry is not None:
            at = entry.end - 1
            t.put(info.key, data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1 :])


def test_version_1_remote_is_read_with_full_verification(
    tmp_path: Path, remote_url: tuple[str, str | None], request: pytest.FixtureRequest
) -> None:
    url, endpoint = remote_url
    a, ids = make_repo(tmp_path / "a", tmp_path / "work", range(1, 3))
    a.add_remote("origin", url, endpoint)
    a.push()
    t = _transport(url, request)
    rewrite_as_version_1(t)
    b, _ = Repo.clone(url, tmp_path / "b", endpoint_url=endpoint)
    for i, oid in enumerate(ids, start=1):
        b.checkout(oid, tmp_path / f"out{i}")
        assert digests(tmp_path / f"out{i}") == digests(tmp_path / "work" / f"e{i}")
    assert b.fsck(read_data=True) == []

    # A push to an old remote adds version 2 packs beside the version 1 ones; both are read.
    ids.append(a.commit(epoch_files(tmp_path / "work" / "e3", 3), message="epoch 3"))
    a.wait()
    assert a.push().packs == 1
    versions = sorted(parse_index(t.get(i.key)).version for i in t.list(INDEXES))
    assert versions[0] == 1 and versions[-1] == 2
    assert b.fetch().commits == 1
    b.checkout(ids[-1], tmp_path / "out3")
    assert digests(tmp_path / "out3") == digests(tmp_path / "work" / "e3")
    assert b.fsck(read_data=True) == []

    # Damage inside a version 1 pack has no digest to catch it: decoding does, and names it.
    deltas = {o: a.store.bases_of(o) for o in a.store.iter_ids() if a.store.bases_of(o) != ()}
    victim = next(
        o
        for o in a.store.iter_ids()
        if a.store.kind(o).name == "CHUNK"
        and all(o not in b for b in deltas.values())
        and o not in deltas
        and any(parse_index(t.get(i.key)).version == 1 and parse_index(t.get(i.key)).find(o) for i in t.list(INDEXES))
    )
    _flip_in_packs(t, victim)
    c = Repo.init(tmp_path / "c")  # a fetch (a failed clone removes its repository)
    c.add_remote("origin", url, endpoint)
    with pytest.raises(IntegrityError, match=f"object {victim} is corrupt") as err:
        c.fetch()
    assert err.value.exit_code == 4
    assert c.refs.list("refs/remotes/") == {} and c.fsck() == []


def test_a_damaged_object_is_caught_by_its_digest_and_named(
    tmp_path: Path, remote_url: tuple[str, str | None], request: pytest.FixtureRequest
) -> None:
    """One flipped byte in one object of a version 2 pack: the clone names that object and its
    pack, and no commit lands (a checkout would have caught it too, but later)."""
    url, endpoint = remote_url
    a, _ = make_repo(tmp_path / "a", tmp_path / "work", range(1, 3))
    a.add_remote("origin", url, endpoint)
    a.push()
    t = _transport(url, request)
    victim = next(o for o in a.store.iter_ids() if a.store.kind(o).name == "CHUNK")
    _flip_in_packs(t, victim)
    holder = next(i.key for i in t.list(INDEXES) if parse_index(t.get(i.key)).find(victim))
    pack_id = holder[len(INDEXES) : -len(".idx")]
    b = Repo.init(tmp_path / "b")  # a fetch (a failed clone removes its repository)
    b.add_remote("origin", url, endpoint)
    with pytest.raises(IntegrityError, match=f"object {victim} is corrupt: .*pack {pack_id}.*digest") as err:
        b.fetch()
    assert err.value.exit_code == 4
    assert b.refs.list("refs/remotes/") == {} and b.fsck() == [] and not b.store.has(victim)


@pytest.mark.parametrize("which", ["whole", "delta base"])
def test_push_refuses_a_locally_damaged_object(
    tmp_path: Path, remote_url: tuple[str, str | None], which: str, request: pytest.FixtureRequest
) -> None:
    """The remote's digests vouch for what a push sent, so a push must never send an object
    whose stored bytes do not decode to its name: it names the object and moves no ref."""
    url, endpoint = remote_url
    a, _ = make_repo(tmp_path / "a", tmp_path / "work", range(1, 3))
    store = a.store
    bases = {b for o in store.iter_ids() for b in store.bases_of(o)}
    if which == "whole":
        victim = next(
            o for o in store.iter_ids() if store.kind(o).name == "CHUNK" and o not in bases and store.bases_of(o) == ()
        )
    else:
        victim = next(iter(sorted(bases)))
    path = Path(store.backend.describe(object_key(victim)))
    data = path.read_bytes()
    path.chmod(0o644)
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 0x40]))
    a.add_remote("origin", url, endpoint)
    with pytest.raises(IntegrityError, match=f"{victim} is corrupt") as err:
        a.push()
    assert err.value.exit_code == 4
    assert "not sent" in str(err.value)
    t = _transport(url, request)
    assert list(t.list("refs/")) == []  # nothing published
    # The pack the object was streaming into was aborted, not completed without it: no pack
    # on the remote holds the object, and every pack there is whole and indexed.
    indexed = {i.key.removeprefix(INDEXES).removesuffix(".idx") for i in t.list(INDEXES)}
    for info in t.list(PACKS):
        name = pack_name(info.key)
        assert name in indexed and victim not in parse_pack(t.get(info.key), name)


class Interrupted(BaseException):
    """Raised by the step observer: the fetch stops there, as a crash would."""


def test_an_interrupted_fetch_keeps_the_batches_that_landed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Objects land in rolling batches before any commit names them: a fetch stopped halfway
    leaves no commit, and the next fetch downloads only the objects that had not landed."""
    from ckstore.backend import fsio
    from ckstore.remote import landing

    url = str(tmp_path / "remote")
    a, ids = make_repo(tmp_path / "a", tmp_path / "work", range(1, 3))
    a.add_remote("origin", url)
    a.push()
    monkeypatch.setattr(landing, "LAND_BATCH", 1)  # every object lands on its own
    steps = 0

    def count() -> None:
        nonlocal steps
        steps += 1

    fsio.observe_steps(count)
    try:
        full = Repo.clone(url, tmp_path / "full")[0].fetch()  # nothing left: a second fetch is empty
    finally:
        fsio.observe_steps(None)
    first, _ = Repo.clone(url, tmp_path / "ref")
    total = sum(1 for _ in first.store.iter_ids())
    assert full.objects == 0 and steps > 20

    b = Repo.init(tmp_path / "b")
    b.add_remote("origin", url)
    seen = 0

    def stop_halfway() -> None:
        nonlocal seen
        seen += 1
        if seen == steps // 2:
            raise Interrupted()

    fsio.observe_steps(stop_halfway)
    try:
        with pytest.raises(Interrupted):
            b.fetch()
    finally:
        fsio.observe_steps(None)
    b = Repo(tmp_path / "b")
    landed = sum(1 for _ in b.store.iter_ids())
    assert 0 < landed < total and not any(b.store.has(oid) for oid in ids)
    assert b.fsck() == []
    report = b.fetch()
    assert report.objects == total - landed and report.commits == len(ids)
    assert b.fsck(read_data=True) == [] and b.resolve("origin/main") == ids[-1]
