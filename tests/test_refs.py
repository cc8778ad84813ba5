"""Ref names, compare-and-swap updates under lock files, stale locks, name conflicts."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ckstore import refs as refs_module
from ckstore.backend.local import LocalBackend
from ckstore.errors import InvalidRefNameError, LockedError, RefChangedError, RefExistsError
from ckstore.ids import ObjectId, chunk_id
from ckstore.refs import RefStore, check_ref_name

X, Y, Z = (ObjectId(chunk_id(bytes([i]))) for i in range(3))
MAIN = "refs/heads/main"


@pytest.fixture
def refs(tmp_path: Path) -> RefStore:
    return RefStore(LocalBackend(tmp_path))


@pytest.mark.parametrize("name", [
    "main", "feature/x", "v1.0", "release-2024_05", "a/b/c", "user@host", "x+y", "a.b", "HEADS", "a-", "_",
])
def test_valid_names(name: str) -> None:
    assert check_ref_name(name) == name


@pytest.mark.parametrize("name", [
    "", "a..b", "..", "-x", ".hidden", "a/.hidden", "x.lock", "a/x.lock/b", "a//b", "a@{1}", "@",
    "a\x00b", "a\x01", "a\x7f", "a b", "a~1", "a^", "a:b", "a?", "a*", "a[0]", "a\\b", "a/", "/a", "a.",
    "HEAD", "x" * 201, "é", "a\tb", "a\nb", "../escape", "refs/../../x",
])
def test_invalid_names(name: str) -> None:
    with pytest.raises(InvalidRefNameError):
        check_ref_name(name)


def test_read_update_and_expected_none(refs: RefStore) -> None:
    assert refs.read(MAIN) is None
    refs.update(MAIN, X, expected=None)
    assert refs.read(MAIN) == X
    with pytest.raises(RefExistsError):
        refs.update(MAIN, Y, expected=None)
    refs.update(MAIN, Y, expected=X)
    with pytest.raises(RefChangedError):
        refs.update(MAIN, Z, expected=X)
    assert refs.read(MAIN) == Y
    assert refs.list("refs/heads/") == {"main": Y}


def test_cas_race_has_exactly_one_winner(refs: RefStore) -> None:
    for round_ in range(5):
        refs.update(MAIN, X)  # ANY: reset the race
        barrier = threading.Barrier(2)
        outcomes: dict[ObjectId, str] = {}

        def racer(new: ObjectId) -> None:
            barrier.wait()
            try:
                refs.update(MAIN, new, expected=X)
                outcomes[new] = "won"
            except RefChangedError:
                outcomes[new] = "lost"

        threads = [threading.Thread(target=racer, args=(v,)) for v in (Y, Z)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(outcomes.values()) == ["lost", "won"], round_
        winner = next(v for v, o in outcomes.items() if o == "won")
        assert refs.read(MAIN) == winner
        assert not refs.backend.exists(MAIN + ".lock")


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_lock_is_reported_with_its_path(refs: RefStore, tmp_path: Path) -> None:
    refs.update(MAIN, X)
    lock = {"pid": _dead_pid(), "host": socket.gethostname(), "time": time.time()}
    refs.backend.create_exclusive(MAIN + ".lock", json.dumps(lock).encode())
    with pytest.raises(LockedError) as info:
        refs.update(MAIN, Y, expected=X)
    assert str(tmp_path / "refs/heads/main.lock") in str(info.value)
    assert refs.read(MAIN) == X
    assert refs.list("refs/heads/") == {"main": X}  # lock files are not refs


def test_live_lock_times_out(refs: RefStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(refs_module, "LOCK_WAIT", 0.3)
    lock = {"pid": 1, "host": socket.gethostname(), "time": time.time()}  # pid 1 always runs
    refs.backend.create_exclusive(MAIN + ".lock", json.dumps(lock).encode())
    with pytest.raises(LockedError, match="locked by another"):
        refs.update(MAIN, X)
    assert refs.read(MAIN) is None


def test_lock_waits_for_release(refs: RefStore) -> None:
    refs.backend.create_exclusive(MAIN + ".lock", b"{}")
    threading.Timer(0.3, lambda: refs.backend.delete(MAIN + ".lock")).start()
    refs.update(MAIN, X)
    assert refs.read(MAIN) == X


@pytest.mark.parametrize("first, second", [("a", "a/b"), ("a/b", "a"), ("x/y/z", "x")])
def test_branch_and_folder_conflict(refs: RefStore, first: str, second: str) -> None:
    refs.update("refs/heads/" + first, X, expected=None)
    with pytest.raises(RefExistsError):
        refs.update("refs/heads/" + second, Y, expected=None)
    assert refs.read("refs/heads/" + first) == X
    assert refs.read("refs/heads/" + second) is None
    assert refs.delete("refs/heads/" + second) is False
    assert refs.list("refs/heads/") == {first: X}


def test_head(refs: RefStore) -> None:
    assert refs.head_branch() == "main"
    refs.set_head_branch("dev")
    assert refs.head_branch() == "dev"
    with pytest.raises(InvalidRefNameError):
        refs.set_head_branch("../x")
