"""The S3 transport under faults, through a proxy in front of the real server: transient 500/503
answers and dropped connections are retried (by obstore's retry policy), persistent ones end in
a one-line StorageError, and a failed upload publishes nothing. Also the request counts that
packs are for: one ranged GET per object, one for neighbours."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator

import pytest

from ckstore.codecs.objects import Kind, encode
from ckstore.errors import StorageError
from ckstore.format import pack, pack_build
from ckstore.format.ids import chunk_id
from ckstore.transport.s3 import S3Transport
from ckstore.transport.testserver import S3Server

from .faultproxy import FaultProxy


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    with FaultProxy(s3_server.endpoint) as p:
        yield p


@pytest.fixture
def remote(s3_server: S3Server, proxy: FaultProxy) -> S3Transport:
    return S3Transport(
        s3_server.bucket,
        f"f/{uuid.uuid4().hex}",
        s3_server.options(endpoint_url=proxy.url, multipart_part_size=5 << 20),
        env=s3_server.env,
    )


def statuses(proxy: FaultProxy, method: str) -> list[int | None]:
    return [s.status for s in proxy.seen if s.method == method]


@pytest.mark.parametrize("status", [500, 503])
def test_transient_server_errors_are_retried(remote: S3Transport, proxy: FaultProxy, status: int) -> None:
    remote.put("k", b"value")
    proxy.reset()
    proxy.fail_next(2, status)
    assert remote.get("k") == b"value"
    assert statuses(proxy, "GET") == [status, status, 200]
    proxy.reset()
    proxy.fail_next(2, status)
    remote.put("k2", b"other")
    assert statuses(proxy, "PUT") == [status, status, 200]
    assert remote.get("k2") == b"other"


def test_dropped_connections_are_retried(remote: S3Transport, proxy: FaultProxy) -> None:
    remote.put("k", b"value")
    proxy.reset()
    proxy.drop_next(2)
    assert remote.get("k") == b"value"
    assert statuses(proxy, "GET") == [None, None, 200]
    proxy.reset()
    proxy.drop_next(2)
    remote.put("k", b"new")
    assert statuses(proxy, "PUT") == [None, None, 200]
    assert remote.get("k") == b"new"


def test_conditional_writes_are_retried_on_server_errors(remote: S3Transport, proxy: FaultProxy) -> None:
    proxy.fail_next(1, 503)
    assert remote.put_if_absent("ref", b"1") is True
    _, token = remote.get_versioned("ref")
    proxy.reset()
    proxy.fail_next(2, 500)
    assert remote.put_if_match("ref", b"2", token) is True
    assert [s.conditional for s in proxy.seen if s.method == "PUT"] == ["If-Match"] * 3
    assert remote.put_if_match("ref", b"3", token) is False
    assert remote.get("ref") == b"2"


@pytest.mark.parametrize("fault", ["503", "500", "drop"])
def test_persistent_faults_end_in_a_clean_storage_error(remote: S3Transport, proxy: FaultProxy, fault: str) -> None:
    remote.put("k", b"value")
    for call in (
        lambda: remote.get("k"),
        lambda: remote.put("k", b"x"),
        lambda: remote.put_if_absent("n", b"x"),
        lambda: list(remote.list()),
    ):
        proxy.reset()
        if fault == "drop":
            proxy.drop_next(100)
        else:
            proxy.fail_next(100, int(fault))
        started = time.monotonic()
        with pytest.raises(StorageError) as excinfo:
            call()
        assert time.monotonic() - started < 5
        message = str(excinfo.value)
        assert "\n" not in message and message.startswith(f"remote {remote.url}: "), message
        assert "gave up after 2 retries" in message, message
        if fault == "503":
            assert "503 Service Unavailable" in message and "SlowDown" in message, message
        elif fault == "500":
            assert "500 Internal Server Error" in message and "InternalError" in message, message
        else:
            assert f"cannot reach {proxy.url}" in message and "closed before an answer" in message, message
        assert proxy.count() == 3  # the first attempt and max_retries=2 retries
    proxy.reset()
    assert remote.get("k") == b"value"  # nothing half-written
    assert remote.head("n") is None


def test_large_put_is_multipart_and_publishes_nothing_when_completion_fails(
    remote: S3Transport, proxy: FaultProxy
) -> None:
    data = os.urandom(12 << 20)
    remote.put("big", data)
    posts = [s.path for s in proxy.seen if s.method == "POST"]
    parts = [s for s in proxy.seen if s.method == "PUT"]
    assert len(posts) == 2 and "uploads" in posts[0] and "uploadId" in posts[1]  # create, complete
    assert len(parts) == 3 and all("partNumber" in s.path for s in parts)
    proxy.reset()
    proxy.fail_next(100, 500, match=lambda method, path: method == "POST" and "uploadId" in path)
    with pytest.raises(StorageError, match="500"):
        remote.put("big2", data)
    proxy.reset()
    assert remote.head("big2") is None
    assert remote.get("big") == data


def test_a_server_that_ignores_conditional_writes_is_detected(remote: S3Transport, proxy: FaultProxy) -> None:
    assert remote.honours_conditional_writes("probe") is True
    assert remote.head("probe") is None
    proxy.ignore_conditions = True
    assert remote.honours_conditional_writes("probe") is False
    assert remote.head("probe") is None


# ---- packs: request counts ----------------------------------------------------------------------


def test_one_ranged_get_per_object_and_one_for_neighbours(remote: S3Transport, proxy: FaultProxy) -> None:
    raws = [os.urandom(50_000 + i) for i in range(12)]
    (built,) = pack_build.pack_objects([(chunk_id(r), encode(r, Kind.CHUNK, 1)) for r in raws])
    remote.put(f"packs/{built.name}.pack", built.data)
    remote.put(f"packs/{built.name}.idx", built.index_data)
    proxy.reset()
    index = pack.parse_index(remote.get(f"packs/{built.name}.idx"), built.name)
    order = index.in_pack_order()
    entry = order[5]
    data = remote.get_range(f"packs/{built.name}.pack", entry.offset, entry.length)
    pack.check_read(data, entry, built.name)
    assert data == built.data[entry.offset : entry.end]
    gets = [s for s in proxy.seen if s.method == "GET"]
    assert len(gets) == 2 and gets[0].range is None and gets[1].range is not None
    # Three neighbours: one request; two far apart (more than the coalescing gap): two.
    proxy.reset()
    got = remote.get_ranges(f"packs/{built.name}.pack", [(e.offset, e.length) for e in order[2:5]])
    assert got == [built.data[e.offset : e.end] for e in order[2:5]]
    assert proxy.count("GET") == 1
    proxy.reset()
    far = [order[0], order[11]]
    got = remote.get_ranges(f"packs/{built.name}.pack", [(e.offset, e.length) for e in far])
    assert got == [built.data[e.offset : e.end] for e in far]
    assert proxy.count("GET") == 2


def test_index_rebuilt_from_a_remote_pack_tail(remote: S3Transport, proxy: FaultProxy) -> None:
    raws = [os.urandom(1000 + i) for i in range(40)]
    (built,) = pack_build.pack_objects([(chunk_id(r), encode(r, Kind.CHUNK, 1)) for r in raws])
    key = f"packs/{built.name}.pack"
    remote.put(key, built.data)
    proxy.reset()
    info = remote.head(key)
    assert info is not None
    tail = remote.get_range(key, max(0, info.size - pack.TAIL_GUESS), pack.TAIL_GUESS)
    assert pack.index_from_tail(tail, info.size, built.name) == built.index
    assert proxy.count() == 2  # HEAD for the size, one ranged GET


def test_truncated_remote_pack_reads_short_and_is_named(remote: S3Transport) -> None:
    raws = [os.urandom(3000 + i) for i in range(4)]
    (built,) = pack_build.pack_objects([(chunk_id(r), encode(r, Kind.CHUNK, 1)) for r in raws])
    key = f"packs/{built.name}.pack"
    remote.put(key, built.data[: built.index.in_pack_order()[2].offset + 10])  # damaged upload
    order = built.index.in_pack_order()
    got = remote.get_ranges(key, [(e.offset, e.length) for e in order])
    assert got[:2] == [built.data[e.offset : e.end] for e in order[:2]]
    assert len(got[2]) == 10 and got[3] == b""
    with pytest.raises(Exception, match=f"pack {built.name} is truncated"):
        pack.check_read(got[3], order[3], built.name)


def test_a_server_that_does_not_start_is_reported_with_its_log(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckstore.transport import testserver

    fake = tmp_path / "weed"
    fake.write_text("#!/bin/sh\necho 'listen tcp: address already in use'\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setattr(testserver, "weed_binary", lambda: str(fake))
    with pytest.raises(testserver.ServerStartError, match="(?s)exit code 3.*address already in use"):
        with testserver.seaweedfs(tmp_path):
            pass
