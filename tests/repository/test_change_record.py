"""The change record (repository/change_record.py, format.md 5.2): compaction records each changed
tensor's relative change against the parent; diff and report take it from there without reading
a tensor, and fall back to computing it (and record that) when it is missing or wrong."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ckstore import Repo
from ckstore.history.magnitude import commit_stats, relative_l2
from ckstore.repository.change_record import record_key
from ckstore.repository.store import ObjectStore

CHUNK = 4096


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g) * 0.05
    drift = torch.randn(64, 256, generator=torch.Generator().manual_seed(step + 1)) * 1e-3
    return {
        "w": w + drift * step,
        "b": torch.randn(4096, generator=g) * (1 + step),
        "frozen": torch.randn(4096, generator=g),
    }


def _two_commits(repo: Repo) -> tuple[str, str]:
    first = repo.commit_state(_state(0))
    second = repo.commit_state(_state(1))
    repo.wait()
    return first, second


def _computed(repo: Repo, a: str, b: str) -> dict[str, float]:
    old, new = repo.read_commit(a), repo.read_commit(b)
    before = {t.name: t for f in old.files for t in f.tensors}
    out = {}
    for f in new.files:
        for t in f.tensors:
            if [c.id for c in t.chunks] != [c.id for c in before[t.name].chunks]:
                change = relative_l2(repo.store, before[t.name], t)
                assert change is not None
                out[t.name] = change
    return out


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    for name in ("get_chunk", "chunk_view"):
        original = getattr(ObjectStore, name)
        monkeypatch.setattr(
            ObjectStore, name, lambda self, oid, *a, _f=original, **k: (seen.append(oid), _f(self, oid, *a, **k))[1]
        )
    return seen


def _diff_changes(repo: Repo, a: str, b: str) -> dict[str, float]:
    return {c.name: c.rel_l2 for c in repo.diff(a, b) if c.status == "changed" and c.rel_l2 is not None}


def test_diff_and_report_take_the_change_from_the_record_without_reading_a_tensor(
    tmp_path: object, reads: list[str]
) -> None:
    repo = Repo.memory(chunk_size=CHUNK)
    first, second = _two_commits(repo)
    reads.clear()
    diffed = _diff_changes(repo, first, second)
    stats = commit_stats(repo.store, repo.read_commit(second), repo.read_commit(first), (second, first))
    assert reads == []
    expected = _computed(repo, first, second)
    assert set(expected) == {"w", "b"} and diffed == expected  # the same arithmetic, the same figures
    assert {k[1]: s.change for k, s in stats.items() if k[1] in expected} == expected
    assert stats[next(k for k in stats if k[1] == "frozen")].change == 0.0


@pytest.mark.parametrize("damage", ["missing", "garbage", "other pair", "wrong chunks", "negative"])
def test_a_missing_or_invalid_record_falls_back_to_computing_and_is_rewritten(damage: str, reads: list[str]) -> None:
    repo = Repo.memory(chunk_size=CHUNK)
    first, second = _two_commits(repo)
    third = repo.commit_state(_state(2))
    repo.wait()
    backend = repo.store.backend
    key = record_key(second, first)
    record = json.loads(backend.get(key))
    if damage == "missing":
        backend.delete(key)
    elif damage == "garbage":
        backend.replace(key, b"{not json")
    elif damage == "other pair":  # the next commit's record, put under this pair's name
        backend.replace(
            key,
            json.dumps(
                {**json.loads(backend.get(record_key(third, second))), "commit": second, "parent": first}
            ).encode(),
        )
    elif damage == "wrong chunks":
        for entry in record["tensors"]:
            entry["diff_sq"] *= 4
            entry["chunks"] = "0" * 32
        backend.replace(key, json.dumps(record).encode())
    else:
        for entry in record["tensors"]:
            entry["diff_sq"] = -1.0
        backend.replace(key, json.dumps(record).encode())
    reads.clear()
    diffed = _diff_changes(repo, first, second)
    assert reads  # computed from the tensors
    assert diffed == _computed(repo, first, second)
    reads.clear()
    assert _diff_changes(repo, first, second) == diffed and reads == []  # and recorded again


def test_the_record_covers_changed_tensors_at_the_same_path_only(tmp_path: Path) -> None:
    """Tensors the parent holds under another file name (files named per epoch) have no relative
    change (format.md 5.1): nothing is recorded for them; unchanged ones are 0 in the manifest."""
    repo = Repo.memory(chunk_size=CHUNK)
    first, second = _two_commits(repo)
    record = json.loads(repo.store.backend.get(record_key(second, first)))
    assert sorted(e["name"] for e in record["tensors"]) == ["b", "w"]
    assert all(math.isfinite(e["diff_sq"]) and e["base_sq"] > 0 for e in record["tensors"])
    ids = []
    for step in range(2):
        folder = tmp_path / f"epoch_{step}"
        folder.mkdir()
        save_file(_state(step), str(folder / f"model_epoch_{step}.safetensors"))
        ids.append(repo.commit(folder))
    repo.wait()
    with pytest.raises(KeyError):
        repo.store.backend.get(record_key(ids[1], ids[0]))


def test_gc_deletes_the_records_of_the_commits_it_deletes() -> None:
    repo = Repo.memory(chunk_size=CHUNK)
    first, second = _two_commits(repo)
    repo.create_branch("side", first)
    side = repo.commit_state(_state(5), branch="side")
    repo.wait()
    repo.diff(first, side)  # first's chunks are deltas (of second's) now: diff records what it computes
    backend = repo.store.backend
    assert backend.get(record_key(side, first))
    repo.delete_branch("side", force=True)
    repo.gc(prune_now=True)
    with pytest.raises(KeyError):
        backend.get(record_key(side, first))
    assert backend.get(record_key(second, first))  # a kept commit's stays


def test_a_small_position_is_recorded_not_re_encoded() -> None:
    """A tensor whose chunks are under 1/16 of the chunk size (a bias, a norm) is not re-encoded
    by compaction (a delta of it saves next to nothing, at the cost of a file), but its change
    is recorded as for any other tensor, with the figure diff computes."""
    repo = Repo.memory(chunk_size=CHUNK)
    states = [
        {"w": _state(step)["w"], "bias": torch.randn(32, generator=torch.Generator().manual_seed(step)) * (1 + step)}
        for step in range(2)
    ]
    first = repo.commit_state(states[0])
    stored = {c.id: repo.store.read_raw(c.id) for c in repo.read_commit(first).all_chunks()}
    second = repo.commit_state(states[1])
    repo.wait()
    old = {t.name: t for f in repo.read_commit(first).files for t in f.tensors}
    (bias_chunk,) = [c.id for c in old["bias"].chunks]
    assert repo.store.read_raw(bias_chunk) == stored[bias_chunk]  # left as committed
    assert any(repo.store.read_raw(c.id) != stored[c.id] for c in old["w"].chunks)  # re-encoded
    record = json.loads(repo.store.backend.get(record_key(second, first)))
    assert sorted(e["name"] for e in record["tensors"]) == ["bias", "w"]
    recorded = {e["name"]: math.sqrt(e["diff_sq"] / e["base_sq"]) for e in record["tensors"]}
    assert recorded["bias"] == pytest.approx(_computed(repo, first, second)["bias"], rel=1e-9)
