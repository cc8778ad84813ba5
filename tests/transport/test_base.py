"""Conformance suite for remote transports: every test runs against a folder and against the real
S3 server (SeaweedFS), as ckstore/transport/base.py's obligations say."""

from __future__ import annotations

import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from ckstore.errors import InvalidPathError, StorageError
from ckstore.transport import NotFound, Transport
from ckstore.transport.directory import DirectoryTransport
from ckstore.transport.s3 import S3Transport
from ckstore.transport.testserver import S3Server

BAD_KEYS = ["", "../x", "a/../x", "/abs", "a//b", "a/", ".hidden", "a/.tmp", "a b", "a\\b", "é"]


@pytest.fixture(params=["dir", "s3"])
def transport(request: pytest.FixtureRequest, tmp_path: Path) -> Transport:
    if request.param == "dir":
        (tmp_path / "remote").mkdir()
        return DirectoryTransport(tmp_path / "remote")
    server: S3Server = request.getfixturevalue("s3_server")
    # A fresh prefix per test: the bucket is shared by the session.
    return S3Transport(
        server.bucket, f"t/{uuid.uuid4().hex}", server.options(multipart_part_size=5 << 20), env=server.env
    )


def run_threads(n: int, target: Callable[[int], None]) -> None:
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            target(i)
        except BaseException as exc:  # surfaced in the test below, not lost in a thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    assert not errors, errors


def test_put_get_round_trip(transport: Transport) -> None:
    data = os.urandom(100_000)
    transport.put("packs/ab/one.pack", data)
    assert transport.get("packs/ab/one.pack") == data
    transport.put("packs/ab/one.pack", b"replaced")
    assert transport.get("packs/ab/one.pack") == b"replaced"
    transport.put("empty", b"")
    assert transport.get("empty") == b""
    info = transport.head("packs/ab/one.pack")
    assert info is not None and info.key == "packs/ab/one.pack" and info.size == 8
    assert abs(info.last_modified - datetime.now(timezone.utc)) < timedelta(minutes=5)


def test_missing_keys(transport: Transport) -> None:
    with pytest.raises(NotFound):
        transport.get("nope")
    with pytest.raises(KeyError):  # NotFound is a KeyError, like Backend.get's
        transport.get("a/b/nope")
    with pytest.raises(NotFound):
        transport.get_range("nope", 0, 10)
    with pytest.raises(NotFound):
        transport.get_ranges("nope", [(0, 1), (5, 1)])
    with pytest.raises(NotFound):
        transport.get_versioned("nope")
    assert transport.head("nope") is None
    transport.delete("nope")  # deleting an absent key is not an error


def test_large_put_round_trips(transport: Transport) -> None:
    # Larger than the part size the fixture sets: a multipart upload on S3.
    data = os.urandom(12 << 20)
    transport.put("big", data)
    assert transport.get("big") == data
    assert transport.get_range("big", (5 << 20) - 3, 10) == data[(5 << 20) - 3 : (5 << 20) + 7]


def test_put_parts_stores_the_concatenation(transport: Transport) -> None:
    # More than the fixture's part size in parts of uneven sizes: streamed as a multipart
    # upload on S3, written part by part to a temporary file in a folder.
    parts = [os.urandom(n) for n in (1, 3 << 20, 0, 5 << 20, 123, 4 << 20)]
    transport.put_parts("packs/streamed", (memoryview(p) if i % 2 else p for i, p in enumerate(parts)))
    assert transport.get("packs/streamed") == b"".join(parts)
    transport.put_parts("small", [b"ab", b"", b"c"])
    assert transport.get("small") == b"abc"


class ProducerFailed(Exception):
    pass


@pytest.mark.parametrize("size", [1 << 10, 12 << 20])
def test_put_parts_whose_producer_fails_stores_nothing(transport: Transport, size: int) -> None:
    """A pusher aborts a pack upload by raising in its stream (an object that fails to verify):
    the error comes back unchanged, a new key stays absent, an existing one keeps its value."""

    def failing() -> Iterator[bytes]:
        yield os.urandom(size)
        yield os.urandom(size)
        raise ProducerFailed("object failed to verify")

    transport.put("kept", b"old value")
    for key in ("fresh", "kept"):
        with pytest.raises(ProducerFailed, match="failed to verify"):
            transport.put_parts(key, failing())
    assert transport.head("fresh") is None
    assert transport.get("kept") == b"old value"
    assert [i.key for i in transport.list()] == ["kept"]


