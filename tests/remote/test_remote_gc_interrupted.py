"""Remote gc stopped at any of its remote writes: what is left is a remote that clone, fetch,
push and the next gc all treat correctly (nothing present there that is not whole)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from ckstore.remote.gc import MTIME_RESOLUTION
from ckstore.remote.layout import GC_LOCK_KEY
from ckstore.repo import Repo
from ckstore.transport.directory import DirectoryTransport
from tests.remote.epochs import assert_checks_out, epoch_files

WRITES = ("put", "put_parts", "put_if_absent", "put_if_match", "delete")


class Stopped(BaseException):
    """The gc process ends here (as by SIGKILL): this write and every later one never happen."""


@contextmanager
def remote_writes(stop_at: int | None = None) -> Iterator[list[int]]:
    """Count the remote's writes (every put, conditional put and delete); from the ``stop_at``-th
    on, each raises Stopped instead (the gc lock's release excepted: a killed gc's lock is taken
    over by the next one, tested in test_remote_gc.py)."""
    seen = [0]
    originals: dict[str, Callable[..., Any]] = {name: getattr(DirectoryTransport, name) for name in WRITES}

    def wrap(name: str) -> Callable[..., Any]:
        def write(self: DirectoryTransport, key: str, *args: Any) -> Any:
            if not (name == "delete" and key == GC_LOCK_KEY):
                seen[0] += 1
                if stop_at is not None and seen[0] >= stop_at:
                    raise Stopped(key)
            return originals[name](self, key, *args)

        return write

    for name in WRITES:
        setattr(DirectoryTransport, name, wrap(name))
    try:
        yield seen
    finally:
        for name, original in originals.items():
            setattr(DirectoryTransport, name, original)


def collect(repo: Repo) -> None:
    """``gc --remote --keep-last 1 --grace 0`` twice: the first condemns, the second deletes."""
    for _ in range(2):
        repo.gc_remote(keep_last=1, grace=0)


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("remote-gc-kill")
    repo = Repo.init(root / "a", chunk_size=16 << 10)
    repo.add_remote("origin", str(root / "remote"))
    for e in range(1, 5):
        repo.commit(epoch_files(root / "work" / f"e{e}", e, n=16 << 10), message=f"epoch {e}")
        repo.push()
        repo.wait()  # compaction makes the pushed epoch a delta here: gc re-sends it smaller
    repo.create_branch("old", "main~3", force=True)
    time.sleep(MTIME_RESOLUTION + 0.1)  # every pack is older than a grace of 0
    return root


def fresh(template: Path, work: Path) -> Repo:
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(template, work)  # copy2: the packs keep their ages
    repo = Repo(work / "a")
    repo.remove_remote("origin")
    repo.add_remote("origin", str(work / "remote"))
    return repo


def assert_remote_whole(remote: Path, clone: Path, work: Path, refs: dict[str, int]) -> None:
    shutil.rmtree(clone, ignore_errors=True)
    b, _ = Repo.clone(str(remote), clone)
    assert b.fsck(read_data=True) == []
    for ref, epoch in refs.items():
        out = clone.parent / f"out-{ref}"
        shutil.rmtree(out, ignore_errors=True)
        assert_checks_out(b, f"origin/{ref}" if ref != "main" else "main", out, work / f"e{epoch}")


@pytest.mark.slow
def test_remote_gc_stopped_at_every_remote_write_leaves_a_remote_that_reads_back_whole(
    template: Path, tmp_path: Path
) -> None:
    """Two remote gc runs prune epochs 1-3 (each a delta of the next locally, so gc first re-sends
    them smaller); they are stopped before each of their remote writes in turn. After each stop:
    a clone is whole and checks out bit-exact; pushing epoch 1 again (a branch at a commit the
    remote pruned) and cloning reads it back bit-exact; the next two gc runs finish and the remote
    is still whole."""
    work = template / "work"
    repo = fresh(template, tmp_path / "count")
    with remote_writes() as seen:
        collect(repo)
    steps = seen[0]
    assert steps >= 5
    for k in range(1, steps + 1):
        w = tmp_path / "w"
        repo = fresh(template, w)
        with remote_writes(stop_at=k), pytest.raises(Stopped):
            collect(repo)
        repo = Repo(w / "a")  # as the next process finds it
        assert_remote_whole(w / "remote", w / "clone", work, {"main": 4})
        repo.push(refs=["old"])
        assert_remote_whole(w / "remote", w / "clone", work, {"main": 4, "old": 1})
        collect(repo)
        assert_remote_whole(w / "remote", w / "clone", work, {"main": 4, "old": 1})
