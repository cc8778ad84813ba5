"""The detached compaction's log (compaction/detached.py): written only as a regular file inside
the repository, and rotated rather than truncated, so neither a planted symlink nor a long history
loses anyone's bytes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ckstore.compaction.detached import COMPACTION_LOG, LOG_LIMIT, ROTATED_LOG, _open_log
from ckstore.repo import Repo
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
