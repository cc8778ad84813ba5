"""Delta-encoded chunks through the whole store: commit, checkout, gc, fsck, repack, upgrades."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import save_file

from ckstore import Repo
from ckstore.cli import main
from ckstore.codecs.objects import Encoding, parse_header
from ckstore.errors import IntegrityError
from ckstore.repository.store import object_key

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


DELTAS = {Encoding.DELTA, Encoding.CONTEXT}  # a plain delta or its context-sorted form


def _chunks(repo: Repo, ref: str) -> set[str]:
    return {c.id for c in repo.read_commit(repo.resolve(ref)).all_chunks()}


def _commit_all(repo: Repo, dirs: list[Path]) -> list[str]:
    ids = [repo.commit(str(d), message=d.name) for d in dirs]
    repo.wait()  # the compaction after each commit (compact.py) has re-encoded the parents
    return ids


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
    # Newest whole: each commit stores its chunks whole and re-encodes its parent's against them.
    assert Encoding.GROUPED in _encodings(repo, _chunks(repo, ids[3]))
    assert DELTAS & set(_encodings(repo, _chunks(repo, ids[1])))
    assert max(repo.store.chain_depth(o) for o in _chunks(repo, ids[0])) == 2
    assert max(repo.store.chain_depth(o) for o in _chunks(repo, ids[1])) == 1
    # Bounded chains: with max_delta_depth 2 the chain ids[0] -> ids[1] -> ids[2] is full, so
    # ids[2] stays whole when ids[3] arrives and ids[3] starts a new chain.
    assert max(repo.store.chain_depth(o) for o in _chunks(repo, ids[2])) == 0
    assert max(repo.store.chain_depth(o) for o in _chunks(repo, ids[3])) == 0
    _assert_checkouts(repo, ids, dirs, tmp_path, "rev")
    assert repo.fsck(read_data=True) == []


def test_frozen_tensor_is_stored_once(repo: Repo, tmp_path: Path) -> None:
    dirs = _epochs(tmp_path, 3)
    ids = _commit_all(repo, dirs)
    frozen = [
        {c.id for c in t.chunks}
        for i in ids
        for f in repo.read_commit(i).files
        for t in f.tensors
        if t.name == "frozen"
    ]
    assert frozen[0] == frozen[1] == frozen[2]


def test_gc_keeps_bases_of_kept_deltas(repo: Repo, tmp_path: Path) -> None:
    dirs = _epochs(tmp_path, 3)
    ids = _commit_all(repo, dirs)
    repo.create_tag("first", ids[0])
    # ids[0]'s chunks are deltas against ids[1]'s, which only the pruned ids[1] references.
    bases = {b for o in _chunks(repo, ids[0]) for b in repo.store.bases_of(o)}
    assert bases and not bases & (_chunks(repo, ids[0]) | _chunks(repo, ids[-1]))
    repo.gc(keep_last=1)
    assert all(repo.store.has(b) for b in bases)
    _assert_checkouts(repo, [ids[0], ids[-1]], [dirs[0], dirs[-1]], tmp_path, "gc")
    assert repo.fsck(read_data=True) == []


def test_gc_repack_frees_bases_only_pruned_commits_needed(repo: Repo, tmp_path: Path) -> None:
    dirs = _epochs(tmp_path, 3)
    ids = _commit_all(repo, dirs)
    before = repo.stats().stored_bytes
    repo.gc(keep_last=1, repack=True)
    assert repo.stats().stored_bytes < before
    assert all(repo.store.bases_of(o) == () for o in _chunks(repo, ids[-1]))
    _assert_checkouts(repo, ids[-1:], dirs[-1:], tmp_path, "gcr")
    assert repo.fsck(read_data=True) == []


def test_fsck_reports_missing_and_corrupt_base(repo: Repo, tmp_path: Path) -> None:
    dirs = _epochs(tmp_path, 2)
    ids = _commit_all(repo, dirs)
    delta = next(o for o in _chunks(repo, ids[0]) if repo.store.bases_of(o))
    (base,) = repo.store.bases_of(delta)
    data = repo.backend.get(object_key(base))
    repo.backend.replace(object_key(base), data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(IntegrityError, match=delta):
        repo.checkout(ids[0], tmp_path / "broken")
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
    assert all(repo.store.bases_of(o) == () for o in _chunks(repo, ids[-1]))
    assert DELTAS & set(_encodings(repo, _chunks(repo, ids[0])))
    assert max(repo.store.chain_depth(o) for i in ids for o in _chunks(repo, i)) <= 2
    _assert_checkouts(repo, ids, dirs, tmp_path, "rp")
    assert repo.fsck(read_data=True) == []
    again = repo.repack()  # idempotent: nothing left to change
    assert again.rewritten == 0


def test_version_one_repository_stays_readable_and_upgrades_on_repack(tmp_path: Path) -> None:
    path = tmp_path / "v1"
    Repo.init(path, chunk_size=CHUNK)
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
    # Upgraded to 2 first; to 6 as well once repack writes a context-sorted delta.
    assert report.upgraded and json.loads((path / "config.json").read_text())["version"] in (2, 6)
    _assert_checkouts(Repo(path), ids, dirs, tmp_path, "v2")
    assert Repo(path).fsck(read_data=True) == []


def test_settings_validation_and_config(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="max_delta_depth"):
        Repo.init(tmp_path / "bad", max_delta_depth=99)
    repo = Repo.memory(max_delta_depth=0)
    dirs = _epochs(tmp_path, 2)
    ids = _commit_all(repo, dirs)
    assert not DELTAS & set(_encodings(repo, _chunks(repo, ids[-1])))


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


# ---- newest whole: bounded chains, many commits, crashes while a commit re-encodes its parent ----


def test_newest_commit_always_whole_and_chains_bounded_over_many_commits(tmp_path: Path) -> None:
    repo = Repo.init(tmp_path / "repo", chunk_size=CHUNK, max_delta_depth=3)
    dirs = _epochs(tmp_path, 11)
    ids = []
    for d in dirs:
        ids.append(repo.commit(str(d), message=d.name))
        repo.wait()
        assert all(repo.store.bases_of(o) == () for o in _chunks(repo, ids[-1]))  # the tip reads whole
        assert max(repo.store.chain_depth(o) for i in ids for o in _chunks(repo, i)) <= 3
    # Every (depth + 1)-th commit keeps a whole copy; the others are deltas of the next one.
    assert DELTAS & set(_encodings(repo, _chunks(repo, ids[0])))
    _assert_checkouts(repo, ids, dirs, tmp_path, "many")
    assert repo.fsck(read_data=True) == []
    # Added when committed is the store's growth at that moment (chunks stored fast); the
    # compaction after each commit then shrank the store below that sum.
    assert repo.stats().stored_bytes < sum(e.commit.added_bytes for e in repo.log())


def test_branches_from_one_commit_each_keep_their_tip_whole(tmp_path: Path) -> None:
    repo = Repo.init(tmp_path / "repo", chunk_size=CHUNK, max_delta_depth=2)
    dirs = _epochs(tmp_path, 3)
    base = repo.commit(str(dirs[0]))
    repo.create_branch("other", base)
    a = repo.commit(str(dirs[1]), branch="main")
    b = repo.commit(str(dirs[2]), branch="other")
    for tip in (a, b):
        assert all(repo.store.bases_of(o) == () for o in _chunks(repo, tip))
    _assert_checkouts(repo, [base, a, b], dirs, tmp_path, "br")
    assert repo.fsck(read_data=True) == []


def _cli_commit(repo: Path, folder: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    fault_cli = Path(__file__).resolve().parents[1] / "fault_cli.py"  # the CLI with the tests' fault injection
    return subprocess.run(
        [sys.executable, str(fault_cli), "--repo", str(repo), "commit", str(folder)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.slow
def test_commit_killed_at_every_step_while_reencoding_parents_leaves_every_commit_readable(tmp_path: Path) -> None:
    """SIGKILL at each mutating step of a commit that stores new chunks, re-encodes its parent's
    and writes the manifest and ref: afterwards fsck --read-data is clean and every commit
    (the old ones always, the new one when its ref moved) checks out byte-identical."""
    dirs = _epochs(tmp_path, 3)
    template = tmp_path / "template"
    repo = Repo.init(template, chunk_size=CHUNK, max_delta_depth=2)
    old = _commit_all(repo, dirs[:2])
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKSTORE_")}
    counter = tmp_path / "steps"
    probe = tmp_path / "probe"
    shutil.copytree(template, probe)
    assert _cli_commit(probe, dirs[2], {**env, "CKSTORE_FAULT_COUNT": str(counter)}).returncode == 0
    steps = int(counter.read_text())
    reencoded = [o for o in _chunks(Repo(probe), old[1]) if Repo(probe).store.bases_of(o)]
    assert reencoded, "the parent's chunks should have become deltas"
    for k in range(1, steps + 1):
        work = tmp_path / f"k{k}"
        shutil.copytree(template, work)
        proc = _cli_commit(work, dirs[2], {**env, "CKSTORE_FAULT": f"kill@{k}"})
        # 0: this run needed fewer steps (worker threads can race to stage the same chunk).
        assert proc.returncode in (-signal.SIGKILL, 0), (k, proc.returncode, proc.stderr)
        crashed = Repo(work)
        assert crashed.fsck(read_data=True) == [], k
        ids = [e.id for e in crashed.log()][::-1]
        assert ids[:2] == old and len(ids) <= 3, k
        _assert_checkouts(crashed, ids, dirs, tmp_path, f"k{k}")
        # The next commit on top of whatever the crash left works and reads back (after deleting
        # a ref lock the killed process held, as the stale-lock error tells the user to).
        for lock in (work / "refs").rglob("*.lock"):
            lock.unlink()
        if len(ids) == 2:
            ids.append(crashed.commit(str(dirs[2])))
            _assert_checkouts(crashed, ids[2:], dirs[2:], tmp_path, f"k{k}-again")
            assert crashed.fsck(read_data=True) == [], k
        shutil.rmtree(work)
