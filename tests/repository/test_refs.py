"""Refs: compare-and-swap updates under lock files, stale locks, name conflicts, names of every
kind in the store and through the command line (which names are valid: test_ref_names.py)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from ckstore.backend.fsio import process_owner
from ckstore.backend.local import LocalBackend
from ckstore.backend.memory import MemoryBackend
from ckstore.cli import main
from ckstore.errors import (
    IntegrityError,
    InvalidRefNameError,
    LockedError,
    RefChangedError,
    RefExistsError,
)
from ckstore.format.ids import ObjectId, chunk_id
from ckstore.repo import Repo
from ckstore.repository import refs as refs_module
from ckstore.repository.refs import (
    ANY,
    RefStore,
    encode_ref,
)
from tests.helpers import assert_one_line_error, checkpoint, tree_digest

X, Y, Z = (ObjectId(chunk_id(bytes([i]))) for i in range(3))
MAIN = "refs/heads/main"


@pytest.fixture
def refs(tmp_path: Path) -> RefStore:
    return RefStore(LocalBackend(tmp_path))


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


def test_lock_of_a_dead_process_is_broken(refs: RefStore) -> None:
    """A process killed inside a ref update (a preempted training job) leaves its lock: the next
    update proves the process gone (same host, boot and pid namespace) and goes on."""
    refs.update(MAIN, X)
    lock = {**process_owner(), "pid": _dead_pid()}
    refs.backend.create_exclusive(MAIN + ".lock", json.dumps(lock).encode())
    refs.update(MAIN, Y, expected=X)
    assert refs.read(MAIN) == Y
    assert not refs.backend.exists(MAIN + ".lock") and not refs.backend.exists(MAIN + ".lock.lock")


def test_lock_of_an_earlier_boot_is_broken(refs: RefStore) -> None:
    lock = {**process_owner(), "pid": 1, "boot": "an earlier boot"}  # pid 1 runs, but not that one
    refs.backend.create_exclusive(MAIN + ".lock", json.dumps(lock).encode())
    refs.update(MAIN, X)
    assert refs.read(MAIN) == X


def test_lock_of_another_pid_namespace_is_waited_for(refs: RefStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """A container sharing the host's name counts process ids apart: its lock may be live."""
    monkeypatch.setattr(refs_module, "LOCK_WAIT", 0.3)
    lock = {**process_owner(), "pid": _dead_pid(), "pidns": "pid:[1]"}
    refs.backend.create_exclusive(MAIN + ".lock", json.dumps(lock).encode())
    with pytest.raises(LockedError, match="locked by another"):
        refs.update(MAIN, X)
    assert refs.read(MAIN) is None


