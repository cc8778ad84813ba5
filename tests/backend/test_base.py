"""Conformance suite for storage backends: every backend must pass every test here."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ckstore.backend.base import Backend
from ckstore.backend.local import LocalBackend
from ckstore.backend.memory import MemoryBackend
from ckstore.errors import InvalidPathError, LockedError, StorageError
from tests.helpers import leftover_temp_files

BAD_KEYS = ["", "../x", "a/../../x", "/abs", "a//b", "a/", "./a", "a/./b", "a\\b", "a b", "a/\x00"]


@pytest.fixture(params=["local", "memory"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "memory":
        return MemoryBackend()
    (tmp_path / "store").mkdir()  # a repository directory always exists before its backend
    return LocalBackend(tmp_path / "store")


def run_threads(n: int, target: Callable[[int], None]) -> None:
    threads = [threading.Thread(target=target, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
        assert not t.is_alive()


def test_get_missing_raises_keyerror(backend: Backend) -> None:
    with pytest.raises(KeyError):
        backend.get("objects/aa/missing")
    assert backend.size("objects/aa/missing") is None
    assert not backend.exists("objects/aa/missing")


def test_put_if_absent_writes_once(backend: Backend) -> None:
    assert backend.put_if_absent("objects/ab/c", b"first") is True
    assert backend.put_if_absent("objects/ab/c", b"second") is False
    assert backend.get("objects/ab/c") == b"first"
    assert backend.size("objects/ab/c") == 5
    assert backend.exists("objects/ab/c")


def test_put_empty_value(backend: Backend) -> None:
    assert backend.put_if_absent("k", b"")
    assert backend.get("k") == b"" and backend.size("k") == 0 and backend.exists("k")


def test_replace_overwrites(backend: Backend) -> None:
    backend.replace("refs/heads/main", b"one")
    backend.replace("refs/heads/main", b"two")
    assert backend.get("refs/heads/main") == b"two"


def test_replace_is_atomic_for_concurrent_readers(backend: Backend) -> None:
    values = [bytes([65 + i]) * 200_000 for i in range(2)]
    backend.replace("ref", values[0])
    seen: set[bytes] = set()
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            seen.add(backend.get("ref"))

    t = threading.Thread(target=reader)
    t.start()
    for i in range(30):
        backend.replace("ref", values[i % 2])
    stop.set()
    t.join()
    # A partial write would show up as a value that is neither complete old nor complete new.
    assert seen <= set(values)


def test_create_exclusive_has_exactly_one_winner(backend: Backend) -> None:
    barrier = threading.Barrier(8)
    wins: list[int] = []

    def contender(i: int) -> None:
        barrier.wait()
        if backend.create_exclusive("refs/heads/main.lock", b"%d" % i):
            wins.append(i)

    run_threads(8, contender)
    assert len(wins) == 1
    assert backend.get("refs/heads/main.lock") == b"%d" % wins[0]
    assert backend.create_exclusive("refs/heads/main.lock", b"x") is False


def test_delete(backend: Backend) -> None:
    backend.put_if_absent("a/b", b"x")
    assert backend.delete("a/b") is True
    assert backend.delete("a/b") is False
    with pytest.raises(KeyError):
        backend.get("a/b")
    # A deleted key can be written again.
    assert backend.put_if_absent("a/b", b"y") is True


def test_list_is_sorted_and_folder_like(backend: Backend) -> None:
    keys = ["x/a0", "x/a/b", "x/a.c", "x/b", "refs/heads/a", "refs/heads/a-b/c", "refs/headsx/b", "y"]
    for key in keys:
        backend.put_if_absent(key, b"1")
    assert list(backend.list("")) == sorted(keys)
    assert list(backend.list("x")) == sorted(k for k in keys if k.startswith("x/"))
    assert list(backend.list("x/")) == list(backend.list("x"))
    # "refs/heads" is a folder: "refs/headsx/b" is not below it.
    assert list(backend.list("refs/heads/")) == ["refs/heads/a", "refs/heads/a-b/c"]
    assert list(backend.list("refs/heads")) == ["refs/heads/a", "refs/heads/a-b/c"]
    assert list(backend.list("nothing/")) == []


def test_keys_below_a_key_or_at_a_folder_are_absent(backend: Backend) -> None:
    backend.put_if_absent("refs/heads/a", b"1")
    backend.put_if_absent("refs/heads/d/e", b"1")
    for absent in ("refs/heads/a/b", "refs/heads/d"):
        with pytest.raises(KeyError):
            backend.get(absent)
        assert backend.size(absent) is None
        assert backend.delete(absent) is False
    assert list(backend.list("refs/heads/")) == ["refs/heads/a", "refs/heads/d/e"]


@pytest.mark.parametrize("key", BAD_KEYS)
def test_check_key_rejects_escaping_keys(backend: Backend, key: str) -> None:
    for op in (
        lambda: backend.get(key),
        lambda: backend.put_if_absent(key, b"x"),
        lambda: backend.replace(key, b"x"),
        lambda: backend.delete(key),
        lambda: backend.size(key),
    ):
        with pytest.raises(InvalidPathError):
            op()


@pytest.mark.parametrize("prefix", ["../", "..", "/etc", "a//b/"])
def test_list_rejects_escaping_prefix(backend: Backend, prefix: str) -> None:
    with pytest.raises(InvalidPathError):
        list(backend.list(prefix))


def test_shared_locks_coexist_and_exclude_exclusive(backend: Backend) -> None:
    with backend.repo_lock(exclusive=False, timeout=1):
        with backend.repo_lock(exclusive=False, timeout=1):
            pass
        start = time.monotonic()
        with pytest.raises(LockedError):
            with backend.repo_lock(exclusive=True, timeout=0.3):
                pass
        assert time.monotonic() - start >= 0.25  # it waited for its timeout before giving up
    with backend.repo_lock(exclusive=True, timeout=1):
        with pytest.raises(LockedError):
            with backend.repo_lock(exclusive=False, timeout=0.2):
                pass
    with backend.repo_lock(exclusive=False, timeout=1):
        pass  # released after an exception too


def test_exclusive_waits_for_shared_holder(backend: Backend) -> None:
    held, releasing = threading.Event(), threading.Event()

    def holder() -> None:
        with backend.repo_lock(exclusive=False, timeout=1):
            held.set()
            time.sleep(0.4)
            releasing.set()  # still inside: the exclusive lock cannot be granted before this

    t = threading.Thread(target=holder)
    t.start()
    assert held.wait(5)
    with backend.repo_lock(exclusive=True, timeout=10):
        # An ordering fact, not a duration: a loaded machine may start this thread late.
        assert releasing.is_set()
    t.join()


# ---- batches (every backend) ----------------------------------------------------------------


@pytest.fixture(params=["local", "local-fsync", "memory"])
def any_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """Every backend, and the local one also without syncfs (its fsync-per-file fallback)."""
    if request.param == "memory":
        return MemoryBackend()
    (tmp_path / "store").mkdir()
    backend = LocalBackend(tmp_path / "store")
    backend.use_syncfs = request.param == "local"
    return backend


def test_batch_puts_visible_in_view_and_stored_after(any_backend: Backend) -> None:
    with any_backend.batch() as view:
        assert view.put_if_absent("objects/ab/one", b"first") is True
        assert view.put_if_absent("objects/ab/one", b"again") is False  # dedup sees staged puts
        assert view.get("objects/ab/one") == b"first"
        assert view.get_prefix("objects/ab/one", 3) == b"fir"
        assert view.size("objects/ab/one") == 5 and view.exists("objects/ab/one")
        assert view.put_if_absent("objects/cd/two", b"") is True
    assert any_backend.get("objects/ab/one") == b"first"
    assert any_backend.get("objects/cd/two") == b""
    assert list(any_backend.list("objects")) == ["objects/ab/one", "objects/cd/two"]


def test_batch_sees_existing_values(any_backend: Backend) -> None:
    any_backend.put_if_absent("objects/ab/old", b"old")
    with any_backend.batch() as view:
        assert view.put_if_absent("objects/ab/old", b"new") is False
        assert view.get("objects/ab/old") == b"old"
    assert any_backend.get("objects/ab/old") == b"old"


def test_batch_failure_applies_nothing(any_backend: Backend) -> None:
    any_backend.put_if_absent("objects/ab/keep", b"v1")
    with pytest.raises(RuntimeError):
        with any_backend.batch() as view:
            view.put_if_absent("objects/ab/new", b"x")
            view.replace_object("objects/ab/keep", b"v2", after="objects/ab/new")
            if not isinstance(any_backend, MemoryBackend):  # the default batch is immediate
                assert not any_backend.exists("objects/ab/new")
            raise RuntimeError("boom")
    if isinstance(any_backend, LocalBackend):
        assert not any_backend.exists("objects/ab/new")
        assert any_backend.get("objects/ab/keep") == b"v1"
        assert leftover_temp_files(any_backend.root) == []


def test_batch_replacement_applied_after_its_put(any_backend: Backend) -> None:
    any_backend.put_if_absent("objects/ab/parent", b"whole")
    with any_backend.batch() as view:
        assert view.put_if_absent("objects/cd/child", b"new")
        view.replace_object("objects/ab/parent", b"delta", after="objects/cd/child")
    assert any_backend.get("objects/ab/parent") == b"delta"
    assert any_backend.get("objects/cd/child") == b"new"


def test_batch_concurrent_puts_of_one_key_store_it_once(any_backend: Backend) -> None:
    won: list[bool] = []
    with any_backend.batch() as view:
        run_threads(8, lambda i: won.append(view.put_if_absent("objects/ab/same", b"same bytes")))
        run_threads(8, lambda i: won.append(view.put_if_absent(f"objects/{i:02d}/k", bytes([i]) * 100)))
    assert won.count(True) == 9
    assert any_backend.get("objects/ab/same") == b"same bytes"
    assert all(any_backend.get(f"objects/{i:02d}/k") == bytes([i]) * 100 for i in range(8))


# ---- LocalBackend only -----------------------------------------------------------------------


def test_local_temporary_files_hidden_and_cleaned(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path)
    backend.put_if_absent("objects/aa/b", b"x")
    (tmp_path / "tmp").mkdir(exist_ok=True)
    (tmp_path / "tmp" / "leftover.tmp").write_bytes(b"partial")
    (tmp_path / "objects" / "aa" / ".0123abcd.tmp").write_bytes(b"staged by a batch that died")
    assert list(backend.list("")) == ["objects/aa/b"]
    assert backend.clean_temporary() == 2
    assert leftover_temp_files(tmp_path) == []
    assert backend.get("objects/aa/b") == b"x"


def test_local_writes_leave_no_temporary_files(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path)
    backend.put_if_absent("a", b"1")
    backend.put_if_absent("a", b"2")
    backend.replace("b", b"1")
    backend.create_exclusive("c", b"1")
    backend.create_exclusive("c", b"2")
    assert leftover_temp_files(tmp_path) == []


def test_local_lock_released_when_holder_is_killed(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from ckstore.backend.local import LocalBackend\n"
            f"with LocalBackend({str(tmp_path)!r}).repo_lock(exclusive=False, timeout=5):\n"
            "    print('locked', flush=True)\n"
            "    time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        backend = LocalBackend(tmp_path)
        with pytest.raises(LockedError):
            with backend.repo_lock(exclusive=True, timeout=0.2):
                pass
        holder.kill()
        holder.wait(10)
        with backend.repo_lock(exclusive=True, timeout=5):
            pass
    finally:
        holder.kill()
        holder.wait(10)


def test_local_batch_replacement_dropped_when_its_put_lost(tmp_path: Path) -> None:
    """Another writer stored the key first: a replacement that depends on our bytes is dropped."""
    backend = LocalBackend(tmp_path)
    backend.put_if_absent("objects/ab/parent", b"whole")
    with backend.batch() as view:
        assert view.put_if_absent("objects/cd/child", b"ours")
        view.replace_object("objects/ab/parent", b"delta on ours", after="objects/cd/child")
        assert LocalBackend(tmp_path).put_if_absent("objects/cd/child", b"theirs")  # races us
    assert backend.get("objects/cd/child") == b"theirs"
    assert backend.get("objects/ab/parent") == b"whole"
    assert leftover_temp_files(tmp_path) == []


def test_local_batch_flushes_early_and_fails_on_an_early_flush_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every EARLY_FLUSH_BYTES staged, a batch of many loose files starts a syncfs in the
    background; if one fails, the batch fails and links nothing (a later syncfs need not report
    the writeback error again)."""
    import ckstore.backend.fsio as fsio
    import ckstore.backend.local_batch as local_batch

    if not LocalBackend.use_syncfs:
        pytest.skip("no syncfs on this platform: the batch fsyncs file by file")
    monkeypatch.setattr(fsio, "EARLY_FLUSH_BYTES", 100)
    monkeypatch.setattr(local_batch, "TARGETED_BARRIER_MAX", 0)  # every loose file counts as many
    flushed: list[Path] = []
    monkeypatch.setattr(local_batch, "syncfs", lambda root: flushed.append(root) or True)
    backend = LocalBackend(tmp_path)
    with backend.batch() as view:
        view.put_if_absent("objects/ab/one", b"x" * 150)
    assert flushed == [tmp_path] and backend.get("objects/ab/one") == b"x" * 150

    def failing(root: Path) -> bool:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(local_batch, "syncfs", failing)
    with pytest.raises(StorageError, match="Input/output error"):
        with backend.batch() as view:
            view.put_if_absent("objects/cd/two", b"y" * 150)
            view.put_if_absent("objects/cd/three", b"z" * 10)
    assert not backend.exists("objects/cd/two") and not backend.exists("objects/cd/three")
    assert leftover_temp_files(tmp_path) == []


