"""Repack (maintenance/repack.py): pairs chunks by tensor identity like compaction, never grows the store."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from ckstore import Repo
from tests.helpers import assert_reads_back, dcp_adamw_run, save_st

CHUNK = 16384


def _epoch(step: int) -> dict[str, torch.Tensor]:
    """A small model after ``step`` steps of slow drift: each epoch close to the one before."""
    g = torch.Generator().manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(128, 128, generator=g) * 0.05 for i in range(4)}
    for i, name in enumerate(sorted(state)):
        drift = torch.randn(128, 128, generator=torch.Generator().manual_seed(100 * step + i)) * 1e-4
        state[name] = state[name] + drift * step
    return state


def _per_epoch_names(repo: Repo, tmp_path: Path, epochs: int) -> list[tuple[str, Path]]:
    """Commit one file per epoch, named after its epoch (as most training scripts save them)."""
    out = []
    for step in range(epochs):
        path = save_st(tmp_path / f"ckpt-{step}" / f"epoch-{step}.safetensors", _epoch(step))
        out.append((repo.commit(path, message=f"epoch {step}"), path))
        repo.wait()
    return out


def test_repack_pairs_chunks_by_tensor_name_when_file_names_change_and_never_grows(tmp_path: Path) -> None:
    repo = Repo.init(tmp_path / "repo", chunk_size=CHUNK)
    commits = _per_epoch_names(repo, tmp_path, 4)
    before = repo.stats().stored_bytes
    report = repo.repack()
    assert report.stored_bytes_after <= report.stored_bytes_before == before
    assert repo.stats().stored_bytes == report.stored_bytes_after
    assert report.deltas > 0  # older epochs stay deltas of the next epoch's tensors
    for i, (commit, path) in enumerate(commits):
        out = repo.checkout(commit, tmp_path / f"out{i}")
        got = load_file(str(next(Path(tmp_path / f"out{i}").rglob("*.safetensors"))))
        assert got.keys() == load_file(str(path)).keys()
        assert all(torch.equal(got[k], v) for k, v in load_file(str(path)).items()), out
    assert repo.fsck(read_data=True) == []
    assert repo.repack().stored_bytes_after == report.stored_bytes_after  # a second repack changes nothing


def test_gc_repack_never_grows_what_it_keeps(tmp_path: Path) -> None:
    repo = Repo.init(tmp_path / "repo", chunk_size=CHUNK)
    commits = _per_epoch_names(repo, tmp_path, 4)
    before = repo.stats().stored_bytes
    repo.gc(repack=True)  # keeps everything: only the re-encoding could change the size
    assert repo.stats().stored_bytes <= before
    for i, (commit, path) in enumerate(commits):
        repo.checkout(commit, tmp_path / f"gc{i}")
        got = load_file(str(next(Path(tmp_path / f"gc{i}").rglob("*.safetensors"))))
        assert all(torch.equal(got[k], v) for k, v in load_file(str(path)).items())
    assert repo.fsck(read_data=True) == []


def test_repack_keeps_predicted_deltas_when_they_are_smaller(tmp_path: Path) -> None:
    repo = Repo.init(tmp_path / "repo", chunk_size=CHUNK)
    runs = dcp_adamw_run(repo, 4)
    before = repo.stats().stored_bytes
    report = repo.repack()
    assert report.stored_bytes_after <= before
    assert_reads_back(repo, runs, tmp_path / "out")
    assert repo.fsck(read_data=True) == []


def test_repack_and_gc_repack_in_an_overlay_never_copy_the_base_repositorys_objects_in(tmp_path: Path) -> None:
    """An overlay's chunks are forward deltas of its base repository's: repack and gc --repack
    keep them so, and write nothing the base repository holds into the overlay."""
    base = Repo.init(tmp_path / "base", chunk_size=CHUNK)
    base.commit(save_st(tmp_path / "pre" / "model.safetensors", _epoch(0)), message="pretrained", branch="pretrained")
    base.wait()
    overlay = Repo.init(tmp_path / "overlay", chunk_size=CHUNK)
    tuned = save_st(tmp_path / "ft" / "model.safetensors", _epoch(3))
    cid = overlay.commit(tuned, base="pretrained", base_repo=tmp_path / "base")
    overlay.wait()
    base_objects = set(base.store.iter_ids())
    before = overlay.stats().stored_bytes
    assert not set(overlay.store.iter_ids()) & base_objects
    for run in (lambda: overlay.repack(), lambda: overlay.gc(repack=True)):
        run()
        assert not set(overlay.store.iter_ids()) & base_objects  # nothing of the base copied in
        assert overlay.stats().stored_bytes <= before
        assert overlay.fsck(read_data=True) == []
        out = tmp_path / "out"
        overlay.checkout(cid, out, force=True)
        got = load_file(str(out / "model.safetensors"))
        assert all(torch.equal(got[k], v) for k, v in load_file(str(tuned)).items())
