"""Ref names, compare-and-swap updates under lock files, stale locks, name conflicts."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from hypothesis import given, settings
from hypothesis import strategies as st

from ckstore.backend.base import check_key
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
    check_ref_name,
    decode_ref,
    encode_ref,
    ref_candidates,
    refname_problem,
)
from tests.helpers import assert_one_line_error, checkpoint, tree_digest

X, Y, Z = (ObjectId(chunk_id(bytes([i]))) for i in range(3))
MAIN = "refs/heads/main"


@pytest.fixture
def refs(tmp_path: Path) -> RefStore:
    return RefStore(LocalBackend(tmp_path))


@pytest.mark.parametrize(
    "name",
    [
        "main",
        "feature/x",
        "v1.0",
        "release-2024_05",
        "a/b/c",
        "user@host",
        "x+y",
        "a.b",
        "HEADS",
        "a-",
        "_",
        "lr=3e-4",
        "run#12",
        "exp(1)",
        "ünïcødé",
        "é",
        "50%",
        "a,b;c",
        "a!b",
        "{x}",
        "a]b",
        "'q'",
        '"q"',
        "a&b|c",
        "x" * 250,
        "é" * 41,
        "学习率" * 9,
        "refs",
        "a/refs/b",
        "@x",
        "x@",
        "a{",
        "foo./bar",
        "a.lck",
        "x.lock2",
    ],
)
def test_valid_names(name: str) -> None:
    assert check_ref_name(name) == name


@pytest.mark.parametrize(
    "name, reason",
    [
        ("", "it is empty"),
        ("a..b", "'..'"),
        ("..", "'..'"),
        ("-x", "starts with '-'"),
        (".hidden", "'.hidden' starts with '.'"),
        ("a/.hidden", "'.hidden' starts with '.'"),
        ("x.lock", "ends with '.lock'"),
        ("a/x.lock/b", "'x.lock' ends with '.lock'"),
        ("a//b", "'//'"),
        ("a@{1}", "'@{'"),
        ("@", "'@' alone"),
        ("a\x00b", "U+0000"),
        ("a\x01", "U+0001"),
        ("a\x7f", "U+007F"),
        ("a b", "a space"),
        ("a~1", "'~'"),
        ("a^", "'^'"),
        ("a:b", "':'"),
        ("a?", "'?'"),
        ("a*", "'*'"),
        ("a[0]", "'['"),
        ("a\\b", "'\\'"),
        ("a/", "ends with '/'"),
        ("/a", "starts with '/'"),
        ("a.", "ends with '.'"),
        ("HEAD", "'HEAD' is reserved"),
        ("a\tb", "U+0009"),
        ("a\nb", "U+000A"),
        ("../escape", "'..'"),
        ("refs/../../x", "'..'"),
        ("a\udcff", "not valid Unicode"),
        ("refs/heads/x", "give the short name 'x'"),
        ("refs/tags/v1", "give the short name 'v1'"),
        ("refs/x", "starts with 'refs/'"),
        ("x" * 251, "251 bytes stored"),
        ("é" * 42, "252 bytes stored"),
        ("/".join(["x" * 200] * 3), "602 bytes"),
    ],
)
def test_invalid_names_say_which_rule(name: str, reason: str) -> None:
    with pytest.raises(InvalidRefNameError) as info:
        check_ref_name(name, "branch name")
    message = str(info.value)
    assert message.startswith(f"invalid branch name {name!r}: ") and reason in message, message
    assert "\n" not in message


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


# ---- git's own test vectors --------------------------------------------------------------------

# Every valid_ref/invalid_ref case of git's t/t1402-check-ref-format.sh (git master, 2026), as
# (refname, options, git accepts it). ckstore checks names as ``git check-ref-format`` does with
# no options or --allow-onelevel. --refspec-pattern only changes how '*' is treated, so its cases
# without '*' are checked too; ckstore has no refspecs (a '*' is always refused) and does not
# normalize (--normalize collapses slashes first), so those cases are listed but not run.
T1402 = [
    ("", "", False),
    ("/", "", False),
    ("/", "--allow-onelevel", False),
    ("/", "--normalize", False),
    ("/", "--allow-onelevel --normalize", False),
    ("foo/bar/baz", "", True),
    ("foo/bar/baz", "--normalize", True),
    ("refs///heads/foo", "", False),
    ("refs///heads/foo", "--normalize", True),
    ("heads/foo/", "", False),
    ("/heads/foo", "", False),
    ("/heads/foo", "--normalize", True),
    ("///heads/foo", "", False),
    ("///heads/foo", "--normalize", True),
    ("./foo", "", False),
    ("./foo/bar", "", False),
    ("foo/./bar", "", False),
    ("foo/bar/.", "", False),
    (".refs/foo", "", False),
    ("refs/heads/foo.", "", False),
    ("heads/foo..bar", "", False),
    ("heads/foo?bar", "", False),
    ("foo./bar", "", True),
    ("heads/foo.lock", "", False),
    ("heads///foo.lock", "", False),
    ("foo.lock/bar", "", False),
    ("foo.lock///bar", "", False),
    ("heads/foo@bar", "", True),
    ("heads/v@{ation", "", False),
    ("heads/foo\\bar", "", False),
    ("heads/foo\t", "", False),
    ("heads/foo\x7f", "", False),
    ("heads/fu\u00df", "", True),
    ("heads/*foo/bar", "--refspec-pattern", True),
    ("heads/foo*/bar", "--refspec-pattern", True),
    ("heads/f*o/bar", "--refspec-pattern", True),
    ("heads/f*o*/bar", "--refspec-pattern", False),
    ("heads/foo*/bar*", "--refspec-pattern", False),
    ("foo", "", False),
    ("foo", "--allow-onelevel", True),
    ("foo", "--refspec-pattern", False),
    ("foo", "--refspec-pattern --allow-onelevel", True),
    ("foo", "--normalize", False),
    ("foo", "--allow-onelevel --normalize", True),
    ("foo/bar", "", True),
    ("foo/bar", "--allow-onelevel", True),
    ("foo/bar", "--refspec-pattern", True),
    ("foo/bar", "--refspec-pattern --allow-onelevel", True),
    ("foo/bar", "--normalize", True),
    ("foo/*", "", False),
    ("foo/*", "--allow-onelevel", False),
    ("foo/*", "--refspec-pattern", True),
    ("foo/*", "--refspec-pattern --allow-onelevel", True),
    ("*/foo", "", False),
    ("*/foo", "--allow-onelevel", False),
    ("*/foo", "--refspec-pattern", True),
    ("*/foo", "--refspec-pattern --allow-onelevel", True),
    ("*/foo", "--normalize", False),
    ("*/foo", "--refspec-pattern --normalize", True),
    ("foo/*/bar", "", False),
    ("foo/*/bar", "--allow-onelevel", False),
    ("foo/*/bar", "--refspec-pattern", True),
    ("foo/*/bar", "--refspec-pattern --allow-onelevel", True),
    ("*", "", False),
    ("*", "--allow-onelevel", False),
    ("*", "--refspec-pattern", False),
    ("*", "--refspec-pattern --allow-onelevel", True),
    ("foo/*/*", "--refspec-pattern", False),
    ("foo/*/*", "--refspec-pattern --allow-onelevel", False),
    ("*/foo/*", "--refspec-pattern", False),
    ("*/foo/*", "--refspec-pattern --allow-onelevel", False),
    ("*/*/foo", "--refspec-pattern", False),
    ("*/*/foo", "--refspec-pattern --allow-onelevel", False),
    ("/foo", "", False),
    ("/foo", "--allow-onelevel", False),
    ("/foo", "--refspec-pattern", False),
    ("/foo", "--refspec-pattern --allow-onelevel", False),
    ("/foo", "--normalize", False),
    ("/foo", "--allow-onelevel --normalize", True),
    ("/foo", "--refspec-pattern --normalize", False),
    ("/foo", "--refspec-pattern --allow-onelevel --normalize", True),
]
T1402_RUN = [
    (name, "--allow-onelevel" in opts, valid)
    for name, opts, valid in T1402
    if "--normalize" not in opts and ("--refspec-pattern" not in opts or "*" not in name)
]


def test_t1402_table_is_complete() -> None:
    assert len(T1402) == 81 and len(T1402_RUN) == 47


@pytest.mark.parametrize("name, onelevel, valid", T1402_RUN, ids=repr)
def test_git_t1402_check_ref_format(name: str, onelevel: bool, valid: bool) -> None:
    assert (refname_problem(name, allow_onelevel=onelevel) is None) is valid


@pytest.mark.parametrize("name", sorted({n for n, _, valid in T1402_RUN if valid}), ids=repr)
def test_every_name_git_accepts_is_a_branch_and_tag_name(name: str) -> None:
    assert check_ref_name(name) == name
    assert ref_candidates(name) == ["refs/heads/" + name, "refs/tags/" + name]


def test_git_refuses_a_branch_named_like_an_option() -> None:
    """t1402 'check-ref-format --branch -nain': git's check_branch_ref refuses a leading '-'."""
    with pytest.raises(InvalidRefNameError, match="starts with '-'"):
        check_ref_name("-nain", "branch name")


