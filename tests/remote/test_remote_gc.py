"""Remote gc (two-phase, with a grace period) and lazy reads from a remote, against the real S3
server and a folder remote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ckstore.backend.fsio import process_owner
from ckstore.errors import IntegrityError, LockedError, NotFoundError
from ckstore.remote.gc import MTIME_RESOLUTION
from ckstore.remote.layout import GC_LOCK_KEY, PACKS
from ckstore.remote.names import open_remote
from ckstore.repo import Repo
from ckstore.repository.context import open_context
from tests.remote.epochs import assert_checks_out, digests, epoch_files, make_repo, pushed

GRACE = 0.5


def packs(repo: Repo) -> set[str]:
    return open_remote(open_context(repo.path)).pack_ids()


def test_unreferenced_packs_go_only_after_the_grace_period(tmp_path: Path, remote_url: tuple[str, str | None]) -> None:
    url, endpoint = remote_url
    a, ids = pushed(tmp_path, url, endpoint, range(1, 3))
    kept = packs(a)
    a.create_branch("exp", ids[0])
    a.switch("exp")
    a.commit(epoch_files(tmp_path / "work" / "x", 99), message="experiment")
    a.push(refs=["exp"])
    doomed = packs(a) - kept
    assert doomed
    remote = open_remote(open_context(a.path))
    remote.delete_ref("refs/heads/exp")
    first = a.gc_remote(grace=GRACE)  # too young to condemn
    assert first.condemned == [] and first.deleted == []
    time.sleep(GRACE + MTIME_RESOLUTION + 0.1)
    second = a.gc_remote(grace=GRACE)
    assert set(second.condemned) == doomed and second.deleted == [] and packs(a) == kept | doomed
    assert a.gc_remote(grace=GRACE).deleted == []  # condemned, but not yet for the grace period
    time.sleep(GRACE + 0.1)
    third = a.gc_remote(grace=GRACE)
    assert set(third.deleted) == doomed and third.freed_bytes > 0
    assert packs(a) == kept
    b, _ = Repo.clone(url, tmp_path / "b", endpoint_url=endpoint)
    assert b.fsck(read_data=True) == [] and b.resolve("main") == ids[-1]


def test_a_push_rescues_a_condemned_pack_it_relies_on(tmp_path: Path, remote_url: tuple[str, str | None]) -> None:
    url, endpoint = remote_url
    a, ids = pushed(tmp_path, url, endpoint)
    remote = open_remote(open_context(a.path))
    remote.delete_ref("refs/heads/main")
    time.sleep(GRACE + MTIME_RESOLUTION + 0.1)
    condemned = a.gc_remote(grace=GRACE).condemned
    assert set(condemned) == packs(a)
    report = a.push()  # every object is there, in a condemned pack: rescued, nothing sent
    assert report.objects == 0
    assert remote.read_condemned().packs == {}
    time.sleep(GRACE + 0.1)
    assert a.gc_remote(grace=GRACE).deleted == []
    b, _ = Repo.clone(url, tmp_path / "b", endpoint_url=endpoint)
    assert b.fsck(read_data=True) == [] and b.resolve("main") == ids[0]


def test_retention_on_the_remote(tmp_path: Path, remote_url: tuple[str, str | None]) -> None:
    url, endpoint = remote_url
    a = Repo.init(tmp_path / "a", chunk_size=64 << 10)
    a.add_remote("origin", url, endpoint)
    ids = []
    for e in range(1, 4):
        ids.append(a.commit(epoch_files(tmp_path / "work" / f"e{e}", e), message=f"epoch {e}"))
        a.push()
    before = packs(a)
    time.sleep(MTIME_RESOLUTION + 0.1)
    first = a.gc_remote(keep_last=1, grace=0)
    assert first.pruned_commits == sorted(ids[:2])
    second = a.gc_remote(keep_last=1, grace=0)
    # epoch 2's pack held nothing epoch 3 needs (a resent pack of superseded objects may appear)
    assert second.deleted and set(second.deleted) <= before and not set(second.deleted) & packs(a)
    assert a.push().objects == 0  # pruned on the remote: not sent again
    b, _ = Repo.clone(url, tmp_path / "b", endpoint_url=endpoint)
    assert b.fsck(read_data=True) == [] and [e.id for e in b.log()] == [ids[2]]
    assert_checks_out(b, "main", tmp_path / "out", tmp_path / "work" / "e3")


def test_remote_keep_best_by_a_metric_no_commit_records_is_refused(
    tmp_path: Path, remote_url: tuple[str, str | None]
) -> None:
    """A misspelt metric ranks nothing: remote gc refuses, naming the recorded metrics, and
    neither condemns nor records anything."""
    url, endpoint = remote_url
    a = Repo.init(tmp_path / "a", chunk_size=64 << 10)
    a.add_remote("origin", url, endpoint)
    for e in range(1, 3):
        a.commit(epoch_files(tmp_path / "work" / f"e{e}", e), message=f"epoch {e}", metadata={"val_loss": 1.0 / e})
        a.push()
    remote = open_remote(open_context(a.path), "origin")
    condemned_by_pushes = remote.read_condemned().packs  # push's own supersession, before the gc
    with pytest.raises(NotFoundError, match="'val-loss'.*recorded: val_loss"):
        a.gc_remote(keep_best=1, metric="val-loss", grace=0)
    assert remote.read_pruned() == {} and remote.read_condemned().packs == condemned_by_pushes


def test_one_remote_gc_at_a_time(tmp_path: Path, remote_url: tuple[str, str | None]) -> None:
    url, endpoint = remote_url
    a, _ = pushed(tmp_path, url, endpoint)
    open_remote(open_context(a.path)).transport.put_if_absent(GC_LOCK_KEY, b'{"host": "h", "pid": 1, "time": 0}')
    with pytest.raises(LockedError, match="another remote gc is running"):
        a.gc_remote()


def test_gc_lock_of_a_killed_gc_is_taken_over(tmp_path: Path, remote_url: tuple[str, str | None]) -> None:
    """A remote gc killed on this machine leaves gc/lock.json; the next gc proves its process
    gone and takes the lock over, instead of refusing until a user deletes it (the soak: 276
    refusals after a few killed gcs). A live gc's lock is still respected."""
    url, endpoint = remote_url
    a, _ = pushed(tmp_path, url, endpoint)
    transport = open_remote(open_context(a.path)).transport
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    transport.put_if_absent(GC_LOCK_KEY, json.dumps({**process_owner(), "pid": dead.pid}).encode())
    a.gc_remote()
    assert transport.head(GC_LOCK_KEY) is None  # released at the end like its own
    transport.put_if_absent(GC_LOCK_KEY, json.dumps({**process_owner(), "pid": os.getpid()}).encode())
    with pytest.raises(LockedError, match="another remote gc is running"):
        a.gc_remote()


