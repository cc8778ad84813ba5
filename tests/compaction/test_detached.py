"""The detached compaction (compaction/detached.py): it settles the tip once the branch stays
quiet, and its log is written only as a regular file inside the repository, and rotated rather
than truncated, so neither a planted symlink nor a long history loses anyone's bytes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckstore.codecs.objects import Encoding
from ckstore.compaction.detached import COMPACTION_LOG, LOG_LIMIT, ROTATED_LOG, _open_log
from ckstore.repo import Repo
from tests.compaction.states import commit_epochs, encoding_of, tensor_chunks
from tests.helpers import checkpoint, sha256


def _ck(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ckstore.cli", "--repo", str(repo), *args], capture_output=True, text=True, timeout=300
    )


def test_a_symlinked_compact_log_never_writes_through_the_link(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    Repo.init(repo, chunk_size=4096)
    victim = tmp_path / "home" / "results.npy"  # a file of the committer's, outside the repository
    victim.parent.mkdir()
    victim.write_bytes(os.urandom(LOG_LIMIT + 4096))  # past the size at which the log was truncated
    small = tmp_path / "home" / "notes.txt"
    small.write_text("mine\n")
    digests = {victim: sha256(victim), small: sha256(small)}
    for target in (victim, small):
        (repo / COMPACTION_LOG).unlink(missing_ok=True)
        (repo / COMPACTION_LOG).symlink_to(target)  # planted by another user of a shared repository
        source = checkpoint(tmp_path / target.stem / "model.safetensors", len(target.name))
        commit = _ck(repo, "commit", str(source), "-m", target.name)
        assert commit.returncode == 0, commit.stderr
        assert _ck(repo, "wait").returncode == 0
        assert {p: sha256(p) for p in digests} == digests
        assert (repo / COMPACTION_LOG).is_symlink()  # left as it was: nothing followed it


def test_a_full_compact_log_is_rotated_keeping_its_latest_lines(tmp_path: Path) -> None:
    log = tmp_path / COMPACTION_LOG
    old = b"".join(b"line %d\n" % i for i in range(LOG_LIMIT // 8 + 10))
    log.write_bytes(old)
    fd = _open_log(tmp_path)
    try:
        os.write(fd, b"newest\n")
    finally:
        os.close(fd)
    assert (tmp_path / ROTATED_LOG).read_bytes() == old  # the latest lines before the rotation, whole
    assert log.read_bytes() == b"newest\n"


def _opened(pid: int, path: Path) -> bool:
    """Whether process ``pid`` has ``path`` open."""
    fds = Path(f"/proc/{pid}/fd")
    try:
        return any(os.path.realpath(fd) == str(path) for fd in fds.iterdir())
    except OSError:
        return False


def test_a_compaction_waiting_when_the_repository_is_created_again_stops_without_writing_into_it(
    tmp_path: Path,
) -> None:
    import shutil
    import time

    import torch

    from ckstore.compaction.compact import COMPACTION_LOCK_TIMEOUT

    root = tmp_path / "repo"
    old = Repo.init(root, chunk_size=4096)
    old.compact_after_commit = False
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 256, generator=g)
    states = [{"w": base + 1e-4 * k} for k in range(3)]
    for state in states[:2]:
        old.commit_state(state)
    with old._ctx.backend.compaction_lock(COMPACTION_LOCK_TIMEOUT):  # the compaction before it still runs
        child = subprocess.Popen(
            [sys.executable, "-m", "ckstore.compaction.detached", str(root), "main", "-1"],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "CKSTORE_QUIET_SECONDS": "0"},
        )
        deadline = time.monotonic() + 120
        while not _opened(child.pid, root / "compact.lock"):  # it waits for the lock now
            assert child.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        shutil.rmtree(root)
        new = Repo.init(root, chunk_size=4096, max_delta_depth=0)
        new.compact_after_commit = False
        for state in states:
            new.commit_state(state)
    out, _ = child.communicate(timeout=300)
    assert child.returncode == 1, out
    assert "deleted and created again" in out
    assert all(new.store.bases_of(o) == () for o in new.store.iter_ids())
    assert new.fsck(read_data=True) == []


class _Commit:
    def __init__(self, timestamp: float) -> None:
        self.timestamp = timestamp


class _Graph:
    def __init__(self, times: list[float]) -> None:
        self.times = times

    def first_parents(self, start: object, limit: int) -> list[_Commit]:
        return [_Commit(t) for t in self.times[:limit]]


class _Ctx:
    def __init__(self, times: list[float]) -> None:
        self.graph = _Graph(times)


def test_the_rest_of_the_tip_waits_for_twice_the_runs_epoch_within_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run whose epochs come every 20 minutes looks over 40 minutes after its last commit, not
    after the 5 quiet minutes that settle what stays whole; never sooner than those, never later
    than the cap; a branch of one commit (no interval) after the quiet minutes."""
    from ckstore.compaction import detached

    monkeypatch.delenv("CKSTORE_QUIET_SECONDS", raising=False)
    epoch = 1200.0
    newest_first = [10_000.0 - k * epoch for k in range(6)]
    assert detached.run_over_after(_Ctx(newest_first), "tip") == 2 * epoch  # type: ignore[arg-type]
    assert detached.run_over_after(_Ctx([1000.0, 990.0, 980.0]), "tip") == detached.QUIET_SECONDS  # type: ignore[arg-type]
    days = [1e6 - k * 86400.0 for k in range(3)]
    assert detached.run_over_after(_Ctx(days), "tip") == detached.RUN_OVER_MAX_QUIETS * detached.QUIET_SECONDS  # type: ignore[arg-type]
    assert detached.run_over_after(_Ctx([1000.0]), "tip") == detached.QUIET_SECONDS  # type: ignore[arg-type]
    monkeypatch.setenv("CKSTORE_QUIET_SECONDS", "0")  # the test suite's: nothing waits
    assert detached.run_over_after(_Ctx(newest_first), "tip") == 0  # type: ignore[arg-type]


def test_a_detached_compaction_settles_the_tip_once_the_branch_stays_quiet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After `ckstore commit` and nothing else (no `wait`), the detached compaction makes the
    parent's deltas, waits for a newer commit, and settles the tip once none came."""
    from ckstore.compaction.at_rest import is_at_rest

    monkeypatch.setenv("CKSTORE_QUIET_SECONDS", "1")
    commit_epochs(tmp_path / "repo", tmp_path, 2)
    repo = Repo(tmp_path / "repo")
    deadline = time.monotonic() + 60
    while not is_at_rest(repo.backend, repo.resolve("HEAD")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert repo.status().at_rest
    assert {encoding_of(repo, o) for o in tensor_chunks(repo, "HEAD")} == {Encoding.GROUPED}
    assert any(repo.store.bases_of(o) != () for o in tensor_chunks(repo, "HEAD~1"))