# Special characters of git's rules and of the encoding, mixed with arbitrary text.
_TRICKY = st.sampled_from(list("./@{}-~^:?[]\\* \t\x7f%=#()éß\u00a0") + [".lock", "..", "@{", "//", "refs/"])
NAMES = st.lists(st.one_of(_TRICKY, st.characters(blacklist_categories=("Cs",))), max_size=12).map("".join)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs the git command to compare with")
@settings(max_examples=300, deadline=None)
@given(name=NAMES.filter(lambda n: "\x00" not in n))
def test_same_verdict_as_installed_git(name: str) -> None:
    """Differential: refname_problem agrees with the real ``git check-ref-format`` on any text."""
    full = "refs/heads/" + name
    git = subprocess.run(["git", "check-ref-format", full], capture_output=True, check=False)
    assert (refname_problem(full) is None) is (git.returncode == 0), (full, git.stderr)
    if name and not name.startswith("-"):  # git would read a leading '-' as an option
        git = subprocess.run(["git", "check-ref-format", "--allow-onelevel", name], capture_output=True, check=False)
        assert (refname_problem(name, allow_onelevel=True) is None) is (git.returncode == 0), (name, git.stderr)


# ---- the on-disk encoding --------------------------------------------------------------------


@settings(max_examples=500)
@given(name=NAMES)
def test_every_accepted_name_has_a_safe_key_that_decodes_back(name: str) -> None:
    try:
        check_ref_name(name)
    except InvalidRefNameError:
        return
    key = encode_ref("refs/heads/" + name)
    assert key.isascii() and check_key(key) == key and check_key(key + ".lock")
    assert decode_ref(key) == "refs/heads/" + name
    assert len(key.split("/")[-1]) <= 250 and not key.endswith(".lock")