def test_breaking_never_deletes_a_lock_taken_meanwhile(refs: RefStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes find the same stale lock; the first breaks it and takes its own; the second
    must not delete that one (it compares the bytes it judged stale under the breaker lock)."""
    stale = json.dumps({**process_owner(), "pid": _dead_pid()}).encode()
    fresh = json.dumps({**process_owner(), "time": 1.0}).encode()
    refs.backend.create_exclusive(MAIN + ".lock", stale)
    real_get = refs.backend.get
    calls = []

    def get_then_swap(key: str) -> bytes:
        value = real_get(key)
        if key == MAIN + ".lock" and not calls:  # after the first read, another breaker wins
            calls.append(key)
            refs.backend.delete(MAIN + ".lock")
            refs.backend.create_exclusive(MAIN + ".lock", fresh)
        return value

    monkeypatch.setattr(refs.backend, "get", get_then_swap)
    monkeypatch.setattr(refs_module, "LOCK_WAIT", 0.3)
    with pytest.raises(LockedError, match="locked by another"):
        refs.update(MAIN, X)
    assert real_get(MAIN + ".lock") == fresh


def test_old_stale_lock_is_reported_with_its_path(refs: RefStore, tmp_path: Path) -> None:
    """A lock without boot and pid namespace (an older ckstore) cannot be proven stale."""
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


# ---- the ref store with such names, on every backend -------------------------------------------

ML_NAMES = ["lr=3e-4", "run#12", "exp(1)", "ünïcødé", "a/b/c", "50%", "学习率/v1"]


@pytest.fixture(params=["local", "memory"])
def any_refs(request: pytest.FixtureRequest, tmp_path: Path) -> RefStore:
    return RefStore(LocalBackend(tmp_path) if request.param == "local" else MemoryBackend())


def test_store_list_and_delete_every_kind_of_name(any_refs: RefStore) -> None:
    for i, name in enumerate(ML_NAMES):
        any_refs.update("refs/heads/" + name, [X, Y, Z][i % 3], expected=None)
        any_refs.update("refs/tags/" + name, X, expected=None)
    assert any_refs.list("refs/heads/") == {name: [X, Y, Z][i % 3] for i, name in enumerate(ML_NAMES)}
    assert set(any_refs.backend.list("refs/tags/")) == {"refs/tags/" + encode_ref(n) for n in ML_NAMES}
    for name in ML_NAMES:
        with pytest.raises(RefExistsError, match="already exists"):
            any_refs.update("refs/heads/" + name, Y, expected=None)
        assert any_refs.delete("refs/heads/" + name) and any_refs.read("refs/heads/" + name) is None
    assert any_refs.list("refs/heads/") == {} and len(any_refs.list("refs/tags/")) == len(ML_NAMES)


def test_lock_of_an_encoded_name_is_its_key_plus_lock(refs: RefStore) -> None:
    refs.backend.create_exclusive("refs/heads/lr%3D3e-4.lock", b"{}")
    released = threading.Event()

    def release() -> None:
        released.set()  # set first: the update cannot finish before the lock is gone
        refs.backend.delete("refs/heads/lr%3D3e-4.lock")

    threading.Timer(0.3, release).start()
    refs.update("refs/heads/lr=3e-4", X)
    # An ordering, not a duration: the update waited for the lock file under the encoded key.
    assert released.is_set() and refs.read("refs/heads/lr=3e-4") == X


@pytest.mark.parametrize(
    "first, second",
    [
        ("main", "Main"),
        ("main", "MAIN/x"),
        ("a/b", "A/c"),
        ("Exp/run", "exp"),
        ("lr=3E-4", "lr=3e-4"),
    ],
)
def test_names_differing_only_in_case_are_refused(any_refs: RefStore, first: str, second: str) -> None:
    any_refs.update("refs/heads/" + first, X, expected=None)
    for expected in (None, ANY):
        with pytest.raises(RefExistsError, match="only in letter case"):
            any_refs.update("refs/heads/" + second, Y, expected=expected)
    any_refs.update("refs/tags/" + second, Y, expected=None)  # another folder: no collision on disk
    assert any_refs.list("refs/heads/") == {first: X}


def test_non_ascii_case_pairs_are_distinct_keys(any_refs: RefStore) -> None:
    """Ä and ä are escaped to %C3%84 and %C3%A4: no file system folds them into one file."""
    any_refs.update("refs/heads/Ä", X, expected=None)
    any_refs.update("refs/heads/ä", Y, expected=None)
    assert any_refs.list("refs/heads/") == {"Ä": X, "ä": Y}


def test_stray_file_in_refs_is_reported_not_guessed(refs: RefStore, tmp_path: Path) -> None:
    refs.update(MAIN, X)
    (tmp_path / "refs/heads/%c3%bc").write_text(X + "\n")
    with pytest.raises(IntegrityError, match="stray file .*%c3%bc"):
        refs.list("refs/heads/")


def test_unicode_head_is_stored_as_text(refs: RefStore, tmp_path: Path) -> None:
    refs.set_head_branch("ünï/lr=3e-4")
    assert (tmp_path / "HEAD").read_bytes() == "ref: refs/heads/ünï/lr=3e-4\n".encode()
    assert refs.head_branch() == "ünï/lr=3e-4"
    (tmp_path / "HEAD").write_bytes(b"ref: refs/heads/\xff\n")
    with pytest.raises(IntegrityError, match="HEAD is corrupt"):
        refs.head_branch()
    (tmp_path / "HEAD").write_text("ref: refs/heads/refs/heads/x\n")  # an older ckstore could write it
    assert refs.head_branch() == "refs/heads/x"


# ---- through the command line ------------------------------------------------------------------

Cli = Callable[..., Result]


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Cli:
    """``ckstore --repo tmp_path/repo ARGS`` in-process, with two commits on main; checks the exit
    code and, for failures, the one-line error contract."""
    monkeypatch.delenv("CKSTORE_REPO", raising=False)
    runner = CliRunner()

    def run(*args: str, code: int = 0) -> Result:
        result = runner.invoke(main, ["--repo", str(tmp_path / "repo"), *args], prog_name="ckstore")
        assert result.exit_code == code, (args, result.output, result.stderr)
        if code:
            assert_one_line_error(result.stderr)
        return result

    Repo.init(tmp_path / "repo", chunk_size=4096)
    for seed in (0, 1):
        run("commit", str(checkpoint(tmp_path / f"ep{seed}" / "model.safetensors", seed)), "-m", f"epoch {seed}")
    return run


@pytest.mark.parametrize("name", ["lr=3e-4", "run#12", "exp(1)", "ünïcødé", "a/b/c"])
def test_cli_branch_and_tag_lifecycle(cli: Cli, tmp_path: Path, name: str) -> None:
    first, tip = (json.loads(cli("show", spec, "--json").stdout)["id"] for spec in ("HEAD~1", "HEAD"))
    assert cli("branch", name, "HEAD~1").stdout == f"branch {name} -> {first}\n"
    assert cli("tag", name).stdout == f"tag {name} -> {tip}\n"
    assert [name, first[:12]] in [line.split() for line in cli("branch").stdout.splitlines()]
    assert [name, tip[:12]] in [line.split() for line in cli("tag").stdout.splitlines()]
    # A short name means the branch (branch first); full names pick either.
    for spec, expected in (
        (name, first),
        (f"refs/heads/{name}", first),
        (f"refs/tags/{name}", tip),
        (f"{name}~0", first),
        (f"refs/tags/{name}^", first),
    ):
        assert json.loads(cli("show", spec, "--json").stdout)["id"] == expected, spec
    assert [e["id"] for e in json.loads(cli("log", name, "--json").stdout)] == [first]
    cli("checkout", name, "-o", str(tmp_path / "out"))
    assert tree_digest(tmp_path / "out") == tree_digest(tmp_path / "ep0")
    # A commit onto the branch by name, then gc: the branch keeps its commits.
    new = cli("commit", str(checkpoint(tmp_path / "ep2" / "model.safetensors", 2)), "--branch", name).stdout.strip()
    assert json.loads(cli("show", name, "--json").stdout)["parents"] == [first]
    cli("gc", "--keep-last", "1")
    assert {json.loads(cli("show", s, "--json").stdout)["id"] for s in (name, f"refs/tags/{name}")} == {new, tip}
    assert "no problems found" in cli("fsck", "--read-data").stdout
    assert cli("branch", "-d", name).stdout.startswith(f"deleted branch {name} (was ")  # the reflog can restore it
    assert json.loads(cli("show", name, "--json").stdout)["id"] == tip  # now the tag
    cli("tag", "-d", name)
    cli("show", name, code=3)
    assert cli("branch").stdout.split() == ["*", "main", tip[:12]]


@pytest.mark.parametrize(
    "kind, name, short",
    [
        ("branch", "refs/heads/x", "x"),
        ("tag", "refs/tags/x", "x"),
        ("branch", "refs/tags/x", "x"),
    ],
)
def test_cli_refuses_full_ref_names_as_short_names(cli: Cli, kind: str, name: str, short: str) -> None:
    err = cli(kind, name, code=5).stderr
    assert f"invalid {kind} name {name!r}" in err and f"give the short name {short!r}" in err
    cli(kind, short)
    assert json.loads(cli("show", f"refs/{'heads' if kind == 'branch' else 'tags'}/{short}", "--json").stdout)


def test_cli_resolves_a_refs_branch_made_by_an_older_version(cli: Cli, tmp_path: Path) -> None:
    """Older ckstore accepted `branch refs/heads/x`, storing refs/heads/refs/heads/x that nothing
    could name; its full name now reaches it."""
    tip = json.loads(cli("show", "--json").stdout)["id"]
    (tmp_path / "repo/refs/heads/refs/heads").mkdir(parents=True)
    (tmp_path / "repo/refs/heads/refs/heads/x").write_text(tip + "\n")
    assert json.loads(cli("show", "refs/heads/refs/heads/x", "--json").stdout)["id"] == tip
    assert ["refs/heads/x", tip[:12]] in [line.split() for line in cli("branch").stdout.splitlines()]
    cli("show", "refs/heads/x", code=3)


@pytest.mark.parametrize(
    "args", [("branch", ""), ("tag", ""), ("branch", "-d", ""), ("tag", "-d", ""), ("branch", "", "HEAD~1")]
)
def test_cli_empty_names_fail(cli: Cli, args: tuple[str, ...]) -> None:
    err = cli(*args, code=5).stderr
    assert "name '': it is empty" in err
    assert cli("branch").stdout.split()[1] == "main" and cli("tag").stdout == ""


def test_cli_refuses_a_case_twin_and_fsck_reports_a_stray_ref_file(cli: Cli, tmp_path: Path) -> None:
    err = cli("branch", "Main", code=6).stderr
    assert "branch 'main' exists" in err and "letter case" in err
    cli("tag", "Main")  # tags live in another folder
    (tmp_path / "repo/refs/heads/%zz").write_text("0" * 64 + "\n")
    out = cli("fsck", code=4).stdout
    assert "stray file" in out and "%zz" in out
    assert "stray file" in cli("branch", code=4).stderr
    assert "stray file" in cli("gc", code=4).stderr  # it might be a ref: nothing is deleted
