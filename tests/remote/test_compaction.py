"""Compaction on the remote (remote/compaction.py): commits pushed whole, never compacted by any
machine, become what a local repository that compacted the same history holds (within 10%),
read lazily by a machine with an empty cache; every commit then clones bit-exact."""

from __future__ import annotations

from pathlib import Path

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