def test_a_packing_batch_syncs_its_own_files_not_the_whole_filesystem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit's batch writes packs: its early flushes fdatasync the pack and its barriers fsync
    its few files, so it never waits for other dirty files of the filesystem (the checkpoint a
    training script has just saved without fsync); a batch of many loose files still syncfs."""
    import ckstore.backend.fsio as fsio
    import ckstore.backend.local as local
    import ckstore.backend.local_batch as local_batch

    monkeypatch.setattr(fsio, "EARLY_FLUSH_BYTES", 100)
    filesystem_syncs: list[Path] = []
    monkeypatch.setattr(local_batch, "syncfs", lambda root: filesystem_syncs.append(root) or True)
    monkeypatch.setattr(local, "syncfs", lambda root: filesystem_syncs.append(root) or True)
    early: list[int] = []
    datasync = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: early.append(fd) or datasync(fd))
    backend = LocalBackend(tmp_path)
    backend.use_syncfs = True
    backend.allow_packs = lambda: True  # a repository at a version with packs
    from ckstore.codecs.objects import Kind, encode
    from ckstore.format.ids import chunk_id, object_key

    def stored(i: int) -> tuple[str, bytes]:
        raw = i.to_bytes(2, "little") * 75
        return object_key(chunk_id(raw)), encode(raw, Kind.CHUNK, 1)

    objects = dict(stored(i) for i in range(1, 6))
    with backend.batch(expected_bytes=backend.pack_min_bytes) as view:
        for key, data in objects.items():
            view.put_new(key, data)
    assert early and filesystem_syncs == []
    assert all(backend.get(key) == data for key, data in objects.items())

    many = dict(stored(i) for i in range(16, 16 + local_batch.TARGETED_BARRIER_MAX + 1))
    with backend.batch() as view:  # loose files, more than a targeted barrier takes
        for key, data in many.items():
            view.put_new(key, data)
    assert filesystem_syncs and all(backend.get(key) == data for key, data in many.items())
    assert leftover_temp_files(tmp_path) == []


def test_local_batch_is_invisible_until_flushed_and_leaves_no_temporaries(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path)
    with backend.batch() as view:
        view.put_if_absent("objects/ab/x", b"x")
        assert not backend.exists("objects/ab/x") and list(backend.list("")) == []
    assert backend.get("objects/ab/x") == b"x"
    assert leftover_temp_files(tmp_path) == []


def test_append_line_creates_appends_and_cuts_a_torn_tail(backend: Backend) -> None:
    backend.append_line("logs/a/.log", b"one\n")
    backend.append_line("logs/a/.log", b"two\n")
    assert backend.get("logs/a/.log") == b"one\ntwo\n"
    backend.replace("logs/a/.log", b"one\ntwo\nthr")  # an append torn by a crash
    backend.append_line("logs/a/.log", b"four\n")
    assert backend.get("logs/a/.log") == b"one\ntwo\nfour\n"
    backend.replace("logs/b", b"torn, no newline at all")
    backend.append_line("logs/b", b"x\n")
    assert backend.get("logs/b") == b"x\n"
    for bad in (b"no newline", b"two\nlines\n", b"\n\n"):
        with pytest.raises(ValueError):
            backend.append_line("logs/a/.log", bad)
    assert backend.get("logs/a/.log") == b"one\ntwo\nfour\n"


def test_local_append_line_cuts_a_torn_tail_longer_than_its_read_block(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path)
    backend.replace("log", b"first\n" + b"y" * 200_000)
    backend.append_line("log", b"second\n")
    assert backend.get("log") == b"first\nsecond\n"
    assert leftover_temp_files(tmp_path) == []


def test_local_prune_folders_removes_only_empty_folders_below_stop(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path)
    backend.replace("refs/heads/a/b/c", b"1")
    backend.replace("refs/heads/a/d", b"2")
    backend.delete("refs/heads/a/b/c")
    backend.prune_folders("refs/heads/a/b/c", "refs/heads")
    assert not (tmp_path / "refs/heads/a/b").exists() and (tmp_path / "refs/heads/a").is_dir()
    backend.delete("refs/heads/a/d")
    backend.prune_folders("refs/heads/a/d", "refs/heads")
    assert not (tmp_path / "refs/heads/a").exists() and (tmp_path / "refs/heads").is_dir()
    backend.replace("refs/heads/a", b"3")  # a deleted "a/…" no longer blocks "a"
    assert backend.get("refs/heads/a") == b"3"
    MemoryBackend().prune_folders("refs/heads/a/b", "refs/heads")  # no folders: nothing to do


def test_local_write_survives_its_folder_being_pruned_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = LocalBackend(tmp_path)
    write_temp = backend._write_temp

    def then_prune(data: bytes, sync: bool = True) -> Path:
        tmp = write_temp(data, sync)
        (tmp_path / "refs/heads/x").rmdir()  # a concurrent deletion of the last ref in x/
        return tmp

    (tmp_path / "refs/heads/x").mkdir(parents=True)
    monkeypatch.setattr(backend, "_write_temp", then_prune)
    assert backend.create_exclusive("refs/heads/x/y.lock", b"lock")
    assert backend.get("refs/heads/x/y.lock") == b"lock"
