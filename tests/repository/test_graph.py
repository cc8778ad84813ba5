"""Revision syntax of the commit graph (``CommitGraph.resolve``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckstore.errors import InvalidInputError
from ckstore.repo import Repo


def test_revision_suffixes_and_what_is_wrong_with_a_bad_one(tmp_path: Path) -> None:
    repo = Repo.init(tmp_path / "r")
    folder = tmp_path / "f"
    folder.mkdir()
    ids = []
    for i in range(3):
        (folder / "m.txt").write_text(f"step {i}\n")
        ids.append(repo.commit(folder, message=f"step {i}"))
    assert repo.resolve("HEAD^1") == repo.resolve("HEAD^") == repo.resolve("HEAD~") == ids[1]
    assert repo.resolve("HEAD^1^1") == repo.resolve("main~2") == ids[0]
    with pytest.raises(InvalidInputError, match=r"'~' and '\^' take a number of commits"):
        repo.resolve("HEAD~abc")
    with pytest.raises(InvalidInputError, match="records no merges"):
        repo.resolve("HEAD^2")
    with pytest.raises(InvalidInputError, match="take a number"):
        repo.resolve("HEAD~1x")
