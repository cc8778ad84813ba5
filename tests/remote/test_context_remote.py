"""A repository holding context-sorted deltas (codec encoding 5) goes through a remote intact: push
sends each delta's base, a clone verifies and keeps them as they are and is upgraded to format 6
itself, lazy reads decode them, and remote gc keeps their bases."""

from __future__ import annotations

import json
from pathlib import Path

from ckstore.repo import Repo
from tests.helpers import adam_like_epochs, encodings, tree_digest


def _pushed(tmp_path: Path, url: str, endpoint: str | None) -> tuple[Repo, list[tuple[str, Path]]]:
    a = Repo.init(tmp_path / "a", chunk_size=65536)
    runs = []
    for folder in adam_like_epochs(tmp_path / "epochs", 3):
        runs.append((a.commit(folder), folder))
        a.wait()
    a.repack()  # writes context-sorted deltas (compaction does not)
    assert encodings(a).get("CONTEXT", 0) > 0
    a.add_remote("origin", url, endpoint_url=endpoint)
    a.push()
    return a, runs


def test_clone_keeps_context_deltas_and_reads_back(remote_url: tuple[str, str | None], tmp_path: Path) -> None:
    url, endpoint = remote_url
    a, runs = _pushed(tmp_path, url, endpoint)
    b, _ = Repo.clone(url, tmp_path / "b", endpoint_url=endpoint)
    assert encodings(b).get("CONTEXT") == encodings(a)["CONTEXT"]  # stayed context-sorted on the way
    assert json.loads((tmp_path / "b" / "config.json").read_text())["version"] == 6
    for i, (commit, folder) in enumerate(runs):
        b.checkout(commit, tmp_path / f"out{i}")
        assert tree_digest(tmp_path / f"out{i}") == tree_digest(folder)
    assert b.fsck(read_data=True) == []


def test_lazy_checkout_decodes_context_deltas_from_the_remote(tmp_path: Path) -> None:
    url = str(tmp_path / "remote")
    _, runs = _pushed(tmp_path, url, None)
    c = Repo.init(tmp_path / "c")
    c.add_remote("origin", url)
    c.use_remote("origin")
    oldest, folder = runs[0]
    c.checkout(oldest, tmp_path / "lazy")
    assert tree_digest(tmp_path / "lazy") == tree_digest(folder)
    assert c.fsck() == []
