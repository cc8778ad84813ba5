"""Delta-encoded chunks through the whole store: commit, checkout, gc, fsck, repack, upgrades."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import save_file

from ckstore import Repo
from ckstore.cli import main
from ckstore.codec import Encoding, parse_header
from ckstore.errors import IntegrityError
from ckstore.store import object_key

CHUNK = 4096


def _epochs(tmp: Path, n: int, dtype: str = "float32") -> list[Path]:
    """Rolling checkpoints: every weight moves a little each epoch, one tensor stays frozen."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 96)).astype(np.float32) * 0.05
    frozen = rng.standard_normal(3000).astype(np.float32)
    out = []
    for e in range(n):
        w = w + rng.standard_normal(w.shape).astype(np.float32) * 1e-5
        folder = tmp / f"epoch{e}"
        folder.mkdir()
        tensors = {"w": w.astype(dtype), "frozen": frozen, "step": np.array([e], dtype=np.int64)}
        save_file(tensors, str(folder / "model.safetensors"), metadata={"epoch": str(e)})
        (folder / "notes.txt").write_text(f"epoch {e}\n" * 500)
        out.append(folder)
    return out


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _encodings(repo: Repo, oids: set[str]) -> list[Encoding]:
    return [parse_header(repo.store.read_raw(o)).encoding for o in sorted(oids)]


def _chunks(repo: Repo, ref: str) -> set[str]:
    return {c.id for c in repo.read_commit(repo.resolve(ref)).all_chunks()}


def _commit_all(repo: Repo, dirs: list[Path]) -> list[str]:
    return [repo.commit(str(d), message=d.name) for d in dirs]


def _assert_checkouts(repo: Repo, ids: list[str], dirs: list[Path], tmp: Path, tag: str) -> None:
    for oid, d in zip(ids, dirs):
        out = tmp / f"out-{tag}-{oid[:8]}"
        repo.checkout(oid, out)
        for f in d.iterdir():
            assert _sha(out / f.name) == _sha(f)


@pytest.fixture
def repo(tmp_path: Path) -> Repo:
    return Repo.init(tmp_path / "repo", chunk_size=CHUNK, max_delta_depth=2)


def test_rolling_commits_store_deltas_and_check_out_identical(repo: Repo, tmp_path: Path) -> None:
    dirs = _epochs(tmp_path, 4)
    ids = _commit_all(repo, dirs)
    assert Encoding.GROUPED in _encodings(repo, _chunks(repo, ids[0]))
    assert Encoding.DELTA in _encodings(repo, _chunks(repo, ids[1]))
    assert max(repo.store.chain_depth(o) for o in _chunks(repo, ids[2])) == 2
    # Bounded chains: with max_delta_depth 2 the fourth epoch starts a new chain.
    assert max(repo.store.chain_depth(o) for o in _chunks(repo, ids[3])) == 0
    _assert_checkouts(repo, ids, dirs, tmp_path, "fwd")
    assert repo.fsck(read_data=True) == []


def test_frozen_tensor_is_stored_once(repo: Repo, tmp_path: Path) -> None:
    dirs = _epochs(tmp_path, 3)
    ids = _commit_all(repo, dirs)
    frozen = [{c.id for c in t.chunks} for i in ids for f in repo.read_commit(i).files for t in f.tensors
              if t.name == "frozen"]
    assert frozen[0] == frozen[1] == frozen[2]


def test_gc_keeps_bases_of_kept_deltas(repo: Repo, tmp_path: Path) -> None:
    dirs = _epochs(tmp_path, 3)
    ids = _commit_all(repo, dirs)
    bases = {b for o in _chunks(repo, ids[-1]) if (b := repo.store.base_of(o))}
    assert bases and not bases <= _chunks(repo, ids[-1])
    repo.gc(keep_last=1)
    assert all(repo.store.has(b) for b in bases)
    _assert_checkouts(repo, ids[-1:], dirs[-1:], tmp_path, "gc")
    assert repo.fsck(read_data=True) == []


def test_gc_repack_frees_bases_only_pruned_commits_needed(repo: Repo, tmp_path: Path) -> None:
    dirs = _epochs(tmp_path, 3)
    ids = _commit_all(repo, dirs)
    before = repo.stats().stored_bytes
    repo.gc(keep_last=1, repack=True)
    assert repo.stats().stored_bytes < before
    assert all(repo.store.base_of(o) is None for o in _chunks(repo, ids[-1]))
    _assert_checkouts(repo, ids[-1:], dirs[-1:], tmp_path, "gcr")
    assert repo.fsck(read_data=True) == []


