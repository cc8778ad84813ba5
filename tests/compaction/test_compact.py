"""Compaction after a commit (compact.py): the commit stores fast, the parent becomes deltas later."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from ckstore import Repo
from ckstore.cli import main
from ckstore.codecs.objects import Encoding
from ckstore.compaction.pairing import Roles
from ckstore.repository.store import ObjectStore, object_key
from ckstore.runtime.priority import BESIDE_TRAINING
from tests.compaction.states import CHUNK, commit_epochs, encoding_of, step_state, tensor_chunks
from tests.pagecache import cached_bytes, evict, needs_fadvise


def test_commit_stores_fast_and_compaction_makes_the_parent_deltas(tmp_path: Path) -> None:
    repo = Repo.init(tmp_path / "repo", chunk_size=CHUNK)
    repo.compact_after_commit = False  # look at the repository between commit and compaction
    first = repo.commit_state(step_state(0))
    second = repo.commit_state(step_state(1))
    # The commit itself only hashed, compressed with plain zstd and wrote.
    assert {encoding_of(repo, o) for o in tensor_chunks(repo, second)} <= {Encoding.ZSTD, Encoding.RAW}
    stored_before = repo.stats().stored_bytes
    report = repo.compact()
    assert report.deltas > 0 and report.recompressed > 0 and report.saved > 0
    assert repo.stats().stored_bytes == stored_before - report.saved
    # The parent's changed chunks are deltas of the tip's; the tip reads whole, and once no
    # newer commit has arrived its own chunks are in their best whole encoding too: at rest.
    assert any(repo.store.bases_of(o) != () for o in tensor_chunks(repo, first))
    assert all(repo.store.bases_of(o) == () for o in tensor_chunks(repo, second))
    assert {encoding_of(repo, o) for o in tensor_chunks(repo, second)} == {Encoding.GROUPED}
    assert report.at_rest and repo.status().at_rest
    for oid, step in ((first, 0), (second, 1)):
        loaded = repo.load_state(oid)
        assert all(torch.equal(loaded[k], v) for k, v in step_state(step).items())
    assert repo.fsck(read_data=True) == []
    assert repo.compact().saved == 0  # nothing left to do: a second run only reads headers


def test_every_commit_the_newest_included_ends_in_its_best_encoding_each_chunk_re_encoded_at_most_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over a run of epochs, each commit's chunks end as deltas or byte-grouped, the newest's too
    (nothing left as the fast commit stored it), and an object is replaced at most twice: settled
    whole while it is the tip, then made a delta by the next commit's compaction."""
    staged: list[str] = []
    original = ObjectStore.stage_replace
    monkeypatch.setattr(
        ObjectStore,
        "stage_replace",
        lambda self, oid, data, **kw: (staged.append(oid), original(self, oid, data, **kw))[1],
    )
    repo = Repo.init(tmp_path / "repo", chunk_size=CHUNK)
    ids = [repo.commit_state(step_state(s)) for s in range(4)]
    repo.wait_background()  # `ckstore wait`: the compactions, then the tip settled
    assert staged and max(staged.count(o) for o in staged) <= 2
    for commit in ids:
        for oid in tensor_chunks(repo, commit):
            assert repo.store.bases_of(oid) != () or encoding_of(repo, oid) == Encoding.GROUPED
    assert all(repo.store.bases_of(o) == () for o in tensor_chunks(repo, ids[-1]))
    assert repo.status().at_rest
    assert repo.fsck(read_data=True) == []


def test_repack_gives_the_newest_commit_its_best_whole_encoding_without_growing_the_store(tmp_path: Path) -> None:
    repo = Repo.init(tmp_path / "repo", chunk_size=CHUNK)
    repo.compact_after_commit = False  # nothing settles the commits but the repack
    ids = [repo.commit_state(step_state(s)) for s in range(3)]
    assert {Encoding.ZSTD, Encoding.RAW} & {encoding_of(repo, o) for o in tensor_chunks(repo, ids[-1])}
    assert not repo.status().at_rest
    report = repo.repack()
    assert report.stored_bytes_after < report.stored_bytes_before
    assert {encoding_of(repo, o) for o in tensor_chunks(repo, ids[-1])} == {Encoding.GROUPED}
    assert repo.status().at_rest
    for oid, step in zip(ids, range(3)):
        assert all(torch.equal(repo.load_state(oid)[k], v) for k, v in step_state(step).items())


