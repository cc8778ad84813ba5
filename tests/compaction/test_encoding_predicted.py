"""Predicted deltas in a repository: consecutive AdamW steps saved through DCP are compacted into
predicted deltas (codec encoding 4) that read back bit-exact, survive gc, pass fsck, and whose
damaged bases are found and named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ckstore.codecs import objects as codec
from ckstore.codecs.objects import Encoding, delta_bases, parse_header
from ckstore.compaction import pairing
from ckstore.errors import IntegrityError, UnsupportedFormatError
from ckstore.format import settings as config
from ckstore.repo import Repo
from ckstore.repository.store import object_key
from tests.helpers import assert_reads_back, dcp_adamw_run, encodings, flip_bit

CHUNK = 16384  # a 192 x 192 float32 weight is 9 chunks: siblings pair by chunk index


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[tuple[str, dict[str, torch.Tensor]]]]:
    path = tmp_path_factory.mktemp("adamw") / "repo"
    repo = Repo.init(path, chunk_size=CHUNK)
    return path, dcp_adamw_run(repo, 5)


def _predicted(repo: Repo) -> list[str]:
    return [o for o in repo.store.iter_ids() if parse_header(repo.store.read_raw(o)).encoding == Encoding.PREDICTED]


def _commit_chunks(repo: Repo, commit: str) -> set[str]:
    return {c.id for c in repo.read_commit(commit).all_chunks()}


def test_consecutive_steps_become_predicted_deltas_and_read_back(trained, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path, runs = trained
    repo = Repo(path)
    found = encodings(repo)
    # Weights of the 4 older steps, second moments of 3 of them (a predicted second moment starts
    # 2 deep: the newest parent's would make the chain below it 5 long, more than
    # max_delta_depth): 2 layers x 9 chunks each, less the odd chunk whose plain delta was
    # smaller (the fit is done on each chunk alone). A bias (768 bytes) is a small position,
    # under 1/16 of a chunk: only its change is recorded (encoding.SMALL_POSITION).
    assert 0.95 * (4 * 2 * 9 + 3 * 2 * 9) <= found.get("PREDICTED", 0) <= 4 * 2 * 9 + 3 * 2 * 9, found
    # Upgraded before the first: to 4, or to 6 where a plain delta's context-sorted form won too.
    assert json.loads((path / "config.json").read_text())["version"] in (4, 6)
    newest = _commit_chunks(repo, runs[-1][0])
    assert not any(repo.store.bases_of(o) for o in newest)  # the tip reads whole
    for oid in _predicted(repo):
        assert len(repo.store.bases_of(oid)) == 3 and oid not in newest
        assert repo.store.chain_depth(oid) <= repo.config.max_delta_depth  # type: ignore[attr-defined]
    assert_reads_back(repo, runs, tmp_path)
    assert repo.fsck(read_data=True) == []


def test_predicted_deltas_are_smaller_than_plain_ones(tmp_path: Path) -> None:
    """The same run with predicted deltas unavailable (a version 3 reader's writer would store
    plain deltas) stores clearly more."""
    plain = Repo.init(tmp_path / "plain", chunk_size=CHUNK)
    predicted = Repo.init(tmp_path / "predicted", chunk_size=CHUNK)
    original = pairing.Upgrade.possible
    pairing.Upgrade.possible = lambda self: False  # type: ignore[method-assign]
    try:
        dcp_adamw_run(plain, 4)
    finally:
        pairing.Upgrade.possible = original  # type: ignore[method-assign]
    dcp_adamw_run(predicted, 4)
    assert "PREDICTED" not in encodings(plain)
    assert predicted.stats().stored_bytes < 0.8 * plain.stats().stored_bytes


def test_gc_keeps_every_base_of_a_kept_predicted_delta(trained, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path, runs = trained
    copy = tmp_path / "repo"
    shutil.copytree(path, copy)
    repo = Repo(copy)
    repo.create_tag("first", runs[0][0])
    first = _commit_chunks(repo, runs[0][0])
    needed = {b for o in first for b in repo.store.bases_of(o)} - first
    assert needed, "the first step's chunks should be deltas of the second's"
    repo.gc(keep_last=1, prune_now=True)
    assert all(repo.store.has(b) for b in needed)
    assert_reads_back(repo, [runs[0], runs[-1]], tmp_path / "out")
    assert repo.fsck(read_data=True) == []
    repo.delete_tag("first")
    repo.gc(keep_last=1, prune_now=True)
    assert not any(repo.store.has(o) for o in first - _commit_chunks(repo, runs[-1][0]))
    assert_reads_back(repo, runs[-1:], tmp_path / "out2")
    assert repo.fsck(read_data=True) == []


def test_a_damaged_base_is_detected_and_named(trained, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path, runs = trained
    copy = tmp_path / "repo"
    shutil.copytree(path, copy)
    repo = Repo(copy)
    victim = next(o for o in _predicted(repo) if o in _commit_chunks(repo, runs[-2][0]))
    base = repo.store.bases_of(victim)[2]  # the parent's first moment, or the tip's second moment
    flip_bit(
        copy / object_key(base), offset=-1, bit=6
    )  # an exponent bit: a low mantissa bit may not move the prediction
    with pytest.raises(IntegrityError, match=base):
        repo.store.get_chunk(victim, parse_header(repo.store.read_raw(victim)).raw_len)
    problems = repo.fsck(read_data=True)
    assert any(base in p for p in problems), problems
    with pytest.raises(IntegrityError, match=base):
        repo.checkout(runs[-2][0], tmp_path / "out")


def test_an_older_reader_refuses_the_upgraded_repository(trained, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    path, _ = trained
    monkeypatch.setattr(config, "REPO_FORMAT_VERSION", 3)
    with pytest.raises(UnsupportedFormatError, match="newer than this ckstore supports"):
        Repo(path)


def test_an_older_decoder_refuses_the_encoding_as_corrupt(trained) -> None:  # type: ignore[no-untyped-def]
    """What a ckstore that knows encodings 0-3 does with one (a cloned object, a remote's pack)."""
    path, _ = trained
    repo = Repo(path)
    data = repo.store.read_raw(_predicted(repo)[0])
    header = codec.HEADER.unpack_from(data)
    assert header[3] == 4
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(codec, "Encoding", codec.IntEnum("Encoding", {"RAW": 0, "ZSTD": 1, "GROUPED": 2, "DELTA": 3}))
        with pytest.raises(IntegrityError, match="unknown object encoding 4"):
            codec.parse_header(data)
    assert len(delta_bases(data)) == 3


def test_commit_state_steps_predict_second_moments_and_guessed_weights(tmp_path: Path) -> None:
    """``commit_state`` names optimizer state by parameter index: the moments of one index pair up
    for sure, the weight by order and shape (a BatchNorm's buffers sit between parameters here);
    every step loads back bit-exact."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 96), torch.nn.BatchNorm1d(96), torch.nn.Linear(96, 48))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    repo = Repo.init(tmp_path / "repo", chunk_size=4096)
    saved = []
    for _ in range(4):
        model(torch.randn(8, 96)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        saved.append(
            (
                repo.commit_state(state, message="step"),
                {k: v.clone() for k, v in model.state_dict().items()},
                {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()},
            )
        )
        repo.wait()
    weights = 0
    for commit, _, _ in saved[:-1]:
        for f in repo.read_commit(commit).files:
            for t in f.tensors:
                predicted = [parse_header(repo.store.read_raw(c.id)).encoding == Encoding.PREDICTED for c in t.chunks]
                weights += t.name in ("model.0.weight", "model.2.weight") and all(predicted)
    # The Linear weights of the 3 older steps, guessed past the BatchNorm's parameters and buffers
    # (tensors of a few hundred bytes often keep a plain delta: the predicted one's header and
    # coefficients cost more than it saves).
    assert weights == 3 * 2
    for commit, model_state, opt_state in saved:
        loaded = repo.load_state(commit)
        assert all(torch.equal(loaded["model"][k], v) for k, v in model_state.items())
        for i, moments in opt_state.items():
            assert all(torch.equal(loaded["optimizer"]["state"][i][k], v) for k, v in moments.items())
    assert repo.fsck(read_data=True) == []
