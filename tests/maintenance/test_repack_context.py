"""Context-sorted deltas in a repository: repack writes them (never a commit, nor the compaction
that runs beside training every epoch), upgrading the repository to format 6 first; every epoch reads back bit-exact; fsck, gc and repack handle them;
an older ckstore refuses the repository and the encoding with a clear message."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ckstore.codecs import objects as codec
from ckstore.codecs.objects import Encoding, parse_header
from ckstore.errors import IntegrityError, UnsupportedFormatError
from ckstore.format import settings as config
from ckstore.repo import Repo
from ckstore.repository.store import object_key
from tests.helpers import adam_like_epochs, encodings, flip_bit, tree_digest


def _context_objects(repo: Repo) -> list[str]:
    return [o for o in repo.store.iter_ids() if parse_header(repo.store.read_raw(o)).encoding == Encoding.CONTEXT]


@pytest.fixture(scope="module")
def compacted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[tuple[str, Path]]]:
    root = tmp_path_factory.mktemp("context")
    repo = Repo.init(root / "repo", chunk_size=65536)
    runs = []
    for folder in adam_like_epochs(root, 4):
        runs.append((repo.commit(folder, message=folder.name), folder))
        repo.wait()
    assert _context_objects(repo) == []  # compaction leaves them to repack
    assert json.loads((root / "repo" / "config.json").read_text())["version"] < config.CONTEXT_VERSION
    repo.repack()
    return root / "repo", runs


def test_repack_writes_context_deltas_that_read_back(compacted, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path, runs = compacted
    repo = Repo(path)
    found = _context_objects(repo)
    assert len(found) >= 2 * 12, encodings(repo)  # most weight chunks of the 3 older epochs
    assert json.loads((path / "config.json").read_text())["version"] == config.CONTEXT_VERSION
    newest = {c.id for c in repo.read_commit(runs[-1][0]).all_chunks()}
    assert not any(repo.store.bases_of(o) for o in newest)  # the tip reads whole
    for oid in found:
        assert repo.store.bases_of(oid) and oid not in newest
    for i, (commit, folder) in enumerate(runs):
        repo.checkout(commit, tmp_path / str(i))
        assert tree_digest(tmp_path / str(i)) == tree_digest(folder)
    assert repo.fsck(read_data=True) == []


def test_context_deltas_store_less_than_plain_deltas(
    compacted, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """The same epochs with the encoding unavailable (as before format 6) store more."""
    path, runs = compacted
    monkeypatch.setattr(config.EncodingSettings, "allowed_off_loop", property(lambda self: self.allowed))
    plain = Repo.init(tmp_path / "plain", chunk_size=65536)
    for _, folder in runs:
        plain.commit(folder)
        plain.wait()
    plain.repack()
    assert "CONTEXT" not in encodings(plain)
    assert json.loads((tmp_path / "plain" / "config.json").read_text())["version"] < config.CONTEXT_VERSION
    assert Repo(path).stats().stored_bytes < 0.97 * plain.stats().stored_bytes


def test_gc_keeps_the_base_and_fsck_names_a_damaged_one(compacted, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path, runs = compacted
    copy = tmp_path / "repo"
    shutil.copytree(path, copy)
    repo = Repo(copy)
    repo.create_tag("first", runs[0][0])
    repo.gc(keep_last=1, prune_now=True)
    repo.checkout(runs[0][0], tmp_path / "first")
    assert tree_digest(tmp_path / "first") == tree_digest(runs[0][1])
    assert repo.fsck(read_data=True) == []
    victim = next(o for o in _context_objects(repo) if o in {c.id for c in repo.read_commit(runs[0][0]).all_chunks()})
    base = repo.store.bases_of(victim)[0]
    flip_bit(copy / object_key(base), offset=-3)
    problems = repo.fsck(read_data=True)
    assert any(base in p for p in problems), problems
    with pytest.raises(IntegrityError, match=base):
        repo.checkout(runs[0][0], tmp_path / "out", force=True)


def test_repack_writes_context_deltas_and_upgrades_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folders = adam_like_epochs(tmp_path, 3, seed=1)
    repo = Repo.init(tmp_path / "repo", chunk_size=65536)
    repo.compact_after_commit = False  # only repack re-encodes here
    commits = [repo.commit(f) for f in folders]
    assert "CONTEXT" not in encodings(repo)
    assert repo.config.version < config.CONTEXT_VERSION
    repo.repack()
    assert "CONTEXT" in encodings(repo)
    assert Repo(tmp_path / "repo").config.version == config.CONTEXT_VERSION
    for i, (commit, folder) in enumerate(zip(commits, folders)):
        repo.checkout(commit, tmp_path / f"out{i}")
        assert tree_digest(tmp_path / f"out{i}") == tree_digest(folder)
    assert repo.fsck(read_data=True) == []


def test_an_older_ckstore_refuses_the_repository_and_the_encoding(compacted, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    path, _ = compacted
    data = Repo(path).store.read_raw(_context_objects(Repo(path))[0])
    with monkeypatch.context() as mp:
        mp.setattr(config, "REPO_FORMAT_VERSION", 5)
        with pytest.raises(UnsupportedFormatError, match="format version 6 is newer than this ckstore supports"):
            Repo(path)
    with monkeypatch.context() as mp:  # a ckstore that knows encodings 0-4 (a cloned object, a remote's pack)
        mp.setattr(
            codec,
            "Encoding",
            codec.IntEnum(
                "Encoding", {n: v for n, v in [("RAW", 0), ("ZSTD", 1), ("GROUPED", 2), ("DELTA", 3), ("PREDICTED", 4)]}
            ),
        )
        with pytest.raises(IntegrityError, match="unknown object encoding 5"):
            codec.parse_header(data)