def test_gc_concurrent_with_pushes_deletes_nothing_needed(tmp_path: Path, remote_url: tuple[str, str | None]) -> None:
    """Pushes of new epochs and of branches that reuse old objects, while gc runs in a loop with a
    short grace period and branches come and go; afterwards every ref's commit is whole."""
    url, endpoint = remote_url
    a, ids = pushed(tmp_path, url, endpoint)
    grace = 1.0
    stop = threading.Event()
    errors: list[BaseException] = []

    def collect() -> None:
        gcer = Repo(tmp_path / "a")
        while not stop.is_set():
            try:
                gcer.gc_remote(grace=grace)
            except LockedError:
                pass
            except BaseException as exc:  # noqa: BLE001  (reported by the main thread)
                errors.append(exc)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=collect)
    thread.start()
    remote = open_remote(open_context(a.path))
    try:
        for e in range(2, 6):
            a.commit(epoch_files(tmp_path / "work" / f"e{e}", e), message=f"epoch {e}")
            a.push(grace=grace)
            # A short-lived branch, then a new one at an old commit (its packs may be condemned).
            a.create_branch(f"b{e}", ids[0])
            a.push(refs=[f"b{e}"], grace=grace)
            remote.delete_ref(f"refs/heads/b{e}")
            time.sleep(grace * 0.6)
            a.push(refs=[f"b{e}"], grace=grace)
    finally:
        stop.set()
        thread.join()
    assert errors == []
    for _ in range(2):
        time.sleep(grace + 0.1)
        a.gc_remote(grace=grace)
    b, _ = Repo.clone(url, tmp_path / "b", endpoint_url=endpoint)
    assert b.fsck(read_data=True) == []
    assert set(b.branches()) == {"main", "b2", "b3", "b4", "b5"}


