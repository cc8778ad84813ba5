"""Bad remote input gives a one-line error and changes nothing: endpoint URLs (F15), credentials
written into URLs (F16), symlinks in a folder remote (F18), a failed clone's leftovers and the
lazy-checkout message (F19). Regression tests; docs/reliability.md lists them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from hypothesis import given
from hypothesis import strategies as st

import ckstore
from ckstore.cli import main
from ckstore.errors import IntegrityError, InvalidInputError, StorageError
from ckstore.remote.layout import PACKS
from ckstore.repo import Repo
from ckstore.transport import RemoteOptions, open_transport, parse_url
from ckstore.transport.awsconfig import endpoint_problem, redact, resolve
from tests.remote.epochs import epoch_files, make_repo, pushed

from .test_verify import _flip_in_packs, rewrite_as_version_1

BAD_ENDPOINTS = ["http://[bad", "not a url", "http://127.0.0.1:99999", "ftp://127.0.0.1:1", "http://"]


def _cli(*args: str, code: int) -> Result:
    result = CliRunner().invoke(main, list(args), prog_name="ckstore")
    assert result.exit_code == code, (args, result.output, result.stderr)
    if code:
        assert result.stderr.startswith("ckstore: ") and result.stderr.count("\n") == 1, result.stderr
    return result


@pytest.mark.parametrize("endpoint", BAD_ENDPOINTS)
def test_remote_add_refuses_a_bad_endpoint_url(tmp_path: Path, endpoint: str) -> None:
    Repo.init(tmp_path / "a")
    result = _cli(
        "--repo", str(tmp_path / "a"), "remote", "add", "r", "s3://bucket/p", "--endpoint-url", endpoint, code=5
    )
    assert "endpoint" in result.stderr
    assert Repo(tmp_path / "a").remotes() == {}


@pytest.mark.parametrize("endpoint", BAD_ENDPOINTS)
def test_a_bad_endpoint_from_the_environment_is_a_one_line_error_not_a_panic(tmp_path: Path, endpoint: str) -> None:
    """F15: the endpoint came from AWS_ENDPOINT_URL; a real process, since the panic is Rust's."""
    Repo.init(tmp_path / "a").add_remote("r", "s3://bucket/p")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "k",
        "AWS_SECRET_ACCESS_KEY": "s",
        "PYTHONPATH": str(Path(ckstore.__file__).parents[1]),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "ckstore.cli", "--repo", str(tmp_path / "a"), "fetch", "r"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 7, proc.stderr
    assert proc.stderr.startswith("ckstore: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "endpoint" in proc.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["s3://bucket/p", "--endpoint-url", "http://user:hunter2@127.0.0.1:1"],
        ["s3://KEY:hunter2@ckstore/p"],
        ["s3://KEY@ckstore/p"],
    ],
)
def test_credentials_in_urls_are_refused_and_never_echoed_or_stored(tmp_path: Path, args: list[str]) -> None:
    """F16: the message says how credentials are passed instead, and never shows the secret."""
    Repo.init(tmp_path / "a")
    result = _cli("--repo", str(tmp_path / "a"), "remote", "add", "r", *args, code=5)
    assert (
        "hunter2" not in result.output + result.stderr and "KEY:" not in result.stderr and "KEY@" not in result.stderr
    )
    assert "AWS_ACCESS_KEY_ID" in result.stderr
    assert not (tmp_path / "a" / "remotes").exists()
    clone = _cli("clone", *args, str(tmp_path / "b"), code=5)
    assert "hunter2" not in clone.stderr and not (tmp_path / "b").exists()


def test_credentials_in_an_endpoint_from_the_environment_are_not_echoed() -> None:
    with pytest.raises(StorageError) as excinfo:
        resolve(
            None,
            env={
                "AWS_ENDPOINT_URL": "http://u:hunter2@127.0.0.1:9",
                "AWS_ACCESS_KEY_ID": "k",
                "AWS_SECRET_ACCESS_KEY": "s",
            },
        )
    assert "hunter2" not in str(excinfo.value) and "u:" not in str(excinfo.value)


@pytest.mark.parametrize("bucket", ["ab", "Bucket", "a_b", "-ab", "x" * 64, "a..b"])
def test_invalid_bucket_names_are_refused(bucket: str) -> None:
    with pytest.raises(InvalidInputError, match="bucket"):
        open_transport(f"s3://{bucket}/p", RemoteOptions())


