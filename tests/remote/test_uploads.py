"""Packs streamed to a remote while they are made (ckstore/remote/uploads.py)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from pathlib import Path

import blake3
import pytest

from ckstore.codecs.objects import Kind, encode
from ckstore.errors import StorageError
from ckstore.format.ids import chunk_id
from ckstore.format.pack import parse_index, parse_pack
from ckstore.remote.layout import INDEXES, PACKS, RemoteRepo, index_key, pack_name
from ckstore.remote.uploads import PackUploads
from ckstore.transport.directory import DirectoryTransport


def _objects(n: int, size: int = 10_000) -> list[tuple[str, bytes, bytes]]:
    out = []
    for _ in range(n):
        raw = os.urandom(size)
        stored = encode(raw, Kind.CHUNK, 1)
        out.append((chunk_id(raw), stored, blake3.blake3(stored).digest()))
    return out


def _remote(root: Path, transport: DirectoryTransport | None = None) -> RemoteRepo:
    return RemoteRepo(transport or DirectoryTransport(root), lambda r: r, lambda k: k)


def _packs_on(remote: RemoteRepo) -> dict[str, set[str]]:
    """pack id -> object ids, for every pack on the remote, each checked whole against its index."""
    t = remote.transport
    out = {}
    for info in t.list(PACKS):
        name = pack_name(info.key)
        assert name is not None
        index = parse_pack(t.get(info.key), name)
        assert parse_index(t.get(index_key(name)), name) == index
        out[name] = {e.id for e in index.entries}
    return out


def test_objects_go_out_in_packs_of_the_target_size(tmp_path: Path) -> None:
    remote = _remote(tmp_path)
    objects = _objects(12)
    with PackUploads(remote, target_size=40_000, workers=2) as uploads:
        for obj in objects:
            uploads.add(*obj)
    on_remote = _packs_on(remote)
    assert len(uploads.sent) == len(on_remote) >= 3  # ~3 objects a pack
    assert {i.pack_id for i in uploads.sent} == set(on_remote)
    assert set().union(*on_remote.values()) == {oid for oid, _, _ in objects}
    assert all(i.pack_size <= 40_000 for i in uploads.sent)
    # Each object is where the index says, byte for byte.
    for index in uploads.sent:
        data = remote.transport.get(f"{PACKS}{index.pack_id}.pack")
        for e in index.entries:
            assert data[e.offset : e.end] == next(s for oid, s, _ in objects if oid == e.id)


class VerifyFailed(Exception):
    pass


def test_an_error_while_filling_aborts_the_open_pack_and_keeps_the_finished(tmp_path: Path) -> None:
    remote = _remote(tmp_path)
    objects = _objects(8)
    with pytest.raises(VerifyFailed):
        with PackUploads(remote, target_size=40_000, workers=4) as uploads:
            for obj in objects[:5]:  # one full pack (3 objects), then 2 into the next
                uploads.add(*obj)
            raise VerifyFailed("object 6 does not decode to its name")
    on_remote = _packs_on(remote)
    assert list(on_remote.values()) == [{oid for oid, _, _ in objects[:3]}]
    assert [i.pack_id for i in uploads.sent] == list(on_remote)
    assert list(remote.transport.list(INDEXES)) and len(list(remote.transport.list(PACKS))) == 1


class FailingTransport(DirectoryTransport):
    """A folder remote whose second pack upload fails, as a server refusing it would."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.calls = 0
        self.lock = threading.Lock()

    def put_parts(self, key: str, parts: Iterable[bytes | memoryview]) -> None:
        if not key.startswith(PACKS):  # an index (DirectoryTransport.put writes through here too)
            super().put_parts(key, parts)
            return
        with self.lock:
            self.calls += 1
            failing = self.calls == 2
        if failing:
            next(iter(parts))  # the upload has started reading when the server fails
            raise StorageError(f"remote {self.url}: the server answered 503 Service Unavailable while writing {key}")
        super().put_parts(key, parts)


def test_a_failed_upload_stops_the_push_with_its_own_error(tmp_path: Path) -> None:
    remote = _remote(tmp_path, FailingTransport(tmp_path))
    objects = _objects(30)
    added = 0
    with pytest.raises(StorageError, match="503"):
        with PackUploads(remote, target_size=40_000, workers=2) as uploads:
            for obj in objects:
                uploads.add(*obj)
                added += 1
    # The pusher stopped soon after the failure instead of verifying everything for nothing.
    assert added < len(objects)
    on_remote = _packs_on(remote)
    assert all(len(ids) == 3 for ids in on_remote.values()) and len(on_remote) >= 1
