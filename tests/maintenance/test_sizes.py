"""gc and repack leave the storage figures current (issue 22 item 4): `status` right after them
shows exact figures without measuring, and a change after them is still seen."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckstore.cli import main
from ckstore.maintenance import sizes, sizes_cache
from ckstore.repo import Repo
from ckstore.report import status as status_module
from tests.report.test_status_cost import measurements


def _status(repo: Path) -> dict:  # type: ignore[type-arg]
    result = CliRunner().invoke(main, ["--repo", str(repo), "status", "--json"], prog_name="ckstore")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def history(tmp_path: Path, commits: int = 3) -> Repo:
    """``commits`` commits of two files each, one changing, and an object no commit names."""
    repo = Repo.init(tmp_path / "r")
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "fixed.bin").write_bytes(os.urandom(3000))
    for i in range(commits):
        (folder / "m.bin").write_bytes(os.urandom(4000 + i))
        repo.commit(folder, message=f"step {i}", metadata={"loss": 1.0 / (i + 1)})
    repo.wait()
    repo.store.put_chunk(os.urandom(5000), 1)  # what plain gc frees
    return repo


def assert_status_exact_without_measuring(repo: Repo, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = measurements(monkeypatch)
    doc = _status(repo.path)
    assert calls == [], "status measured again after gc"
    assert doc["storage_current"] is True
    calls.clear()
    kept = sizes.last_stats(repo._ctx)
    assert kept is not None and kept[3], "the kept figures are not current"
    fresh = repo.stats()  # measured now, from scratch
    assert kept[0] == fresh
    assert (doc["stored_bytes"], doc["commits"], doc["gc_would_free_bytes"]) == (
        fresh.stored_bytes,
        fresh.commits,
        fresh.unreferenced_bytes,
    )


@pytest.mark.parametrize("how", ["plain", "repack", "keep_last", "prune_now"])
def test_status_right_after_gc_is_exact_without_measuring(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    repo = history(tmp_path)
    if how == "prune_now":  # a reset leaves the newest commit to the reflog only
        repo.reset("HEAD~1")
    before = repo.stats()
    report = repo.gc(repack=how == "repack", keep_last=1 if how == "keep_last" else None, prune_now=how == "prune_now")
    assert report.deleted_objects >= 1
    assert_status_exact_without_measuring(repo, monkeypatch)
    after = repo.stats()
    assert after.unreferenced_bytes == 0 and after.stored_bytes == before.stored_bytes - report.freed_bytes


def test_status_right_after_repack_is_exact_without_measuring(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = history(tmp_path)
    repo.repack()
    assert_status_exact_without_measuring(repo, monkeypatch)


def test_a_change_after_gc_is_seen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = history(tmp_path)
    repo.gc()
    repo.store.put_chunk(os.urandom(6000), 1)  # right after: the same clock tick as gc's last change, or close
    monkeypatch.setattr(status_module, "MEASURE_SECONDS", 0.0)  # as if measuring took long
    calls = measurements(monkeypatch)
    doc = _status(repo.path)
    assert calls == [] and doc["storage_current"] is False and doc["gc_would_free_bytes"] == 0


def test_gc_waits_for_the_timestamps_to_move_on(tmp_path: Path) -> None:
    """The figures are keyed only once the newest change is older than the timestamps' tick."""
    repo = history(tmp_path, commits=1)
    started = time.time()
    key = sizes_cache.settled_key(repo._ctx)
    signature = repo.backend.state_signature(float("inf"))
    assert key is not None and signature is not None
    newest = max(m for _, m, _ in signature) / 1e9
    assert time.time() >= newest + sizes_cache.FINE_SETTLE_SECONDS
    assert time.time() - started < sizes_cache.SETTLE_SECONDS + 0.5
    assert key == sizes_cache.state_key(repo._ctx)
