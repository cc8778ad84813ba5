"""gc on a full disk: the moment users reach for it. Commits fill a small tmpfs until one fails
with ENOSPC; then plain gc and ``gc --keep-last 1`` succeed, leave more free space than before,
and the next commit succeeds and reads back bit-exact."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckstore.backend.local import LocalBackend
from ckstore.errors import StorageError
from ckstore.repo import Repo
from tests.helpers import tree_digest
from tests.maintenance.test_gc_interrupted import drifting_epoch

SIZE = 12 << 20


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SIZE}", "tmpfs", str(disk)], check=False)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def ckstore(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.run(
        [sys.executable, "-m", "ckstore.cli", "--repo", str(repo), *args],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.mark.slow
def test_gc_frees_space_on_a_full_disk_and_a_commit_succeeds_after(
    small_disk: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(LocalBackend, "pack_min_bytes", 0)  # commits write packs, as large ones do
    repo = Repo.init(small_disk / "repo", chunk_size=64 << 10)
    committed = 0
    for epoch in range(1, 40):
        files = drifting_epoch(tmp_path / f"e{epoch}", epoch, n=256 << 10)
        try:
            repo.commit(files, message=f"e{epoch}")
            repo.wait()
            committed += 1
        except StorageError as exc:
            assert "No space left" in str(exc)
            break
    else:
        pytest.fail("the disk never filled")
    assert committed >= 3
    full = free_bytes(small_disk)
    assert full < 1 << 20

    plain = ckstore(small_disk / "repo", "gc")
    assert plain.returncode == 0, plain.stderr  # nothing unreferenced to free, but it does not fail
    thinned = ckstore(small_disk / "repo", "gc", "--keep-last", "1")
    assert thinned.returncode == 0, thinned.stderr
    assert "freed" in thinned.stdout
    assert free_bytes(small_disk) > full + (1 << 20)

    repo = Repo(small_disk / "repo")
    assert repo.fsck(read_data=True) == []
    again = drifting_epoch(tmp_path / "again", 99, n=256 << 10)
    repo.commit(again, message="after gc")
    repo.wait()
    out = tmp_path / "out"
    repo.checkout("main", out)
    assert tree_digest(out) == tree_digest(again)