def test_get_range_edges(transport: Transport) -> None:
    data = bytes(range(256)) * 4
    transport.put("r", data)
    assert transport.get_range("r", 10, 20) == data[10:30]
    assert transport.get_range("r", 1000, 100) == data[1000:]  # short: the value ends first
    assert transport.get_range("r", 1024, 5) == b""
    assert transport.get_range("r", 5000, 5) == b""
    assert transport.get_range("r", 3, 0) == b""
    with pytest.raises(ValueError):
        transport.get_range("r", -1, 5)


def test_get_ranges_match_slicing(transport: Transport) -> None:
    data = os.urandom(300_000)
    transport.put("r", data)
    rng = random.Random(7)
    for _ in range(12):
        ranges = []
        for _ in range(rng.randint(1, 12)):
            start = rng.choice([rng.randint(0, len(data)), rng.randint(len(data) - 50, len(data) + 50)])
            ranges.append((max(start, 0), rng.choice([0, 1, rng.randint(1, 100), rng.randint(1, 100_000)])))
        got = transport.get_ranges("r", ranges)
        assert got == [data[s : s + n] for s, n in ranges], ranges
    assert transport.get_ranges("r", []) == []


def test_put_if_absent_writes_once(transport: Transport) -> None:
    assert transport.put_if_absent("refs/x", b"first") is True
    assert transport.put_if_absent("refs/x", b"second") is False
    assert transport.get("refs/x") == b"first"


def test_put_if_absent_race_has_one_winner(transport: Transport) -> None:
    wins: list[int] = []

    def attempt(i: int) -> None:
        if transport.put_if_absent("race/key", f"writer {i}".encode()):
            wins.append(i)

    run_threads(16, attempt)
    assert len(wins) == 1
    assert transport.get("race/key") == f"writer {wins[0]}".encode()


def test_compare_and_swap(transport: Transport) -> None:
    assert transport.put_if_match("refs/heads/main", b"one", None) is True
    assert transport.put_if_match("refs/heads/main", b"again", None) is False
    value, token = transport.get_versioned("refs/heads/main")
    assert value == b"one"
    assert transport.put_if_match("refs/heads/main", b"two", token) is True
    assert transport.put_if_match("refs/heads/main", b"three", token) is False  # stale token
    value, token2 = transport.get_versioned("refs/heads/main")
    assert value == b"two" and token2 != token
    transport.delete("refs/heads/main")
    assert transport.put_if_match("refs/heads/main", b"four", token2) is False  # gone
    assert transport.head("refs/heads/main") is None
    assert transport.put_if_match("refs/heads/main", b"five", None) is True


def test_compare_and_swap_race_loses_no_increment(transport: Transport) -> None:
    transport.put_if_match("counter", b"0", None)
    wins = [0] * 8

    def increment(i: int) -> None:
        for _ in range(10):
            while True:
                value, token = transport.get_versioned("counter")
                if transport.put_if_match("counter", str(int(value) + 1).encode(), token):
                    wins[i] += 1
                    break

    run_threads(8, increment)
    assert transport.get("counter") == b"80"
    assert wins == [10] * 8


def test_list(transport: Transport) -> None:
    keys = {"packs/aa.pack": 3, "packs/aa.idx": 1, "packs/sub/bb.pack": 2, "packsx/c": 4, "refs/heads/main": 5}
    for key, n in keys.items():
        transport.put(key, b"x" * n)
    assert {(i.key, i.size) for i in transport.list("")} == set(keys.items())
    under = {i.key for i in transport.list("packs/")}
    assert under == {"packs/aa.pack", "packs/aa.idx", "packs/sub/bb.pack"}
    assert {i.key for i in transport.list("packs")} == under  # a prefix names a folder
    assert list(transport.list("nothing/")) == []
    for info in transport.list("refs/"):
        assert abs(info.last_modified - datetime.now(timezone.utc)) < timedelta(minutes=5)