def test_fsck_reports_missing_and_corrupt_base(repo: Repo, tmp_path: Path) -> None:
    dirs = _epochs(tmp_path, 2)
    ids = _commit_all(repo, dirs)
    delta = next(o for o in _chunks(repo, ids[-1]) if repo.store.base_of(o))
    base = repo.store.base_of(delta)
    assert base is not None
    data = repo.backend.get(object_key(base))
    repo.backend.replace(object_key(base), data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(IntegrityError, match=delta):
        repo.checkout(ids[-1], tmp_path / "broken")
    assert not (tmp_path / "broken" / "model.safetensors").exists()
    assert any(delta in p for p in repo.fsck(read_data=True))
    repo.store.delete(base)
    problems = repo.fsck()
    assert any("delta of missing object" in p and base in p for p in problems)


def test_repack_keeps_every_commit_and_makes_newest_whole(repo: Repo, tmp_path: Path) -> None:
    dirs = _epochs(tmp_path, 5)
    ids = _commit_all(repo, dirs)
    report = repo.repack()
    assert report.rewritten > 0 and report.deltas > 0
    assert all(repo.store.base_of(o) is None for o in _chunks(repo, ids[-1]))
    assert Encoding.DELTA in _encodings(repo, _chunks(repo, ids[0]))
    assert max(repo.store.chain_depth(o) for i in ids for o in _chunks(repo, i)) <= 2
    _assert_checkouts(repo, ids, dirs, tmp_path, "rp")
    assert repo.fsck(read_data=True) == []
    again = repo.repack()  # idempotent: nothing left to change
    assert again.rewritten == 0


def test_version_one_repository_stays_readable_and_upgrades_on_repack(tmp_path: Path) -> None:
    path = tmp_path / "v1"
    repo = Repo.init(path, chunk_size=CHUNK)
    config = {"ckstore": "repository", "version": 1, "chunk_size": CHUNK, "zstd_level": 3}
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    old = Repo(path)
    assert old.config.version == 1
    dirs = _epochs(tmp_path, 3)
    ids = _commit_all(old, dirs)
    every = set().union(*(_chunks(old, i) for i in ids))
    assert set(_encodings(old, every)) <= {Encoding.RAW, Encoding.ZSTD}  # what version 1 knows
    assert json.loads((path / "config.json").read_text())["version"] == 1
    _assert_checkouts(Repo(path), ids, dirs, tmp_path, "v1")
    report = Repo(path).repack()
    assert report.upgraded and json.loads((path / "config.json").read_text())["version"] == 2
    _assert_checkouts(Repo(path), ids, dirs, tmp_path, "v2")
    assert Repo(path).fsck(read_data=True) == []


def test_settings_validation_and_config(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="max_delta_depth"):
        Repo.init(tmp_path / "bad", max_delta_depth=99)
    repo = Repo.memory(max_delta_depth=0)
    dirs = _epochs(tmp_path, 2)
    ids = _commit_all(repo, dirs)
    assert Encoding.DELTA not in _encodings(repo, _chunks(repo, ids[-1]))


def test_cli_init_config_repack(tmp_path: Path) -> None:
    runner = CliRunner()
    path = str(tmp_path / "cli")
    assert runner.invoke(main, ["init", path, "--chunk-size", str(CHUNK), "--max-delta-depth", "3"]).exit_code == 0
    for d in _epochs(tmp_path, 3):
        assert runner.invoke(main, ["--repo", path, "commit", str(d)]).exit_code == 0
    result = runner.invoke(main, ["--repo", path, "config"])
    assert "max_delta_depth = 3" in result.output
    assert runner.invoke(main, ["--repo", path, "config", "zstd_level", "5"]).exit_code == 0
    assert Repo(path).config.zstd_level == 5
    result = runner.invoke(main, ["--repo", path, "repack"])
    assert result.exit_code == 0 and "repacked" in result.output
    result = runner.invoke(main, ["--repo", path, "gc", "--keep-last", "1", "--repack"])
    assert result.exit_code == 0
    assert runner.invoke(main, ["--repo", path, "fsck", "--read-data"]).exit_code == 0
    bad = runner.invoke(main, ["--repo", path, "config", "max_delta_depth", "40"])
    assert bad.exit_code == 5 and "max_delta_depth" in bad.output
