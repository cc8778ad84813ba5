"""Compaction on the remote (remote/compaction.py): commits pushed whole, never compacted by any
machine, become what a local repository that compacted the same history holds (within 10%),
read lazily by a machine with an empty cache; every commit then clones bit-exact."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from ckstore.compaction.compact import compact_branch
from ckstore.remote.compaction import compact_remote, open_url
from ckstore.repo import Repo
from ckstore.repository.context import open_context
from tests.remote.epochs import CHUNK, adamw_fine_tune
from tests.remote.test_supersede import assert_every_commit_reads_back, remote_bytes


def whole_pushes(path: Path, url: str, endpoint: str | None) -> Repo:
    """A repository that never compacts, pushing each commit as it stored it (what a writer
    uploading its pieces straight to the remote leaves there)."""
    repo = Repo.init(path, chunk_size=CHUNK)
    repo.compact_after_commit = False
    repo.add_remote("origin", url, endpoint)
    return repo


def compacted_locally(path: Path, folders: list[Path]) -> Repo:
    """The same history in a local repository compacted after each commit (not settled: the
    newest commit's own chunks stay as committed, as the remote's do)."""
    repo = Repo.init(path, chunk_size=CHUNK)
    repo.compact_after_commit = False
    for folder in folders:
        repo.commit(folder)
        compact_branch(open_context(repo.path), "main")
    return repo


def test_compacting_the_remote_after_each_push_keeps_it_at_a_local_repository_size(
    tmp_path: Path, remote_url: tuple[str, str | None]
) -> None:
    url, endpoint = remote_url
    folders = adamw_fine_tune(tmp_path / "work", 3)
    a = whole_pushes(tmp_path / "a", url, endpoint)
    ids, reports = [], []
    for folder in folders:
        ids.append(a.commit(folder))
        a.push()
        # Another machine, holding nothing: it reads only what it compacts.
        reports.append(compact_remote(open_url(url, endpoint), ids[-1]))
    assert reports[0].parent is None and reports[0].sent_objects == 0
    for r in reports[1:]:
        assert r.deltas > 0 and r.deleted and r.read_bytes > 0
    local = compacted_locally(tmp_path / "local", folders).stats().stored_bytes
    whole = a.stats().stored_bytes
    assert remote_bytes(a) <= 1.1 * local < whole, (remote_bytes(a), local, whole)
    clone, _ = Repo.clone(url, tmp_path / "b", endpoint_url=endpoint)
    assert_every_commit_reads_back(clone, ids, folders, tmp_path / "out")


def _two_files(folder: Path, out: Path) -> Path:
    """An epoch's tensors split into two files, as two ranks of a DCP save write them."""
    (tensors,) = [load_file(str(p)) for p in folder.glob("*.safetensors")]
    names = sorted(tensors)
    out.mkdir(parents=True, exist_ok=True)
    for rank, part in enumerate((names[::2], names[1::2])):
        save_file({n: tensors[n].contiguous() for n in part}, str(out / f"rank-{rank}.safetensors"))
    return out


def test_each_writer_compacts_its_own_file_with_its_own_cache(tmp_path: Path) -> None:
    """Two "ranks" each compact only their file of every commit, each through a cache folder
    of its own: together the remote ends where one compaction of the whole commit leaves it."""
    url = str(tmp_path / "remote")
    folders = [_two_files(f, tmp_path / "ranks" / f.name) for f in adamw_fine_tune(tmp_path / "work", 3)]
    a = whole_pushes(tmp_path / "a", url, None)
    ids = []
    for folder in folders:
        ids.append(a.commit(folder))
        a.push()
        for rank in (0, 1):
            r = compact_remote(
                open_url(url), ids[-1], paths=[f"rank-{rank}.safetensors"], cache=tmp_path / f"cache{rank}"
            )
            assert len(ids) == 1 or r.deltas > 0
    local = compacted_locally(tmp_path / "local", folders).stats().stored_bytes
    assert remote_bytes(a) <= 1.1 * local, (remote_bytes(a), local)
    clone, _ = Repo.clone(url, tmp_path / "b")
    assert_every_commit_reads_back(clone, ids, folders, tmp_path / "out")
    # Each cache holds what its rank read, not the other's file.
    assert (tmp_path / "cache0").is_dir() and (tmp_path / "cache1").is_dir()


def _remote_step() -> int:
    """1 when the step being taken is a write to the remote (the scratch repository's own local
    writes are not what this test stops at)."""
    return int(sys._getframe(3).f_globals.get("__name__", "").startswith("ckstore.remote"))


class Interrupted(BaseException):
    """Raised by the step observer: the compaction stops there, as a crash would stop it."""


@pytest.mark.slow
def test_a_remote_compaction_stopped_at_each_step_leaves_every_commit_readable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped at each of its remote writes in turn (the new pack, its index, the claim, the old
    index, the old pack, the list settled): every commit still clones bit-exact, and running it
    again (a grace later, for what the stopped run left claimed or unindexed) brings the remote
    to a local repository's size."""
    from ckstore.backend import fsio

    grace = 0.3
    folders = adamw_fine_tune(tmp_path / "work", 2)
    template = tmp_path / "template"
    a = whole_pushes(template, str(tmp_path / "remote"), None)
    ids = []
    for folder in folders:
        ids.append(a.commit(folder))
        a.push()
    shutil.copytree(tmp_path / "remote", tmp_path / "remote-template")
    local = compacted_locally(tmp_path / "local", folders).stats().stored_bytes
    steps = [0]
    monkeypatch.setattr(fsio, "_observer", lambda: steps.__setitem__(0, steps[0] + _remote_step()))
    compact_remote(open_url(str(tmp_path / "remote")), ids[-1], grace=grace)
    total = steps[0]
    assert total >= 5
    for k in range(1, total + 1):
        shutil.rmtree(tmp_path / "remote")
        shutil.copytree(tmp_path / "remote-template", tmp_path / "remote")
        count = [0]

        def stop(at: int = k) -> None:
            count[0] += _remote_step()
            if count[0] == at and _remote_step():
                raise Interrupted

        monkeypatch.setattr(fsio, "_observer", stop)
        with pytest.raises(Interrupted):
            compact_remote(open_url(str(tmp_path / "remote")), ids[-1], grace=grace)
        monkeypatch.setattr(fsio, "_observer", None)
        clone, _ = Repo.clone(str(tmp_path / "remote"), tmp_path / f"c{k}")
        assert_every_commit_reads_back(clone, ids, folders, tmp_path / f"out{k}")
        time.sleep(2 * grace + 1.1)
        compact_remote(open_url(str(tmp_path / "remote")), ids[-1], grace=grace)
        # What that run condemned (rather than dropped) goes once a grace has passed since.
        time.sleep(grace + 0.2)
        compact_remote(open_url(str(tmp_path / "remote")), ids[-1], grace=grace)
        assert remote_bytes(a) <= 1.1 * local, k
        shutil.rmtree(tmp_path / f"c{k}")