def test_an_encoding_that_does_not_decode_to_the_chunk_is_never_staged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compaction checks each new encoding by decoding it and comparing with the chunk's verified
    bytes: a delta that decodes to other bytes (a flipped bit in a plane) is refused, and the
    parent keeps an encoding that reads back exactly."""
    import ckstore.compaction.encoding as encoding

    original = encoding.encode_delta

    def flipped(*args: object, **kwargs: object) -> bytes | None:
        data = original(*args, **kwargs)  # type: ignore[arg-type]
        return None if data is None else data[:-1] + bytes([data[-1] ^ 1])

    monkeypatch.setattr(encoding, "encode_delta", flipped)
    repo = Repo.init(tmp_path / "repo", chunk_size=CHUNK)
    repo.compact_after_commit = False
    first = repo.commit_state(step_state(0))
    repo.commit_state(step_state(1))
    assert repo.compact().deltas == 0
    assert all(repo.store.bases_of(o) == () for o in tensor_chunks(repo, first))
    assert all(torch.equal(repo.load_state(first)[k], v) for k, v in step_state(0).items())
    assert repo.fsck(read_data=True) == []


def test_background_compaction_runs_after_each_commit_and_wait_covers_it(tmp_path: Path) -> None:
    repo = Repo.init(tmp_path / "repo", chunk_size=CHUNK)
    ids = [repo.commit_state(step_state(s)) for s in range(3)]
    repo.wait()
    assert all(repo.store.bases_of(o) == () for o in tensor_chunks(repo, ids[-1]))
    for older in ids[:-1]:
        assert any(repo.store.bases_of(o) != () for o in tensor_chunks(repo, older))
    assert repo.fsck(read_data=True) == []


def test_a_compaction_that_never_ran_is_done_by_the_next_commits(tmp_path: Path) -> None:
    """A process killed before its compaction leaves its commit stored fast; the next commit's
    compaction also covers the pair below the tip."""
    repo = Repo.init(tmp_path / "repo", chunk_size=CHUNK)
    repo.compact_after_commit = False
    a = repo.commit_state(step_state(0))
    b = repo.commit_state(step_state(1))
    repo.compact_after_commit = True
    c = repo.commit_state(step_state(2))
    repo.wait()
    assert any(repo.store.bases_of(o) != () for o in tensor_chunks(repo, a))  # a -> b, done late
    assert any(repo.store.bases_of(o) != () for o in tensor_chunks(repo, b))  # b -> c
    assert all(repo.store.bases_of(o) == () for o in tensor_chunks(repo, c))
    assert repo.fsck(read_data=True) == []


def test_an_already_compacted_pair_is_a_no_op_that_reads_only_headers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same state saved again on a second branch: every chunk is stored and compacted
    already, so its compaction must not decode or re-read any object body."""
    repo = Repo.init(tmp_path / "repo", chunk_size=CHUNK)
    first = repo.commit_state(step_state(0))
    repo.commit_state(step_state(1))
    repo.wait_background()  # compacted and at rest
    repo.create_branch("again", first)
    repo.compact_after_commit = False
    repo.commit_state(step_state(1), branch="again")
    reads: list[str] = []
    for name in ("get_chunk", "read_local", "read_raw"):
        original = getattr(ObjectStore, name)
        monkeypatch.setattr(
            ObjectStore,
            name,
            lambda self, oid, *a, _f=original, _n=name, **k: (reads.append(_n), _f(self, oid, *a, **k))[1],
        )
    report = repo.compact("again")
    assert (report.deltas, report.recompressed, report.saved) == (0, 0, 0)
    assert reads == []
    monkeypatch.undo()
    assert all(torch.equal(repo.load_state("again")[k], v) for k, v in step_state(1).items())