def test_a_folder_remote_never_writes_through_a_symlinked_folder(tmp_path: Path) -> None:
    """F18: the remote's packs/ is replaced by a link to another user's folder."""
    url = str(tmp_path / "remote")
    a, _ = pushed(tmp_path, url, None)
    victim = tmp_path / "victim"
    os.rename(tmp_path / "remote" / PACKS, victim)
    os.symlink(victim, tmp_path / "remote" / PACKS)
    before = sorted(p.name for p in victim.iterdir())
    a.commit(epoch_files(tmp_path / "work" / "e2", 2), message="epoch 2")
    with pytest.raises(StorageError, match="symbolic link"):
        a.push()
    assert sorted(p.name for p in victim.iterdir()) == before
    with pytest.raises(StorageError, match="symbolic link"):
        Repo.clone(url, tmp_path / "b")


def test_a_folder_remote_refuses_a_symlinked_key(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_bytes(b"secret")
    t = open_transport(str(tmp_path / "remote"))
    t.create_location()
    t.put("refs/heads/main", b"x")
    os.symlink(outside, tmp_path / "remote" / "refs" / "heads" / "ln")
    with pytest.raises(StorageError, match="symbolic link"):
        t.get("refs/heads/ln")
    with pytest.raises(StorageError, match="symbolic link"):
        t.delete("refs/heads/ln")
    assert outside.read_bytes() == b"secret"
    assert [i.key for i in t.list("refs/")] == ["refs/heads/main"]  # a link is no key


def test_a_failed_clone_leaves_nothing_and_can_be_run_again(tmp_path: Path) -> None:
    """F19: a clone that fails (here: a truncated pack) removes the repository it began."""
    url = str(tmp_path / "remote")
    pushed(tmp_path, url, None)
    (pack,) = (tmp_path / "remote" / PACKS).iterdir()
    data = pack.read_bytes()
    pack.write_bytes(data[: len(data) // 2])
    _cli("clone", url, str(tmp_path / "b"), code=4)
    assert not (tmp_path / "b").exists()
    (tmp_path / "c").mkdir()  # a folder that existed (empty) stays, empty
    _cli("clone", url, str(tmp_path / "c"), code=4)
    assert list((tmp_path / "c").iterdir()) == []
    pack.write_bytes(data)
    _cli("clone", url, str(tmp_path / "b"), code=0)
    assert Repo(tmp_path / "b").fsck(read_data=True) == []


def test_lazy_read_of_a_corrupt_commit_names_it_plainly(tmp_path: Path) -> None:
    """F19: the message read "commit … from a commit) (read from …pack is corrupt"."""
    url = str(tmp_path / "remote")
    a, ids = pushed(tmp_path, url, None)
    transport = open_transport(url)
    rewrite_as_version_1(transport)  # no digests: only decoding can find the damage
    _flip_in_packs(transport, ids[0])
    b = Repo.init(tmp_path / "b")
    b.add_remote("origin", url)
    b.use_remote()
    with pytest.raises(IntegrityError) as excinfo:
        b.checkout("main", tmp_path / "out")
    message = str(excinfo.value)
    assert message.startswith(f"commit {ids[0]} (read from ") and ".pack) is corrupt: " in message, message


def test_import_of_an_invalid_safetensors_file_is_a_one_line_error(tmp_path: Path) -> None:
    """torch hands a .safetensors file to safetensors, whose error is one line too."""
    make_repo(tmp_path / "a", tmp_path / "work", range(1, 2))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"garbage not safetensors")
    result = _cli("--repo", str(tmp_path / "a"), "import", str(bad), code=5)
    assert "is not a valid safetensors file" in result.stderr


_PASSWORD = "pw7Zq"  # not a substring of any message ckstore writes


_AUTHORITY = st.text(st.characters(blacklist_characters="/?#@\\"), max_size=30)  # stays before the path


@given(_AUTHORITY, _AUTHORITY, st.sampled_from(["http://", "https://", "s3://", "file://", "ftp://"]))
def test_url_checks_never_raise_unexpectedly_and_never_show_a_password(before: str, after: str, scheme: str) -> None:
    """Any text as an endpoint or remote URL: a verdict (never a crash), and a password written
    into it is never part of the message."""
    url = f"{scheme}{before}:{_PASSWORD}@{after}"
    problem = endpoint_problem(url)
    assert problem is not None and _PASSWORD not in problem
    assert _PASSWORD not in redact(url)
    try:
        parse_url(url)
    except InvalidInputError as exc:
        assert _PASSWORD not in str(exc)
    else:
        raise AssertionError(f"{url!r} was accepted")
