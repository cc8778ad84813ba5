"""`ckstore status` costs what it shows (issue 22 item 4): the storage figures of the last
measurement while the repository is unchanged, its own measurement only when that is quick, and
ahead/behind counted along the commits between a branch and its tracking ref."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckstore.cli import main
from ckstore.maintenance import sizes
from ckstore.repo import Repo
from ckstore.report import status as status_module


def _status(repo: Path, *extra: str) -> str:
    result = CliRunner().invoke(main, ["--repo", str(repo), "status", *extra], prog_name="ckstore")
    assert result.exit_code == 0, result.output
    return result.stdout


def measurements(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = sizes._measure

    def counted(ctx):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(ctx)

    monkeypatch.setattr(sizes, "_measure", counted)
    return calls


def settled_repo(tmp_path: Path, commits: int = 2) -> Repo:
    repo = Repo.init(tmp_path / "r")
    folder = tmp_path / "f"
    folder.mkdir()
    for i in range(commits):
        (folder / "m.txt").write_text(f"step {i}\n")
        repo.commit(folder, message=f"step {i}")
    repo.wait()
    time.sleep(1.1)  # the figures are kept only for a repository that had settled (racy mtimes)
    return repo


def test_status_shows_the_last_measurement_without_measuring_while_nothing_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = settled_repo(tmp_path)
    figures = repo.stats()
    calls = measurements(monkeypatch)
    doc = json.loads(_status(repo.path, "--json"))
    assert calls == []
    assert (doc["stored_bytes"], doc["commits"], doc["gc_would_free_bytes"]) == (
        figures.stored_bytes,
        2,
        figures.unreferenced_bytes,
    )
    assert doc["storage_current"] is True
    assert "as of" not in _status(repo.path)


def test_a_change_since_is_measured_again_or_shown_as_of_its_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = settled_repo(tmp_path)
    before = repo.stats()
    repo.store.put_chunk(os.urandom(5000), 1)  # an object no commit names: what gc would free grows
    calls = measurements(monkeypatch)
    doc = json.loads(_status(repo.path, "--json"))  # the last measurement was quick: measured again
    assert calls == [1] and doc["storage_current"] is True and doc["gc_would_free_bytes"] > 5000
    time.sleep(1.1)
    repo.stats()
    repo.store.put_chunk(os.urandom(6000), 1)
    monkeypatch.setattr(status_module, "MEASURE_SECONDS", 0.0)  # as if measuring took long (10^5 objects)
    calls.clear()
    doc = json.loads(_status(repo.path, "--json"))
    assert calls == [] and doc["storage_current"] is False
    assert 5000 < doc["gc_would_free_bytes"] < 11000  # the figure measured before the 6000 bytes
    text = _status(repo.path)
    assert " as of " in text and "(changed since: `ckstore stats` measures it again)" in text
    assert before.unreferenced_bytes == 0


def test_damaged_cache_is_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = settled_repo(tmp_path)
    figures = repo.stats()
    (repo.path / "cache" / "sizes.json").write_text('{"ckstore": "sizes cache", "version": 1, "stats": []}')
    calls = measurements(monkeypatch)
    doc = json.loads(_status(repo.path, "--json"))
    assert calls == [1] and doc["stored_bytes"] == figures.stored_bytes


def test_ahead_and_behind_walk_only_the_commits_between(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = settled_repo(tmp_path, commits=5)
    repo.add_remote("origin", str(tmp_path / "remote"))
    repo.push()
    folder = tmp_path / "f"
    for i in range(2):
        (folder / "m.txt").write_text(f"later {i}\n")
        repo.commit(folder, message=f"later {i}")
    repo.wait()

    def whole_history(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("ahead/behind walked the whole history")

    monkeypatch.setattr(type(repo._ctx.graph), "reachable_from", whole_history)
    monkeypatch.setattr(sizes, "_measure", lambda ctx: Repo(repo.path).stats())  # not what this test counts
    monkeypatch.setattr(status_module.sizes, "stats", lambda ctx: sizes.Stats(0, 0, 0, 0))
    doc = json.loads(_status(repo.path, "--json"))
    assert doc["remotes"][0]["branches"][0]["ahead"] == 2 and doc["remotes"][0]["branches"][0]["behind"] == 0


def test_status_counts_the_commits_made_since_the_last_measurement(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = settled_repo(tmp_path)
    repo.stats()  # measured with 2 commits
    (tmp_path / "f" / "m.txt").write_text("step 2, a longer line than before\n")
    repo.commit(tmp_path / "f", message="step 2")
    repo.wait()
    monkeypatch.setattr(status_module, "MEASURE_SECONDS", 0.0)  # as if measuring took long
    calls = measurements(monkeypatch)
    doc = json.loads(_status(repo.path, "--json"))
    assert calls == [] and doc["storage_current"] is False
    assert doc["commits"] == 3 and doc["logical_bytes"] == repo.stats().logical_bytes
    line = next(x for x in _status(repo.path).splitlines() if x.startswith("storage:"))
    assert line.startswith("storage: 3 commit(s),") and "stored and plain gc would free" in line
