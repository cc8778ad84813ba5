"""`ckstore status`: branch and HEAD, compaction, storage, overlay bases, remotes ahead/behind."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckstore.cli import main
from ckstore.repo import Repo
from tests.helpers import checkpoint


def _status(repo: Path, *extra: str) -> str:
    result = CliRunner().invoke(main, ["--repo", str(repo), "status", *extra], prog_name="ckstore")
    assert result.exit_code == 0, result.output
    return result.stdout


def _json(repo: Path) -> dict:
    return json.loads(_status(repo, "--json"))


def test_empty_repository(tmp_path: Path) -> None:
    Repo.init(tmp_path / "r")
    assert _status(tmp_path / "r").splitlines()[0] == "On branch main: no commits yet"
    doc = _json(tmp_path / "r")
    assert (doc["branch"], doc["head"], doc["commits"], doc["remotes"], doc["bases"]) == ("main", None, 0, [], [])


def test_head_storage_and_what_gc_would_free(tmp_path: Path) -> None:
    repo = Repo.init(tmp_path / "r")
    oid = repo.commit([checkpoint(tmp_path / "a.safetensors", 1)], message="epoch 1")
    repo.wait()  # this process's compaction
    assert _status(tmp_path / "r").splitlines()[0] == f"On branch main, HEAD {oid[:12]} epoch 1"
    repo.store.put_chunk(os.urandom(5000), 1)  # an object no commit names
    doc = _json(tmp_path / "r")
    assert doc["head"] == oid and doc["commits"] == 1
    assert doc["stored_bytes"] == repo.stats().stored_bytes
    assert doc["gc_would_free_bytes"] > 5000
    assert doc["gc_would_free_bytes"] == repo.gc().freed_bytes


def test_compaction_in_another_process_is_reported(tmp_path: Path) -> None:
    repo = Repo.init(tmp_path / "r")
    repo.commit([checkpoint(tmp_path / "a.safetensors", 1)], message="one")
    repo.wait()  # this process's compaction
    assert _json(tmp_path / "r")["compaction_running"] is False
    # flock locks belong to the open file description: a second open is another holder, as a
    # compacting process would be.
    fd = os.open(tmp_path / "r" / "compact.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert _json(tmp_path / "r")["compaction_running"] is True
        assert "compaction: running in another process" in _status(tmp_path / "r")
    finally:
        os.close(fd)


def test_remote_branches_ahead_and_behind(tmp_path: Path) -> None:
    repo = Repo.init(tmp_path / "r")
    repo.commit([checkpoint(tmp_path / "a.safetensors", 1)], message="one")
    repo.add_remote("origin", str(tmp_path / "remote"))
    repo.push("origin")
    assert "main: up to date with origin/main" in _status(tmp_path / "r")
    repo.commit([checkpoint(tmp_path / "a.safetensors", 2)], message="two")
    repo.commit([checkpoint(tmp_path / "a.safetensors", 3)], message="three")
    other, _ = Repo.clone(str(tmp_path / "remote"), tmp_path / "clone")
    other.commit([checkpoint(tmp_path / "b.safetensors", 9)], message="theirs")
    other.push("origin")
    repo.fetch("origin")  # origin/main: one commit main lacks; main: two that origin/main lacks
    (branch,) = _json(tmp_path / "r")["remotes"][0]["branches"]
    assert (branch["branch"], branch["ahead"], branch["behind"]) == ("main", 2, 1)
    assert "main: 2 ahead, 1 behind origin/main" in _status(tmp_path / "r")


def test_overlay_base_reachable_then_moved(tmp_path: Path) -> None:
    base = Repo.init(tmp_path / "base")
    base.commit([checkpoint(tmp_path / "p.safetensors", 1)], message="pretrained")
    overlay = Repo.init(tmp_path / "ovl")
    overlay.commit([checkpoint(tmp_path / "f.safetensors", 2)], message="ft", base="HEAD", base_repo=tmp_path / "base")
    (entry,) = _json(tmp_path / "ovl")["bases"]
    assert entry["reachable"] is True and entry["location"] == str((tmp_path / "base").resolve())
    shutil.move(tmp_path / "base", tmp_path / "elsewhere")
    (entry,) = _json(tmp_path / "ovl")["bases"]
    assert entry["reachable"] is False and "relink" in entry["reason"]
    assert "UNREACHABLE" in _status(tmp_path / "ovl")


@pytest.mark.parametrize("args", [["status", "--json"], ["status"]])
def test_outside_a_repository_is_a_one_line_error(tmp_path: Path, args: list[str]) -> None:
    result = CliRunner().invoke(main, ["--repo", str(tmp_path / "none"), *args], prog_name="ckstore")
    assert result.exit_code == 3 and len(result.stderr.strip().splitlines()) == 1
