"""The writers' lock discipline (ckstore/repository/writing.py): gc, in this repository or in a
base repository, never runs between a writer's first stored object and its ref update.

Each test is the review's deterministic reproduction (reliability-2026-11.md): the competing
operation is run at the exact moment the review found unsafe, in this process. Locks are
``flock`` locks on separate descriptors, so the in-process gc conflicts with the writer exactly
as another process's would; a short lock timeout turns "gc waits" into a LockedError the test
can see.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import ckstore.backend.base
import ckstore.write.commit
from ckstore.errors import LockedError
from ckstore.repo import Repo
from tests.helpers import save_st, tree_digest


@contextmanager
def short_lock_timeout(seconds: float = 0.3) -> Iterator[None]:
    saved = ckstore.backend.base.REPO_LOCK_TIMEOUT
    ckstore.backend.base.REPO_LOCK_TIMEOUT = seconds
    try:
        yield
    finally:
        ckstore.backend.base.REPO_LOCK_TIMEOUT = saved


def attempt(operation: Callable[[], Any]) -> str:
    """Run ``operation`` now, as a competing process would; "locked" when it had to wait."""
    with short_lock_timeout():
        try:
            operation()
        except LockedError:
            return "locked"
    return "ran"


def folder(root: Path, seed: int, n: int = 4096) -> Path:
    g = torch.Generator().manual_seed(seed)
    save_st(root / "model.safetensors", {"w": torch.randn(n, generator=g), "b": torch.randn(64, generator=g)})
    return root


def test_overlay_commit_pins_its_base_commit_against_base_gc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """F3: base gc run just before the overlay's ref update must not delete the base commit."""
    base = Repo.init(tmp_path / "base" / ".ckstore")
    e1 = base.commit([folder(tmp_path / "e1", 1)], message="epoch 1")
    base.commit([folder(tmp_path / "e2", 2)], message="epoch 2")
    tuned = folder(tmp_path / "tuned", 1)  # close to epoch 1: its chunks are deltas of epoch 1's
    g = torch.Generator().manual_seed(7)
    save_st(tuned / "model.safetensors", {"w": torch.randn(4096, generator=g), "b": torch.randn(64, generator=g)})
    overlay = Repo.init(tmp_path / "ft" / ".ckstore")
    outcomes: list[str] = []
    real_record = ckstore.write.commit.record_commit

    def gc_first(*args: Any, **kwargs: Any) -> str:
        outcomes.append(attempt(lambda: Repo(tmp_path / "base").gc(keep_last=1)))
        return real_record(*args, **kwargs)

    monkeypatch.setattr(ckstore.write.commit, "record_commit", gc_first)
    oid = overlay.commit([tuned], message="fine-tune", base=e1, base_repo=tmp_path / "base")
    monkeypatch.undo()
    # Once the overlay's ref has moved, base gc keeps what the overlay needs.
    Repo(tmp_path / "base").gc(keep_last=1)
    assert overlay.fsck() == []
    overlay.checkout(oid, tmp_path / "out")
    assert tree_digest(tmp_path / "out") == tree_digest(tuned)
    assert outcomes == ["locked"]  # base gc had to wait for the overlay commit


def _resuming_from_a_colleagues_remote(tmp_path: Path, state: dict[str, Any]) -> Repo:
    """A colleague commits ``state`` and pushes it to a folder remote; a new repository attaches
    that remote for lazy reads (``use_remote``, the README's resume path) and is returned."""
    colleague = Repo.init(tmp_path / "colleague" / ".ckstore")
    colleague.commit_state(state, message="epoch 1")
    colleague.add_remote("origin", str(tmp_path / "remote"))
    colleague.push()
    me = Repo.init(tmp_path / "me" / ".ckstore")
    me.add_remote("origin", str(tmp_path / "remote"))
    me.use_remote("origin")
    return me


def test_commits_after_use_remote_store_everything_they_name(tmp_path: Path) -> None:
    """F7: the README's resume path; the new commit must not lean on the remote's objects."""
    g = torch.Generator().manual_seed(3)
    state = {"model": {"w": torch.randn(4096, generator=g), "head": torch.randn(256, generator=g)}, "step": 100}
    me = _resuming_from_a_colleagues_remote(tmp_path, state)
    resumed = me.load_state("origin/main")
    resumed["model"]["head"] = resumed["model"]["head"] + 1  # train the head; "w" stays frozen
    resumed["step"] = 200
    oid = me.commit_state(resumed, message="head tuned")
    again = Repo(tmp_path / "me")  # no remote attached: only what this repository holds
    assert again.fsck(read_data=True) == []
    loaded = again.load_state(oid)
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])
    assert torch.equal(loaded["model"]["head"], state["model"]["head"] + 1)


def test_a_fetch_after_use_remote_lands_everything_its_refs_need(tmp_path: Path) -> None:
    """F7's family: with the remote attached for lazy reads, fetch must still land every object
    (the remote's objects are not this repository's), else its tracking refs name a commit whose
    objects live only on a remote that may delete them."""
    g = torch.Generator().manual_seed(5)
    state = {"model": {"w": torch.randn(8192, generator=g)}, "step": 1}
    me = _resuming_from_a_colleagues_remote(tmp_path, state)
    me.load_state("origin/main")  # some objects now sit in the lazy cache only
    me.fetch("origin")
    again = Repo(tmp_path / "me")  # no remote attached: only what this repository holds
    assert again.fsck(read_data=True) == []
    assert torch.equal(again.load_state("origin/main")["model"]["w"], state["model"]["w"])


def test_gc_cannot_run_between_a_fetch_landing_objects_and_moving_its_refs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """F2: gc run right after fetch landed its objects must not delete them."""
    import ckstore.remote.landing

    colleague = Repo.init(tmp_path / "colleague" / ".ckstore")
    theirs = colleague.commit([folder(tmp_path / "c1", 1)], message="theirs")
    colleague.add_remote("origin", str(tmp_path / "remote"))
    colleague.push()
    me = Repo.init(tmp_path / "me" / ".ckstore")
    me.commit([folder(tmp_path / "m1", 2)], message="mine")
    me.add_remote("origin", str(tmp_path / "remote"))
    outcomes: list[str] = []
    real_land_all = ckstore.remote.landing.Batches.land_all

    def land_then_gc(self: Any) -> None:
        real_land_all(self)
        outcomes.append(attempt(lambda: Repo(tmp_path / "me").gc()))

    monkeypatch.setattr(ckstore.remote.landing.Batches, "land_all", land_then_gc)
    me.fetch()
    monkeypatch.undo()
    again = Repo(tmp_path / "me")
    assert again.resolve("origin/main") == theirs
    assert again.fsck(read_data=True) == []
    again.checkout("origin/main", tmp_path / "out")
    assert tree_digest(tmp_path / "out") == tree_digest(tmp_path / "c1")
    assert outcomes == ["locked"]