def test_cli_commit_compacts_in_the_background_and_wait_waits_for_it(tmp_path: Path) -> None:
    """Epoch-named files, committed by the CLI: the command ends once the commit is durable, and
    the parent is compacted (in a detached process) when 'ckstore wait' returns (issue 22)."""
    commit_epochs(tmp_path / "repo", tmp_path, 2)
    assert CliRunner().invoke(main, ["--repo", str(tmp_path / "repo"), "wait"]).exit_code == 0
    repo = Repo(tmp_path / "repo")
    parent = repo.resolve("HEAD~1")
    assert any(repo.store.bases_of(o) != () for o in tensor_chunks(repo, parent))


def test_roles_never_let_a_base_become_a_delta_in_the_same_run() -> None:
    roles = Roles()
    assert roles.pair("p", "c")
    assert not roles.pair("c", "x")  # c is p's base now: it stays whole until the run ends
    assert not roles.pair("x", "p")  # p is a delta: nothing may use it as a base
    assert not roles.pair("p", "y")  # decided once
    assert roles.recompress("c") and not roles.recompress("c") and not roles.recompress("p")


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=3, max_size=3), min_size=2, max_size=7))
def test_any_history_of_permuted_and_reverted_tensors_stays_readable(steps: list[list[int]]) -> None:
    """Tensors swap values, revert to earlier ones and repeat across commits: compaction never
    forms a cycle or an overlong chain, and every commit reads back bit-exact."""
    base = np.random.default_rng(0).standard_normal(2048).astype(np.float32)
    # Close to each other, so deltas between any two of them pay; equal values dedup.
    pool = [
        base + np.float32(1e-4) * np.random.default_rng(i + 1).standard_normal(2048).astype(np.float32)
        for i in range(4)
    ]
    repo = Repo.memory(chunk_size=CHUNK, max_delta_depth=2)
    ids = []
    for choice in steps:
        state = {name: torch.from_numpy(pool[v].copy()) for name, v in zip(("x", "y", "z"), choice)}
        ids.append(repo.commit_state(state))
        repo.wait()
        assert all(repo.store.bases_of(o) == () for o in tensor_chunks(repo, ids[-1]))  # the tip reads whole
    for oid, choice in zip(ids, steps):
        loaded = repo.load_state(oid)
        for name, v in zip(("x", "y", "z"), choice):
            assert np.array_equal(loaded[name].numpy(), pool[v])
        assert max(repo.store.chain_depth(o) for o in tensor_chunks(repo, oid)) <= 2
    assert repo.fsck(read_data=True) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_compaction_runs_on_bounded_threads_at_lower_priority(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ckstore.compaction.compact as compact

    seen: list[tuple[int, int]] = []
    original = compact.compact_chunk

    def spy(*args: object, **kwargs: object) -> tuple[int, int, int, int]:
        tid = threading.get_native_id()
        seen.append((tid, os.getpriority(os.PRIO_PROCESS, tid)))
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(compact, "compact_chunk", spy)
    repo = Repo.init(tmp_path / "repo", chunk_size=CHUNK)
    repo.compact_after_commit = False
    repo.commit_state(step_state(0))
    repo.commit_state(step_state(1))
    assert repo.compact().deltas > 0
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert seen and all(prio == min(19, mine + BESIDE_TRAINING) for _, prio in seen)
    assert len({tid for tid, _ in seen}) <= compact.COMPACTION_WORKERS
    assert threading.get_native_id() not in {tid for tid, _ in seen}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # the caller's thread untouched


def _moment_state(step: int) -> dict[str, torch.Tensor]:
    """A drifting weight (a delta between steps pays) beside a first moment that is new noise at
    every step, as AdamW's exp_avg is 60 steps apart (no delta pays)."""
    state = step_state(step)
    state["exp_avg"] = torch.randn(64, 256, generator=torch.Generator().manual_seed(1000 + step)) * 1e-3
    return state


def test_a_position_where_a_delta_was_refused_is_not_decoded_and_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the last two runs found no delta paying at a position (the chunks there in the two
    commits below the parent settled whole), the next compaction does not try a delta of the
    parent's chunk again (neither as the tip's parent nor in the pair below), except the one chunk
    in REFUSED_RETRY_ONE_IN that is retried in case deltas begin to pay there: the parent's chunk
    is settled into its best whole encoding at once, and so is the tip's (an explicit compaction
    brings the branch to rest)."""
    import ckstore.compaction.encoding as encoding

    repo = Repo.init(tmp_path / "repo", chunk_size=CHUNK)
    for step in range(3):
        repo.commit_state(_moment_state(step))
        repo.wait()
    repo.compact_after_commit = False
    tip = repo.commit_state(_moment_state(3))
    commit = repo.read_commit(tip)
    parent = repo.read_commit(commit.parents[0])
    grandparent = repo.read_commit(parent.parents[0])

    def chunks(c: object, name: str) -> list[str]:
        return [ch.id for f in c.files for t in f.tensors if t.name == name for ch in t.chunks]  # type: ignore[attr-defined]

    refused = chunks(parent, "exp_avg")
    assert {encoding_of(repo, o) for o in chunks(grandparent, "exp_avg")} == {Encoding.GROUPED}  # refused, settled
    assert {encoding_of(repo, o) for o in refused} <= {Encoding.RAW, Encoding.ZSTD}  # the tip's until now: as committed
    tried: list[str] = []
    original = encoding._reverse_delta
    monkeypatch.setattr(
        encoding, "_reverse_delta", lambda store, oid, *a, **k: (tried.append(oid), original(store, oid, *a, **k))[1]
    )
    report = repo.compact()
    assert report.deltas > 0  # the weight's chunks still become deltas
    retried = [o for o in refused if encoding._retry_refused(o)]
    assert len(retried) < len(refused)
    assert [o for o in tried if o in refused] == retried
    below = chunks(grandparent, "exp_avg")
    assert [o for o in tried if o in below] == []  # the pair below: its own run finished it (finished_pairs.py)
    assert {encoding_of(repo, o) for o in refused} == {Encoding.GROUPED}  # still whole, no delta tried
    assert {encoding_of(repo, o) for o in chunks(commit, "exp_avg")} == {Encoding.GROUPED}
    assert all(torch.equal(repo.load_state(tip)[k], v) for k, v in _moment_state(3).items())
    assert repo.fsck(read_data=True) == []


def test_a_position_where_a_delta_paid_last_time_skips_the_sample_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """encode_delta's sample test (is a delta worth a full encode?) is skipped where the last run
    made a delta: it would pass, at a quarter of a full encode; the deltas made are the same."""
    import ckstore.compaction.encoding as encoding

    calls: list[bool] = []
    original = encoding.encode_delta
    monkeypatch.setattr(
        encoding, "encode_delta", lambda *a, **k: (calls.append(k.get("sample_test", True)), original(*a, **k))[1]
    )
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1 << 18, generator=g)
    states = [{"w": w + 1e-4 * torch.randn(1 << 18, generator=torch.Generator().manual_seed(s))} for s in range(3)]
    repo = Repo.memory(chunk_size=1 << 19)  # two chunks, each longer than EXHAUSTIVE_MAX
    repo.compact_after_commit = False
    ids = [repo.commit_state(states[0]), repo.commit_state(states[1])]
    assert repo.compact().deltas == 2 and calls == [True, True]  # nothing known yet: sample-tested
    calls.clear()
    ids.append(repo.commit_state(states[2]))
    assert repo.compact().deltas == 2 and calls == [False, False]
    for oid, state in zip(ids, states):
        assert torch.equal(repo.load_state(oid)["w"], state["w"])


def test_a_state_saved_again_on_the_same_branch_is_a_no_op_that_reads_only_headers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same state committed again (a re-saved checkpoint): its first compaction settles the
    tip's chunks that the commit left fast (they outlived a commit: step 2 of compact.py); saved
    once more, every chunk is compacted already, and compaction reads no object body."""
    repo = Repo.memory(chunk_size=CHUNK)
    for step in range(3):
        repo.commit_state(_moment_state(step))
        repo.wait()
    repo.commit_state(_moment_state(2), message="saved again")
    repo.wait()
    repo.compact_after_commit = False
    again = repo.commit_state(_moment_state(2), message="and again")
    reads: list[str] = []
    for name in ("get_chunk", "read_local", "read_raw"):
        original = getattr(ObjectStore, name)
        monkeypatch.setattr(
            ObjectStore,
            name,
            lambda self, oid, *a, _f=original, _n=name, **k: (reads.append(_n), _f(self, oid, *a, **k))[1],
        )
    report = repo.compact()
    assert (report.deltas, report.recompressed, report.saved) == (0, 0, 0)
    assert reads == []
    monkeypatch.undo()
    assert all(torch.equal(repo.load_state(again)[k], v) for k, v in _moment_state(2).items())