@given(name=st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._/@+-", min_size=1))
def test_names_of_the_previous_alphabet_keep_their_keys(name: str) -> None:
    assert encode_ref(name) == name
    if refname_problem("refs/heads/" + name) is None:
        assert decode_ref("refs/heads/" + name) == "refs/heads/" + name  # old repositories read unchanged


@pytest.mark.parametrize(
    "name, key",
    [
        ("lr=3e-4", "lr%3D3e-4"),
        ("run#12", "run%2312"),
        ("exp(1)", "exp%281%29"),
        ("50%", "50%25"),
        ("ünï", "%C3%BCn%C3%AF"),
        ("a=b/c", "a%3Db/c"),
        ("学", "%E5%AD%A6"),
    ],
)
def test_encoding_examples_from_format_md(name: str, key: str) -> None:
    assert encode_ref(name) == key and decode_ref("refs/heads/" + key) == "refs/heads/" + name


@pytest.mark.parametrize(
    "key",
    [
        "refs/heads/%41",  # 'A' escaped: not canonical, would let two keys hold one name
        "refs/heads/%c3%bc",
        "refs/heads/%C3",
        "refs/heads/%FF",
        "refs/heads/a%2",
        "refs/heads/%2E%2E",
        "refs/heads/.DS_Store",
        "refs/heads/x.lock",
        "refs/heads/a%20",
        "refs/heads/%2Fetc",
    ],
)
def test_keys_that_are_not_canonical_encodings_decode_to_nothing(key: str) -> None:
    assert decode_ref(key) is None


@pytest.mark.parametrize(
    "name, expected",
    [
        ("x", ["refs/heads/x", "refs/tags/x"]),
        ("a/b", ["refs/heads/a/b", "refs/tags/a/b"]),
        ("refs/heads/x", ["refs/heads/x"]),
        ("refs/tags/v1", ["refs/tags/v1"]),
        ("refs/heads/refs/heads/x", ["refs/heads/refs/heads/x"]),  # made by an older ckstore: still reachable
        ("refs/heads/lr=3e-4", ["refs/heads/lr=3e-4"]),
    ],
)
def test_ref_candidates(name: str, expected: list[str]) -> None:
    assert ref_candidates(name) == expected


@pytest.mark.parametrize("name", ["a..b", "refs/heads/a..b", "refs/heads/", "refs/", "-x", "a b", "@", "refs/x\udcff"])
def test_ref_candidates_refuse_invalid_names(name: str) -> None:
    with pytest.raises(InvalidRefNameError):
        ref_candidates(name)


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
