"""gc stopped anywhere: a SIGKILL before any of its steps leaves a repository whose every present
object decodes and whose every present commit has its chunks, so a later commit that
deduplicates against what is left, and a later fetch that trusts what is left, both read back
bit-exact."""

from __future__ import annotations

import shutil
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from ckstore.backend.local import LocalBackend
from ckstore.repo import Repo
from tests.reliability.helpers import cli_env, run_cli, tree_digest

CHUNK = 32 << 10


def drifting_epoch(folder: Path, epoch: int, n: int = 24 << 10) -> Path:
    """Epoch ``epoch`` of a run whose weights drift a little each epoch: compaction stores the
    older epochs as reverse deltas, each against the next one."""
    rng = np.random.default_rng(1234)
    w = rng.standard_normal(n).astype(np.float32)
    for _ in range(epoch):
        w = w + (rng.standard_normal(n) * 1e-4).astype(np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({"model.w": w, "model.b": np.arange(64, dtype=np.float32) + epoch}, str(folder / "model.safetensors"))
    return folder


@dataclass
class History:
    root: Path
    repo: Path  # four epochs on main, compacted, remote "origin" configured
    epochs: list[Path]  # the files of each epoch, still on disk
    ids: list[str]


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> Iterator[History]:
    root = tmp_path_factory.mktemp("gc-kill")
    saved = LocalBackend.pack_min_bytes
    LocalBackend.pack_min_bytes = 0  # every commit writes a pack: kills land in pack rewrites too
    try:
        repo = Repo.init(root / "tmpl", chunk_size=CHUNK)
        epochs = [drifting_epoch(root / f"e{e}", e) for e in range(1, 5)]
        ids = [repo.commit(folder, message=f"e{i}") for i, folder in enumerate(epochs, start=1)]
        repo.wait()
        # A colleague's repository holds epoch 1 on a branch of a shared remote.
        shutil.copytree(root / "tmpl", root / "colleague")
        colleague = Repo(root / "colleague")
        colleague.create_branch("old", ids[0])
        colleague.add_remote("origin", str(root / "remote"))
        colleague.push(refs=["old"])
        repo.add_remote("origin", str(root / "remote"))
    finally:
        LocalBackend.pack_min_bytes = saved
    yield History(root, root / "tmpl", epochs, ids)


def deltas_among(repo: Repo, oids: list[str]) -> int:
    return sum(bool(repo.store.bases_of(o)) for o in oids)


GC = ("gc", "--keep-last", "1", "--prune-now")


def count_steps(history: History, work: Path) -> int:
    shutil.copytree(history.repo, work)
    counter = work.parent / "steps"
    proc = run_cli(*GC, repo=work, env=cli_env(CKSTORE_FAULT_COUNT=str(counter)))
    assert proc.returncode == 0, proc.stderr
    shutil.rmtree(work)
    return int(counter.read_text())


def assert_reads_back(repo: Repo, ref: str, folder: Path, out: Path) -> None:
    repo.checkout(ref, out)
    assert tree_digest(out) == tree_digest(folder)
    shutil.rmtree(out)


def assert_trustworthy(history: History, work: Path, scratch: Path, k: int) -> None:
    """What an interrupted gc must leave: fsck clean; epoch 1's files committed again read back
    bit-exact (they deduplicate against what is left); a fetch of a colleague's branch at epoch 1
    reads back bit-exact (it trusts the commits that are left); the next gc completes."""
    fetched = scratch / "fetched"
    shutil.rmtree(fetched, ignore_errors=True)
    shutil.copytree(work, fetched)
    repo = Repo(work)
    assert repo.fsck(read_data=True) == [], k
    repo.commit(history.epochs[0], message="e1 again", branch="again")
    repo.wait()
    assert_reads_back(repo, "again", history.epochs[0], scratch / "co")
    other = Repo(fetched)
    other.fetch("origin")
    assert_reads_back(other, "origin/old", history.epochs[0], scratch / "co")
    other.gc(keep_last=1, prune_now=True)
    assert other.fsck(read_data=True) == [], k
    assert_reads_back(other, "main", history.epochs[3], scratch / "co")


@pytest.mark.slow
def test_gc_killed_at_every_step_leaves_nothing_a_commit_or_fetch_can_trust_wrongly(
    history: History, tmp_path: Path
) -> None:
    """Pruning three delta-encoded epochs (each a delta of the next) is SIGKILLed before each
    of its steps in turn; after each kill the repository keeps every promise (assert_trustworthy)."""
    tmpl = Repo(history.repo)
    old_chunks = [c.id for c in tmpl.read_commit(history.ids[0]).all_chunks()]
    assert deltas_among(tmpl, old_chunks) >= 2  # the history gc deletes is delta-encoded
    steps = count_steps(history, tmp_path / "count")
    assert steps >= 10
    kills = 0
    for k in range(1, steps + 1):
        work = tmp_path / "work"
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(history.repo, work)
        proc = run_cli(*GC, repo=work, env=cli_env(CKSTORE_FAULT=f"kill@{k}"))
        if proc.returncode == 0:
            continue
        assert proc.returncode == -signal.SIGKILL, (k, proc.returncode, proc.stderr)
        kills += 1
        assert_trustworthy(history, work, tmp_path, k)
    assert kills >= steps * 0.8


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["eio", "enospc"])
def test_gc_failing_with_an_io_error_or_a_full_disk_at_any_step_leaves_a_trustworthy_repository(
    history: History, tmp_path: Path, fault: str
) -> None:
    """The same gc meets an I/O error or ENOSPC at one step (every third step in turn): it either
    finishes (a full disk during a pack rewrite leaves those objects for the next gc) or ends with
    one line and exit 7; either way the repository keeps every promise."""
    steps = count_steps(history, tmp_path / "count")
    for k in range(1, steps + 1, 3):
        work = tmp_path / "work"
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(history.repo, work)
        proc = run_cli(*GC, repo=work, env=cli_env(CKSTORE_FAULT=f"{fault}@{k}"))
        assert proc.returncode in (0, 7), (k, proc.returncode, proc.stderr)
        assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) <= 1, proc.stderr
        assert_trustworthy(history, work, tmp_path, k)
