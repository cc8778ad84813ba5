"""Settling the tip (compaction/tip.py): its chunks re-encoded whole, preempted by a newer commit,
and those a delta is based on deferred to the next compaction."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckstore import Repo
from ckstore.codecs.objects import Encoding
from ckstore.repository.store import ObjectStore
from tests.compaction.states import CHUNK, encoding_of, step_state, tensor_chunks


def test_a_newer_commit_preempts_settling_the_tip_and_its_compaction_settles_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Settling the tip stops at the first chunk after a newer commit has moved the branch: what it
    re-encoded stays, the store is not at rest, and the newer commit's compaction finishes it."""
    import ckstore.compaction.tip as tip

    repo = Repo.init(tmp_path / "repo", chunk_size=CHUNK)
    repo.compact_after_commit = False
    repo.commit_state(step_state(0))
    second = repo.commit_state(step_state(1))
    original = tip.recompress_whole
    calls: list[str] = []

    def newer_commit_arrives(store: object, oid: str, *args: object, **kwargs: object) -> int:
        calls.append(oid)
        if len(calls) == 1:
            repo.commit_state(step_state(2))  # moves the branch while the tip is being settled
        return original(store, oid, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(tip, "recompress_whole", newer_commit_arrives)
    report = repo.compact()
    assert not report.at_rest and len(calls) <= 2  # the chunks already under way, no more
    fast = {o for o in tensor_chunks(repo, second) if encoding_of(repo, o) in (Encoding.ZSTD, Encoding.RAW)}
    assert fast and not repo.status().at_rest
    monkeypatch.undo()
    assert repo.compact().at_rest and repo.status().at_rest
    assert all(repo.store.bases_of(o) != () or encoding_of(repo, o) == Encoding.GROUPED for o in fast)
    assert repo.fsck(read_data=True) == []


def _drifting_and_fresh(step: int) -> dict[str, torch.Tensor]:
    """A weight that drifts a little each step (its delta pays) beside one drawn afresh (it does not)."""
    return {**step_state(step), "fresh": torch.randn(64, 256, generator=torch.Generator().manual_seed(100 + step))}


def test_settling_first_only_what_stays_whole_leaves_the_delta_bases_to_the_next_compaction(tmp_path: Path) -> None:
    """The tip's chunks that the parent's deltas are based on are the ones the next compaction
    makes deltas: a deferred settle re-encodes every other chunk and leaves those (not at rest);
    the next commit's compaction makes them deltas without having to settle anything twice."""
    repo = Repo.init(tmp_path / "repo", chunk_size=CHUNK)
    repo.compact_after_commit = False
    repo.commit_state(_drifting_and_fresh(0))
    second = repo.commit_state(_drifting_and_fresh(1))
    from ckstore.compaction.compact import compact_branch

    report = compact_branch(repo._ctx, repo.head_branch, settle=True, defer_bases=True)
    assert not report.at_rest and not repo.status().at_rest
    commit = repo.read_commit(second)
    chunks = {t.name: [c.id for c in t.chunks] for f in commit.files for t in f.tensors}
    assert {encoding_of(repo, o) for o in chunks["w"]} <= {Encoding.ZSTD, Encoding.RAW}  # bases: left fast
    assert {encoding_of(repo, o) for o in chunks["fresh"]} == {Encoding.GROUPED}  # stays whole: settled
    staged: list[str] = []
    original = ObjectStore.stage_replace
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            ObjectStore,
            "stage_replace",
            lambda self, oid, data, **kw: (staged.append(oid), original(self, oid, data, **kw))[1],
        )
        repo.commit_state(_drifting_and_fresh(2))
        repo.compact()
    assert all(repo.store.bases_of(o) != () for o in chunks["w"])  # the next compaction's deltas
    assert not set(chunks["fresh"]) & set(staged)  # settled once, not again
    assert repo.status().at_rest
    assert all(torch.equal(repo.load_state(second)[k], v) for k, v in _drifting_and_fresh(1).items())
    assert repo.fsck(read_data=True) == []


def test_a_deferred_settle_then_a_full_one_brings_the_tip_to_rest(tmp_path: Path) -> None:
    from ckstore.compaction.compact import compact_branch

    repo = Repo.init(tmp_path / "repo", chunk_size=CHUNK)
    repo.compact_after_commit = False
    ids = [repo.commit_state(_drifting_and_fresh(s)) for s in range(2)]
    compact_branch(repo._ctx, repo.head_branch, settle=True, defer_bases=True)
    assert compact_branch(repo._ctx, repo.head_branch, settle=True).at_rest
    assert {encoding_of(repo, o) for o in tensor_chunks(repo, ids[-1])} == {Encoding.GROUPED}
    assert repo.fsck(read_data=True) == []
