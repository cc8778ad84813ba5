"""Pushes that fail: the server answering 500/503 or dropping connections (through the fault
proxy), a process SIGKILLed at every step of a push, and remotes that cannot be used at all.
Whatever happens, the remote never names an object it lacks, and a re-run push completes it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckstore.cli import main
from ckstore.errors import StorageError
from ckstore.remote.layout import INDEXES, PACKS
from ckstore.remote.names import open_remote
from ckstore.repo import Repo
from ckstore.repository.context import open_context
from ckstore.transport.testserver import S3Server
from tests.remote.epochs import epoch_files, make_repo

from .faultproxy import FaultProxy

FAULT_CLI = Path(__file__).resolve().parent.parent / "fault_cli.py"


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    with FaultProxy(s3_server.endpoint) as p:
        yield p


@pytest.fixture
def via_proxy(s3_server: S3Server, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    return f"s3://{s3_server.bucket}/crash/{uuid.uuid4().hex}", proxy.url


def assert_consistent(repo: Repo) -> None:
    """Every index names a pack that is there, whole; every ref's history is whole on the remote."""
    remote = open_remote(open_context(repo.path))
    packs = remote.pack_ids()
    for index in remote.catalogue().values():
        assert index.pack_id in packs
    refs = remote.list_refs()
    if refs:
        where = remote.locate()
        for oid in refs.values():
            assert oid in where


def test_transient_faults_are_retried_and_the_push_completes(
    tmp_path: Path, via_proxy: tuple[str, str], proxy: FaultProxy
) -> None:
    url, endpoint = via_proxy
    a, ids = make_repo(tmp_path / "a", tmp_path / "work", range(1, 3))
    a.add_remote("origin", url, endpoint)
    proxy.fail_next(2, 503, match=lambda method, path: method == "PUT" and "/packs/" in path)
    a.push()
    assert [s.status for s in proxy.seen if s.method == "PUT" and "/packs/" in s.path][:3] == [503, 503, 200]
    proxy.reset()
    proxy.drop_next(2, match=lambda method, path: method == "GET")
    b, _ = Repo.clone(url, tmp_path / "b", endpoint_url=endpoint)
    assert b.fsck(read_data=True) == [] and b.resolve("main") == ids[-1]


@pytest.mark.parametrize("fault", ["500", "drop"])
def test_persistent_faults_end_in_one_clean_error_and_publish_nothing(
    tmp_path: Path,
    via_proxy: tuple[str, str],
    proxy: FaultProxy,
    fault: str,
) -> None:
    url, endpoint = via_proxy
    a, ids = make_repo(tmp_path / "a", tmp_path / "work", range(1, 2))
    a.add_remote("origin", url, endpoint)

    def on_index(method: str, path: str) -> bool:
        return method == "PUT" and "/indexes/" in path

    if fault == "500":
        proxy.fail_next(1000, 500, match=on_index)
    else:
        proxy.drop_next(1000, match=on_index)
    runner = CliRunner()
    result = runner.invoke(main, ["--repo", str(tmp_path / "a"), "push"])
    assert result.exit_code == 7, result.output
    (line,) = result.output.strip().splitlines()
    assert line.startswith("ckstore: remote s3://") and ("500" in line or "connection" in line)
    proxy.reset()
    remote = open_remote(open_context(a.path))
    assert remote.list_refs() == {}  # the pack went up, its index did not: nothing is named
    assert remote.pack_ids() and not list(remote.transport.list(INDEXES))
    again = a.push()
    assert again.updated and again.packs == 1
    assert_consistent(a)
    b, _ = Repo.clone(url, tmp_path / "b", endpoint_url=endpoint)
    assert b.fsck(read_data=True) == [] and b.resolve("main") == ids[0]


