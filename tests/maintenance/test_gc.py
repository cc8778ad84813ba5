"""Garbage collection: what it deletes and keeps, dry runs, and gc racing concurrent commits."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckstore.errors import InvalidInputError, RefNotFoundError
from ckstore.repo import Repo
from tests.helpers import checkpoint, leftover_temp_files, object_count, object_file, sha256, tree_digest


def rolling(repo: Repo, tmp_path: Path, n: int = 3) -> list[tuple[str, Path]]:
    """``n`` rolling checkpoints on main: (commit id, the file it recorded)."""
    out = []
    for i in range(n):
        path = checkpoint(tmp_path / f"ep{i}" / "ckpt.safetensors", seed=i)
        out.append((repo.commit(path, message=f"epoch {i}"), path))
    return out


def test_plain_gc_removes_only_unreachable(repo: Repo, tmp_path: Path) -> None:
    ((c0, p0),) = rolling(repo, tmp_path, 1)
    repo.create_branch("exp")
    side = repo.commit(checkpoint(tmp_path / "side" / "ckpt.safetensors", seed=99), branch="exp")
    side_only = {c.id for c in repo.read_commit(side).all_chunks()} - {c.id for c in repo.read_commit(c0).all_chunks()}
    assert repo.gc().deleted_objects == 0  # everything is reachable
    repo.delete_branch("exp")
    before = set(repo.store.iter_ids())
    assert repo.gc().deleted_objects == 0  # the reflog still names exp's commit
    report = repo.gc(prune_now=True)
    after = set(repo.store.iter_ids())
    assert before - after == side_only | {side}
    assert report.deleted_objects == len(side_only) + 1 and report.pruned_commits == []
    assert report.unreachable_commits == [side]
    assert report.freed_bytes > 0
    assert repo.fsck(read_data=True) == []
    repo.checkout("main", tmp_path / "out")
    assert sha256(tmp_path / "out" / "ckpt.safetensors") == sha256(p0)


def test_keep_last_frees_disk_and_keeps_tags(repo: Repo, tmp_path: Path) -> None:
    commits = rolling(repo, tmp_path, 3)
    (c0, p0), (c1, _), (c2, p2) = commits
    repo.create_tag("first", c0)
    before = repo.stats()
    assert before.commits == 3
    report = repo.gc(keep_last=1)
    after = repo.stats()
    assert report.pruned_commits == [c1] and report.freed_bytes > 0
    assert after.commits == 2 and after.stored_bytes == before.stored_bytes - report.freed_bytes
    assert after.objects == before.objects - report.deleted_objects
    assert not repo.store.has(c1)
    log = repo.log()
    # History stays connected through the pruned commit to the older tagged one.
    assert [e.id for e in log] == [c2, c0] and log[0].pruned_parents == (c1,)
    with pytest.raises(RefNotFoundError, match="pruned"):
        repo.resolve("main~1")
    assert repo.fsck(read_data=True) == []
    for oid, path in ((c2, p2), (c0, p0)):
        out = tmp_path / f"out-{oid[:6]}"
        repo.checkout(oid, out)
        assert sha256(out / "ckpt.safetensors") == sha256(path)
    # History stays readable after further commits and gcs.
    c3 = repo.commit(checkpoint(tmp_path / "ep3" / "ckpt.safetensors", seed=3))
    repo.gc()
    assert [e.id for e in repo.log()] == [c3, c2, c0] and repo.log()[1].pruned_parents == (c1,)
    assert repo.fsck(read_data=True) == []


def test_dry_run_deletes_nothing_and_reports_the_same(repo: Repo, tmp_path: Path) -> None:
    rolling(repo, tmp_path, 3)
    objects = set(repo.store.iter_ids())
    dry = repo.gc(keep_last=1, dry_run=True)
    assert set(repo.store.iter_ids()) == objects and repo.stats().commits == 3
    assert repo.log()[0].pruned_parents == ()
    real = repo.gc(keep_last=1)
    assert (dry.pruned_commits, dry.deleted_objects, dry.freed_bytes) == (
        real.pruned_commits,
        real.deleted_objects,
        real.freed_bytes,
    )
    assert dry.deleted_objects > 0 and dry.dry_run and not real.dry_run


def test_gc_removes_temporary_leftovers(repo: Repo, tmp_path: Path) -> None:
    rolling(repo, tmp_path, 1)
    assert repo.path is not None
    (repo.path / "tmp").mkdir(exist_ok=True)
    (repo.path / "tmp" / "dead.tmp").write_bytes(b"partial")
    # A batch stages each object beside its final name; one killed midway leaves those behind.
    folder = next((repo.path / "objects").iterdir())
    (folder / ".5f3e.tmp").write_bytes(b"staged")
    count = object_count(repo)
    assert repo.gc().temp_files == 2
    assert object_count(repo) == count and not (repo.path / "tmp" / "dead.tmp").exists()
    assert not (folder / ".5f3e.tmp").exists()


def test_keep_last_must_be_positive(repo: Repo, tmp_path: Path) -> None:
    rolling(repo, tmp_path, 1)
    with pytest.raises(InvalidInputError):
        repo.gc(keep_last=0)


WRITER = """
import sys
import numpy as np
from safetensors.numpy import save_file
from ckstore.repo import Repo