def test_lazy_checkout_reads_only_the_chunks_it_needs(tmp_path: Path, remote_url: tuple[str, str | None]) -> None:
    url, endpoint = remote_url
    a, ids = pushed(tmp_path, url, endpoint)
    commit = a.read_commit(ids[0])
    model = {c.id for f in commit.files for t in f.tensors if t.name.startswith("model.") for c in t.chunks}
    model_bytes = sum(a.store.stored_size(c) or 0 for c in model)
    c = Repo.init(tmp_path / "c")
    c.add_remote("origin", url, endpoint)
    lazy = c.use_remote("origin")
    out = tmp_path / "weights"
    c.checkout("origin/main", out, only=["model.*"])
    assert lazy.fetched_bytes <= 1.1 * model_bytes
    assert lazy.fetched_objects <= len(model) + 4  # + the commit, the header chunks
    with c.open("main", path="model.safetensors") as tensors:
        assert set(tensors.keys()) == {"model.embed", "model.w", "optim.m"}
    full = tmp_path / "full"
    again = Repo(tmp_path / "c")
    again.use_remote("origin")
    again.checkout("main", full)
    assert digests(full) == digests(tmp_path / "work" / "e1")
    assert again.fsck() == [] and again.branches() == {}  # nothing lazily read is in the repository


def test_lazy_read_of_a_damaged_pack_is_named_and_not_cached(
    tmp_path: Path, remote_url: tuple[str, str | None], request: pytest.FixtureRequest
) -> None:
    url, endpoint = remote_url
    a, _ = pushed(tmp_path, url, endpoint)
    remote = open_remote(open_context(a.path))
    (key,) = [i.key for i in remote.transport.list(PACKS)]
    good = remote.transport.get(key)
    middle = len(good) // 2
    remote.transport.put(key, good[:middle] + bytes([good[middle] ^ 1]) + good[middle + 1 :])
    c = Repo.init(tmp_path / "c")
    c.add_remote("origin", url, endpoint)
    c.use_remote("origin")
    with pytest.raises(IntegrityError, match=key.split("/")[-1][:16]):
        c.checkout("main", tmp_path / "out")
    remote.transport.put(key, good)  # repaired: the damaged copy was not cached
    again = Repo(tmp_path / "c")
    again.use_remote("origin")
    again.checkout("main", tmp_path / "out2")
    assert digests(tmp_path / "out2") == digests(tmp_path / "work" / "e1")


def test_a_history_pruned_locally_is_pushed_as_pruned(tmp_path: Path, remote_url: tuple[str, str | None]) -> None:
    url, endpoint = remote_url
    a, ids = make_repo(tmp_path / "a", tmp_path / "work", range(1, 4))
    a.gc(keep_last=1, prune_now=True)
    a.add_remote("origin", url, endpoint)
    a.push()
    assert set(open_remote(open_context(a.path)).read_pruned()) == set(ids[:2])
    assert a.gc_remote(dry_run=True).live_objects > 0  # the remote's graph walks through them
    b, _ = Repo.clone(url, tmp_path / "b", endpoint_url=endpoint)
    assert b.fsck(read_data=True) == [] and [e.id for e in b.log()] == [ids[2]]


def test_lazy_load_state_reads_only_the_selected_tensors(tmp_path: Path, remote_url: tuple[str, str | None]) -> None:
    import torch

    url, endpoint = remote_url
    a = Repo.init(tmp_path / "a", chunk_size=64 << 10)
    g = torch.Generator().manual_seed(0)
    state = {
        "model": {"w": torch.randn(1 << 18, generator=g)},
        "optim": {"m": torch.randn(1 << 19, generator=g)},
        "epoch": 3,
    }
    a.commit_state(state, message="epoch 3")
    a.add_remote("origin", url, endpoint)
    a.push()
    c = Repo.init(tmp_path / "c")
    c.add_remote("origin", url, endpoint)
    lazy = c.use_remote("origin")
    got = c.load_state("origin/main", only="model.*")
    assert torch.equal(got["model"]["w"], state["model"]["w"])
    assert "m" not in got.get("optim", {})
    # The model is 1 MiB of float32; the optimizer state (2 MiB) never moves.
    assert lazy.fetched_bytes < 1.5 * (1 << 20)