def test_delete(transport: Transport) -> None:
    transport.put("packs/a", b"1")
    transport.put("packs/b", b"2")
    transport.delete("packs/a")
    assert transport.head("packs/a") is None
    assert [i.key for i in transport.list("packs/")] == ["packs/b"]
    transport.delete("packs/a")


def test_invalid_keys_are_refused(transport: Transport) -> None:
    for key in BAD_KEYS:
        with pytest.raises(InvalidPathError):
            transport.get(key)
        with pytest.raises(InvalidPathError):
            transport.put(key, b"x")
    with pytest.raises(InvalidPathError):
        list(transport.list("../"))


def test_check_passes_on_a_usable_remote(transport: Transport) -> None:
    transport.check()
    assert transport.honours_conditional_writes("probe") is True
    assert transport.head("probe") is None


# ---- failures ---------------------------------------------------------------------------------


def _one_line_storage_error(excinfo: pytest.ExceptionInfo[StorageError], *fragments: str) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and len(message) < 400, message
    assert excinfo.value.exit_code == 7
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_unreachable_endpoint_fails_fast(s3_server: S3Server) -> None:
    (port,) = _closed_port()
    t = S3Transport(
        s3_server.bucket, "x", s3_server.options(endpoint_url=f"http://127.0.0.1:{port}"), env=s3_server.env
    )
    for call in (lambda: t.get("k"), lambda: t.put("k", b"1"), lambda: list(t.list()), t.check):
        started = time.monotonic()
        with pytest.raises(StorageError) as excinfo:
            call()
        assert time.monotonic() - started < 5
        _one_line_storage_error(
            excinfo,
            f"s3://{s3_server.bucket}/x",
            f"cannot reach http://127.0.0.1:{port}",
            "connection refused",
            "after 2 retries",
        )


def _closed_port() -> list[int]:
    from ckstore.transport.testserver import free_ports

    return free_ports(1)  # nothing listens there once free_ports closed it


def test_wrong_credentials(s3_server: S3Server) -> None:
    for env in ({**s3_server.env, "AWS_SECRET_ACCESS_KEY": "wrong"}, {**s3_server.env, "AWS_ACCESS_KEY_ID": "nobody"}):
        t = S3Transport(s3_server.bucket, "x", s3_server.options(), env=env)
        for call in (lambda: t.get("k"), lambda: t.put_if_absent("k", b"1"), t.check):
            with pytest.raises(StorageError) as excinfo:
                call()
            _one_line_storage_error(excinfo, "access denied", "check the credentials")


