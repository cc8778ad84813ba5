"""log costs what it lists (issue 22, item 4): commit headers, not the file entries of big manifests."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from ckstore.cli import main
from ckstore.format import manifest_entries
from ckstore.repo import Repo


@pytest.fixture
def wide_history(tmp_path: Path) -> Path:
    repo = Repo.init(tmp_path / "repo")
    repo.compact_after_commit = False
    for epoch in range(3):
        folder = tmp_path / f"ep{epoch}"
        folder.mkdir()
        for i in range(40):
            (folder / f"part{i:03d}.txt").write_text(f"epoch {epoch} part {i}\n")
        repo.commit(folder, message=f"epoch {epoch}", metadata={"epoch": epoch})
    return tmp_path / "repo"


def parses_counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = manifest_entries._parse_file

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(manifest_entries, "_parse_file", counted)
    return calls


def test_log_and_its_walks_parse_no_file_entry(wide_history: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = parses_counted(monkeypatch)
    result = CliRunner().invoke(main, ["--repo", str(wide_history), "log", "-n", "2"])
    assert result.exit_code == 0, result.output
    assert "epoch 2" in result.output and "epoch 1" in result.output and "epoch 0" not in result.output
    repo = Repo(wide_history)
    assert [e.commit.decoded_metadata()["epoch"] for e in repo.log()] == [2, 1, 0]
    assert len(repo._ctx.graph.reachable_commits()) == 3  # gc, stats and fsck walk history this way
    assert calls == []


def test_what_reads_the_files_of_a_listed_commit_gets_them_all(
    wide_history: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = parses_counted(monkeypatch)
    repo = Repo(wide_history)
    listed = repo.log(limit=1)[0]
    assert calls == []
    assert [f.path for f in listed.commit.files] == [f"part{i:03d}.txt" for i in range(40)]
    assert len(calls) == 40
    assert repo.read_commit(listed.id) == listed.commit and len(calls) == 40  # parsed once, then cached