def test_a_pair_an_earlier_compaction_finished_is_not_visited_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each run covers the pair below the tip (for work a killed run left), but when the run that
    had it as its tip pair finished, nothing is left there: its positions are not visited again,
    and compacting the same tip twice visits nothing."""
    import ckstore.compaction.compact as compact

    repo = Repo.init(tmp_path / "repo", chunk_size=CHUNK)
    repo.compact_after_commit = False
    for step in range(2):
        repo.commit_state(step_state(step))
        repo.compact()
    repo.commit_state(step_state(2))
    visited: list[bool] = []
    original = compact.compact_chunk
    monkeypatch.setattr(
        compact, "compact_chunk", lambda store, job, *a: (visited.append(job.tip), original(store, job, *a))[1]
    )
    report = repo.compact()
    assert report.deltas > 0 and visited and all(visited)  # the tip pair only
    visited.clear()
    assert repo.compact().saved == 0 and visited == []
    monkeypatch.undo()
    for step, ref in enumerate(("HEAD~2", "HEAD~1", "HEAD")):
        assert all(torch.equal(repo.load_state(ref)[k], v) for k, v in step_state(step).items())
    assert repo.fsck(read_data=True) == []


def test_a_chunk_whose_best_encoding_is_raw_is_searched_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk that does not compress is stored raw by the fast commit, and its full search for a
    best whole encoding finds raw again: the run records that (cache/settled-raw), so neither a
    second branch saving the same state nor the next step on the same branch searches it again."""
    from dataclasses import replace

    import ckstore.compaction.encoding as encoding
    from ckstore.compaction.settled_raw import KEY, settled_raw
    from ckstore.format.ids import chunk_id

    noise = {
        "noise": torch.randint(
            -(2**31), 2**31 - 1, (8 * CHUNK // 4,), dtype=torch.int32, generator=torch.Generator().manual_seed(7)
        )
    }
    repo = Repo.init(tmp_path / "repo", chunk_size=CHUNK)
    repo.compact_after_commit = False
    first = repo.commit_state({**step_state(0), **noise})
    second = repo.commit_state({**step_state(1), **noise})
    searched: list[str] = []
    original = encoding.encode_chunk
    monkeypatch.setattr(
        encoding, "encode_chunk", lambda raw, *a, **k: (searched.append(chunk_id(raw)), original(raw, *a, **k))[1]
    )
    repo.compact()
    ids = [c.id for f in repo.read_commit(second).files for t in f.tensors if t.name == "noise" for c in t.chunks]
    assert len(ids) == 8 and set(ids) <= set(searched)  # searched once, found raw
    assert {encoding_of(repo, o) for o in ids} == {Encoding.RAW}
    searched.clear()
    repo.create_branch("other", first)
    other = repo.commit_state({**step_state(1), **noise}, branch="other")
    repo.compact("other")
    repo.commit_state({**step_state(2), **noise})
    repo.compact()
    assert [o for o in searched if o in ids] == []
    assert {encoding_of(repo, o) for o in ids} == {Encoding.RAW}
    assert torch.equal(repo.load_state(other)["noise"], noise["noise"])
    assert repo.fsck(read_data=True) == []
    # Recorded under the settings it was found with: at another zstd level the search is redone.
    assert len((tmp_path / "repo" / KEY).read_text().splitlines()) == 1 + len(ids)
    assert settled_raw(repo.backend, repo.store.settings) == set(ids)
    assert (
        settled_raw(repo.backend, replace(repo.store.settings, zstd_level=repo.store.settings.zstd_level + 1)) == set()
    )


def test_a_pair_stops_weighing_plain_deltas_that_keep_losing_to_predicted_ones() -> None:
    """At a predictor's positions the plain delta is weighed (on a sample) until it lost
    PLAIN_LOST_ENOUGH times and never won; then only one position in REFUSED_RETRY_ONE_IN (by
    name) weighs it. Once it won it is always weighed."""
    from ckstore.compaction.encoding import PLAIN_LOST_ENOUGH, PairMemory, _retry_refused

    ids = [f"{i:08x}" + "0" * 56 for i in range(64)]
    memory = PairMemory()
    for _ in range(PLAIN_LOST_ENOUGH):
        assert memory.weigh_plain(1, ids[1])
        memory.plain_weighed(1, won=False)
    assert [memory.weigh_plain(1, o) for o in ids] == [_retry_refused(o) for o in ids]
    assert 0 < sum(map(_retry_refused, ids)) < len(ids)
    assert memory.weigh_plain(2, ids[1])  # another predictor keeps its own count
    memory.plain_weighed(1, won=True)
    memory.plain_weighed(1, won=False)
    assert all(memory.weigh_plain(1, o) for o in ids)


@needs_fadvise
def test_compaction_leaves_the_tip_in_the_page_cache_and_keeps_the_parent_out(tmp_path: Path) -> None:
    """The parent's chunks, re-encoded as deltas, go to disk and out of the page cache: at 10 GB
    they evicted the tip's pack, which the next checkout then read back from disk."""
    repo = Repo.init(tmp_path / "repo")
    repo.compact_after_commit = False
    rng = np.random.default_rng(0)
    w = (rng.standard_normal(4 << 20) * 0.05).astype(np.float32)  # 16 MiB: the commits write packs
    first = repo.commit_state({"w": torch.from_numpy(w)})
    repo.commit_state({"w": torch.from_numpy(w + (1e-4 * rng.standard_normal(w.size)).astype(np.float32))})
    assert repo.path is not None
    (tip_pack,) = sorted((repo.path / "objects" / "pack").glob("*.pack"), key=lambda p: p.stat().st_mtime_ns)[-1:]
    if cached_bytes(tip_pack) < tip_pack.stat().st_size // 2:
        pytest.skip("this file system does not keep the file in the page cache")
    report = repo.compact()
    assert report.deltas == len(tensor_chunks(repo, first))
    parent_files = [repo.path / object_key(o) for o in tensor_chunks(repo, first)]
    assert all(p.exists() for p in parent_files)  # the deltas are loose files now
    assert sum(cached_bytes(p) for p in parent_files) == 0
    # Settled into loose files of their best whole encoding and evicted (the next run finds the
    # pair done and reads nothing of it), the tip is read back in the background (an advice the
    # kernel acts on later).
    tip_files = [repo.path / object_key(o) for o in tensor_chunks(repo, "HEAD")]
    assert all(p.exists() for p in tip_files)
    size = sum(p.stat().st_size for p in tip_files)
    for p in tip_files:
        evict(p)
    repo.compact()
    deadline = time.monotonic() + 10
    while sum(cached_bytes(p) for p in tip_files) < size * 9 // 10 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sum(cached_bytes(p) for p in tip_files) >= size * 9 // 10
    assert repo.fsck(read_data=True) == []


def test_a_compaction_opened_before_the_repository_was_created_again_stops_and_writes_nothing(tmp_path: Path) -> None:
    import shutil

    from ckstore.errors import RepoReplacedError

    old = Repo.init(tmp_path / "repo", chunk_size=CHUNK)
    old.compact_after_commit = False
    for step in range(2):
        old.commit_state(step_state(step))
    shutil.rmtree(tmp_path / "repo")  # deleted and created again at the same path, without deltas
    new = Repo.init(tmp_path / "repo", chunk_size=CHUNK, max_delta_depth=0)
    new.compact_after_commit = False
    for step in range(3):
        new.commit_state(step_state(step))
    with pytest.raises(RepoReplacedError, match="deleted and created again"):
        old.compact()
    assert all(new.store.bases_of(o) == () for o in new.store.iter_ids())
    with pytest.raises(RepoReplacedError):  # nor do the old settings reach the new repository
        old._ctx.set_config(old.config)
    assert new._ctx.read_config().max_delta_depth == 0
    assert new.compact().deltas == 0  # its own compaction follows its own settings