def test_permission_denied(s3_server: S3Server) -> None:
    writer = S3Transport(s3_server.bucket, "perm", s3_server.options(), env=s3_server.env)
    writer.put("k", b"readable")
    key, secret = s3_server.reader
    reader = S3Transport(
        s3_server.bucket,
        "perm",
        s3_server.options(),
        env={**s3_server.env, "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret},
    )
    assert reader.get("k") == b"readable"
    reader.check()
    for call in (lambda: reader.put("k", b"x"), lambda: reader.put_if_absent("new", b"x"), lambda: reader.delete("k")):
        with pytest.raises(StorageError) as excinfo:
            call()
        _one_line_storage_error(excinfo, "access denied", "AccessDenied")
    assert writer.get("k") == b"readable"


def test_missing_bucket(s3_server: S3Server) -> None:
    t = S3Transport("no-such-bucket", "x", s3_server.options(), env=s3_server.env)
    for call in (
        lambda: t.get("k"),
        lambda: t.put("k", b"1"),
        lambda: t.put_if_absent("k", b"1"),
        lambda: t.put_if_match("k", b"1", '"abc"'),
        lambda: t.get_range("k", 0, 5),
        lambda: t.head("k"),
        lambda: list(t.list()),
        t.check,
    ):
        with pytest.raises(StorageError) as excinfo:
            call()
        _one_line_storage_error(excinfo, "bucket 'no-such-bucket' does not exist")


def test_missing_folder(tmp_path: Path) -> None:
    t = DirectoryTransport(tmp_path / "absent")
    for call in (
        lambda: t.get("k"),
        lambda: t.put("k", b"1"),
        lambda: t.put_if_absent("k", b"1"),
        lambda: t.put_if_match("k", b"1", None),
        lambda: t.get_range("k", 0, 5),
        lambda: t.head("k"),
        lambda: list(t.list()),
        lambda: t.delete("k"),
        t.check,
    ):
        with pytest.raises(StorageError) as excinfo:
            call()
        _one_line_storage_error(excinfo, str(tmp_path / "absent"), "does not exist")
    assert not (tmp_path / "absent").exists()  # a write never creates the remote itself


def test_folder_remote_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(StorageError, match="not a folder"):
        DirectoryTransport(tmp_path / "file").put("k", b"1")


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions")
def test_folder_permission_denied(tmp_path: Path) -> None:
    root = tmp_path / "ro"
    root.mkdir()
    root.chmod(0o500)
    try:
        with pytest.raises(StorageError) as excinfo:
            DirectoryTransport(root).put("k", b"1")
        _one_line_storage_error(excinfo, "ermission denied")
    finally:
        root.chmod(0o700)


# ---- folder specifics -------------------------------------------------------------------------


def test_folder_listing_hides_temporary_and_lock_files(tmp_path: Path) -> None:
    t = DirectoryTransport(tmp_path)
    t.put("refs/main", b"1")
    (tmp_path / ".tmp").mkdir(exist_ok=True)
    (tmp_path / ".tmp" / "leftover").write_bytes(b"x")
    (tmp_path / "refs" / ".main.lock").write_bytes(b"x")
    (tmp_path / "refs" / "bad name").write_bytes(b"x")
    assert [i.key for i in t.list()] == ["refs/main"]
    assert not list((tmp_path / ".tmp").iterdir()) or [p.name for p in (tmp_path / ".tmp").iterdir()] == ["leftover"]


def test_folder_lock_of_a_dead_writer_is_broken(tmp_path: Path) -> None:
    """A writer killed while holding a folder remote's compare-and-swap lock (the soak: 72 pushes
    refused on one left behind) no longer blocks that key: its process is proven gone."""
    import json
    import subprocess
    import sys

    from ckstore.backend.fsio import process_owner

    t = DirectoryTransport(tmp_path)
    assert t.put_if_match("refs/main", b"1", None)
    _, token = t.get_versioned("refs/main")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = tmp_path / "refs" / ".main.lock"
    lock.write_text(json.dumps({**process_owner(), "pid": dead.pid}))
    assert t.put_if_match("refs/main", b"2", token)
    assert t.get("refs/main") == b"2" and not lock.exists()
    assert sorted(p.name for p in (tmp_path / "refs").iterdir()) == ["main"]


def test_folder_compare_and_swap_waits_for_the_lock_then_names_it(tmp_path: Path) -> None:
    from ckstore.errors import LockedError
    from ckstore.transport.base import RemoteOptions

    t = DirectoryTransport(tmp_path, options=RemoteOptions(lock_timeout=0.3))
    assert t.put_if_match("refs/main", b"1", None)
    _, token = t.get_versioned("refs/main")
    lock = tmp_path / "refs" / ".main.lock"
    lock.write_bytes(b"crashed writer\n")
    started = time.monotonic()
    with pytest.raises(LockedError, match=str(lock)):
        t.put_if_match("refs/main", b"2", token)
    assert time.monotonic() - started >= 0.3
    assert t.get("refs/main") == b"1"
    # A lock released while waiting is taken.
    threading.Timer(0.1, lock.unlink).start()
    assert t.put_if_match("refs/main", b"2", token)
    assert not lock.exists()


def test_folder_writes_leave_no_temporary_files(tmp_path: Path) -> None:
    t = DirectoryTransport(tmp_path)
    t.put("a", b"1")
    t.put_if_absent("b", b"2")
    t.put_if_absent("b", b"3")
    t.put_if_match("c", b"4", None)
    _, token = t.get_versioned("c")
    t.put_if_match("c", b"5", token)
    t.put_if_match("c", b"6", token)
    assert list((tmp_path / ".tmp").iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp", "a", "b", "c"]