repo, workdir, writer, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
r = Repo(repo)
for i in range(count):
    rng = np.random.default_rng(1000 * writer + i)
    path = f"{workdir}/w{writer}-{i}.safetensors"
    save_file({"w": rng.standard_normal(20_000).astype(np.float32), "shared": np.zeros(3000, np.float32)}, path)
    print(r.commit([path], message=f"w{writer} {i}"), path, flush=True)
"""


def test_concurrent_gc_and_commit(repo: Repo, tmp_path: Path) -> None:
    assert repo.path is not None
    work = tmp_path / "work"
    work.mkdir()
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(repo.path), str(work), str(w), "6"], stdout=subprocess.PIPE, text=True
        )
        for w in range(3)
    ]
    gcs = 0
    deadline = time.monotonic() + 120
    while any(w.poll() is None for w in writers) and time.monotonic() < deadline:
        repo.store.put_chunk(os.urandom(5000))  # garbage for each gc to find
        repo.gc()
        gcs += 1
    outputs = [w.communicate(timeout=60)[0] for w in writers]
    assert all(w.returncode == 0 for w in writers)
    recorded = [line.split() for out in outputs for line in out.splitlines()]
    assert len(recorded) == 18 and gcs >= 1
    repo.gc()
    history = {e.id for e in repo.log("main")}
    assert {oid for oid, _ in recorded} <= history  # no commit lost, whoever won each ref race
    assert repo.fsck(read_data=True) == []
    for oid, path in recorded:
        out = tmp_path / "out" / oid[:12]
        repo.checkout(oid, out)
        assert tree_digest(out) == {Path(path).name: sha256(Path(path))}


def test_remote_tracking_refs_are_gc_and_fsck_roots(tmp_path: Path) -> None:
    """F6: a colleague's commit that only refs/remotes/origin/main names survives gc (reflog
    expiry standing in for 90 days passing), and fsck walks it."""
    from dataclasses import replace

    colleague = Repo.init(tmp_path / "colleague" / ".ckstore")
    colleague.commit(checkpoint(tmp_path / "c" / "ckpt.safetensors", seed=5), message="theirs")
    colleague.add_remote("origin", str(tmp_path / "remote"))
    colleague.push()
    me = Repo.init(tmp_path / "me" / ".ckstore")
    ((mine, _),) = rolling(me, tmp_path, 1)
    me.set_config(replace(me.config, reflog_expire_days=0, reflog_expire_unreachable_days=0))
    me.add_remote("origin", str(tmp_path / "remote"))
    me.fetch()
    theirs = me.resolve("origin/main")
    for policy in ({}, {"keep_last": 1}):
        report = me.gc(**policy)
        assert report.deleted_objects == 0 and report.pruned_commits == []
        assert [e.id for e in me.log("origin/main")] == [theirs]
    me.checkout("origin/main", tmp_path / "out")
    assert tree_digest(tmp_path / "out") == tree_digest(tmp_path / "c")
    chunk = list(me.read_commit(theirs).all_chunks())[-1].id
    object_file(me, chunk).unlink()
    problems = me.fsck()
    assert any(chunk in p for p in problems), problems


def test_a_killed_commits_temporary_pack_is_counted_by_stats_and_gc(tmp_path: Path) -> None:
    """Newcomer item 6: the leftover of a commit killed while writing its pack shows in stats
    and gc --dry-run, and gc reports the bytes it frees by deleting it."""
    import json

    from click.testing import CliRunner

    from ckstore.cli import main

    repo = Repo.init(tmp_path / "repo")  # default chunks: the pack grows by 1 MiB per step
    rolling(repo, tmp_path, 1)
    big = checkpoint(tmp_path / "big" / "ckpt.safetensors", seed=9, n=1 << 18)
    fault_cli = Path(__file__).resolve().parents[1] / "fault_cli.py"
    assert repo.path is not None
    packs = repo.path / "objects" / "pack"
    for step in range(1, 40):  # until the kill leaves a pack with data in it
        env = {**os.environ, "CKSTORE_TEST_PACK_MIN_BYTES": "1", "CKSTORE_FAULT": f"kill@{step}"}
        killed = subprocess.run([sys.executable, str(fault_cli), "--repo", str(repo.path), "commit", str(big)], env=env)
        assert killed.returncode != 0
        if sum(p.stat().st_size for p in packs.glob(".*.tmp")) > 1 << 19:
            break
    else:
        pytest.fail("no step left a half-written pack")
    leftovers = leftover_temp_files(repo.path)  # what du sees beyond the repository's objects
    size = sum(p.stat().st_size for p in leftovers)

    def run(*args: str) -> dict:
        result = CliRunner().invoke(main, ["--repo", str(repo.path), *args, "--json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.output)

    stats = run("stats")
    n = len(leftovers)
    assert (stats["temporary_files"], stats["temporary_bytes"]) == (n, size)
    dry = run("gc", "--dry-run")
    assert (dry["temporary_files"], dry["temporary_bytes"], dry["freed_bytes"]) == (n, size, size)
    text = CliRunner().invoke(main, ["--repo", str(repo.path), "gc", "--dry-run"]).output
    assert f"would delete 0 commit(s), 0 object(s) and {n} temporary file(s)" in text
    assert all(p.exists() for p in leftovers)
    done = run("gc")
    assert (done["temporary_files"], done["temporary_bytes"], done["freed_bytes"]) == (n, size, size)
    assert not any(p.exists() for p in leftovers) and run("stats")["temporary_bytes"] == 0


def test_a_dry_run_never_waits_behind_a_compaction_and_gc_says_what_it_waits_for(
    repo: Repo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dry run is a plan under the shared lock: a running commit or compaction (which hold it
    shared) does not delay it. When gc must wait for the lock, it says for what."""
    import threading

    import ckstore.backend.base

    monkeypatch.setattr(ckstore.backend.base, "REPO_LOCK_TIMEOUT", 10.0)
    rolling(repo, tmp_path, 3)
    said: list[str] = []
    with repo.backend.shared_lock():  # what a compaction holds while it runs
        started = time.monotonic()
        dry = repo.gc(keep_last=1, dry_run=True, notify=said.append)
        assert time.monotonic() - started < 5 and said == [] and len(dry.pruned_commits) == 2

    def hold(exclusive: bool) -> threading.Thread:
        held = threading.Event()

        def run() -> None:
            with repo.backend.repo_lock(exclusive=exclusive, timeout=10):
                held.set()
                time.sleep(0.5)

        thread = threading.Thread(target=run)
        thread.start()
        held.wait()
        return thread

    thread = hold(exclusive=True)  # a gc or repack running
    assert repo.gc(keep_last=1, dry_run=True, notify=said.append).pruned_commits == dry.pruned_commits
    thread.join()
    assert said == ["waiting for a running gc or repack to finish"]
    said.clear()
    thread = hold(exclusive=False)  # a compaction running: the dry run's plan does not wait, gc does
    report = repo.gc(keep_last=1, notify=said.append)
    thread.join()
    assert said == ["waiting for running commits or a compaction to finish (they hold the repository lock)"]
    assert report.pruned_commits == dry.pruned_commits and report.freed_bytes == dry.freed_bytes


def test_a_commit_landing_between_the_plan_and_its_execution_is_kept(
    repo: Repo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gc plans under the shared lock and executes under the exclusive one: a commit that lands
    in between, deduplicating against chunks the plan meant to delete, keeps them (the plan is
    re-validated under the exclusive lock and made again)."""
    import ckstore.maintenance.gc as gc_module

    (c0, p0), _, _ = rolling(repo, tmp_path, 3)
    planned = gc_module.plan_gc
    landed: list[str] = []

    def plan_then_commit(*args: object, **kwargs: object) -> gc_module.GcPlan:
        plan = planned(*args, **kwargs)  # type: ignore[arg-type]
        assert c0 in plan.victims
        landed.append(repo.commit(p0, message="epoch 0 again", branch="again"))
        return plan

    monkeypatch.setattr(gc_module, "plan_gc", plan_then_commit)
    report = repo.gc(keep_last=1)
    assert landed and c0 in report.pruned_commits
    assert repo.fsck(read_data=True) == []
    repo.checkout("again", tmp_path / "out")
    assert sha256(tmp_path / "out" / "ckpt.safetensors") == sha256(p0)