def _push_cli(repo: Path, env: dict[str, str], fault: str | None = None, count: Path | None = None) -> int:
    full = {**env, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])}
    if fault:
        full["CKSTORE_FAULT"] = fault
    if count:
        full["CKSTORE_FAULT_COUNT"] = str(count)
    proc = subprocess.run(
        [sys.executable, str(FAULT_CLI), "--repo", str(repo), "push"],
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return proc.returncode


# Every step is slow (a minute or two per remote kind), so marked so; the quick run kills the
# push after its first pack went up (no index yet) and after that pack's index (no ref yet).
@pytest.mark.parametrize(
    "kind, every",
    [
        ("dir", False),
        ("s3", False),
        pytest.param("dir", True, marks=pytest.mark.slow),
        pytest.param("s3", True, marks=pytest.mark.slow),
    ],
)
def test_push_killed_at_every_step_then_rerun_leaves_a_consistent_remote(
    tmp_path: Path,
    kind: str,
    every: bool,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Epoch 1 is on the remote; the push of epochs 2 and 3 is SIGKILLed at each of its steps in
    turn (remote writes and local ones: the index cache, the remote-tracking ref); after each,
    the remote is consistent, a plain push completes it, and a fresh clone is whole."""
    if kind == "s3":
        server: S3Server = request.getfixturevalue("s3_server")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
        base_url, endpoint = f"s3://{server.bucket}/kill/{uuid.uuid4().hex}", server.endpoint
    else:
        base_url, endpoint = str(tmp_path / "remotes"), None
        (tmp_path / "remotes").mkdir()
    template = tmp_path / "template"
    a, _ = make_repo(template, tmp_path / "work", range(1, 2))
    a.create_branch("e1")
    a.commit(epoch_files(tmp_path / "work" / "e2", 2), message="epoch 2")
    a.commit(epoch_files(tmp_path / "work" / "e3", 3), message="epoch 3")
    env = dict(os.environ)
    count = tmp_path / "steps"
    # Count the steps of the push once (to a throwaway remote).
    a.add_remote("origin", f"{base_url}/count", endpoint)
    a.push(refs=["e1"])
    assert _push_cli(template, env, "none@0", count) == 0
    steps = int(count.read_text())
    a.remove_remote("origin")
    assert steps >= 4
    for k in range(1, steps + 1) if every else (2, 3):
        repo_dir = tmp_path / f"r{k}"
        shutil.copytree(template, repo_dir)
        r = Repo(repo_dir)
        url = f"{base_url}/k{k}"
        r.add_remote("origin", url, endpoint)
        r.push(refs=["e1"])
        killed = _push_cli(repo_dir, env, f"kill@{k}")
        assert killed in (-9, 0), killed
        assert_consistent(r)
        r = Repo(repo_dir)  # what the killed process left on disk
        r.push()
        assert_consistent(r)
        clone, _ = Repo.clone(url, tmp_path / f"c{k}", endpoint_url=endpoint)
        assert clone.fsck(read_data=True) == [] and clone.resolve("main") == r.resolve("main"), k
        shutil.rmtree(repo_dir)
        shutil.rmtree(tmp_path / f"c{k}")


def test_unusable_remotes_are_one_line_storage_errors(
    tmp_path: Path, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckstore.transport.testserver import free_ports

    a, _ = make_repo(tmp_path / "a", tmp_path / "work", range(1, 2))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    (port,) = free_ports(1)
    a.add_remote("down", f"s3://{s3_server.bucket}/x", f"http://127.0.0.1:{port}")
    a.add_remote("nobucket", "s3://no-such-bucket/x", s3_server.endpoint)
    a.add_remote("ok", f"s3://{s3_server.bucket}/x{uuid.uuid4().hex}", s3_server.endpoint)
    runner = CliRunner()

    def fails(*args: str) -> str:
        result = runner.invoke(main, ["--repo", str(tmp_path / "a"), *args])
        assert result.exit_code == StorageError.exit_code, result.output
        (line,) = result.output.strip().splitlines()
        return line

    assert "cannot reach" in fails("push", "down") and "remote s3://" in fails("fetch", "down")
    assert "does not exist" in fails("push", "nobucket")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    assert "access denied" in fails("push", "ok")
    assert not any(PACKS in str(p) for p in tmp_path.iterdir())


class Interrupted(BaseException):
    """Raised by the step observer: the fetch stops there, as a crash would stop it."""


@pytest.mark.slow
def test_interrupted_fetch_resumes_with_what_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fetch stopped at each of its steps in turn (an exception from the step seam: what a
    crash leaves on disk, since a batch's staged files are invisible until it lands) leaves a
    repository where every commit present is whole, and the next fetch brings only the rest."""
    from ckstore.backend import fsio
    from ckstore.remote import landing

    a = Repo.init(tmp_path / "a", chunk_size=16 << 10)
    ids = [a.commit(epoch_files(tmp_path / "work" / f"e{e}", e, n=16 << 10), message=f"epoch {e}") for e in (1, 2, 3)]
    a.add_remote("origin", str(tmp_path / "remote"))
    a.push()
    monkeypatch.setattr(landing, "LAND_BATCH", 1)  # every object its own batch
    total = None
    k = 1
    while True:
        b = Repo.init(tmp_path / f"b{k}")
        b.add_remote("origin", str(tmp_path / "remote"))
        steps = 0

        def observe(stop_at: int = k) -> None:
            nonlocal steps
            steps += 1
            if steps == stop_at:
                raise Interrupted()

        fsio.observe_steps(observe)
        try:
            b.fetch()
            finished = True
        except Interrupted:
            finished = False
        finally:
            fsio.observe_steps(None)
        for lock in (tmp_path / f"b{k}" / "refs").rglob("*.lock"):
            lock.unlink()  # stopped inside a ref update: what the stale-lock message asks a user to do
        b = Repo(tmp_path / f"b{k}")
        assert b.fsck() == []  # a commit here has every object
        landed = sum(1 for oid in ids if b.store.has(oid))
        report = b.fetch()
        assert report.commits == 3 - landed  # only what is missing
        assert b.fsck(read_data=True) == [] and b.resolve("origin/main") == ids[-1]
        shutil.rmtree(tmp_path / f"b{k}")
        if finished:
            total = k
            break
        k += 1
    assert total is not None and total > 3
