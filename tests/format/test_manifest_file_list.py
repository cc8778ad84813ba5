"""Version-4 manifests (docs/format.md 5.3): a large file list lives in chunks the manifest names,
so log, ``~N`` and status read a commit's header at the cost of the header, while everything that
reads files, keeps objects or moves them (checkout, gc, fsck, push, fetch, clone) sees the list's
chunks like any other chunk."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from ckstore.backend.local import LocalBackend
from ckstore.cli import main
from ckstore.errors import IntegrityError, UnsupportedFormatError
from ckstore.format import manifest
from ckstore.format.ids import object_key
from ckstore.format.manifest import ChunkRef, Commit, FileEntry, decode_commit, encode_commit_parts
from ckstore.repo import Repo
from ckstore.write.commit import commit_sources, prepare_commit
from ckstore.write.ingest import MemoryFile

FILES = 3000  # about 300 KB of file list: above FILE_LIST_MIN_BYTES, so stored apart


def commit_many(repo: Repo, count: int, tag: str = "", message: str = "many files") -> str:
    files = [
        MemoryFile(f"{i // 100:03d}/{i:05d}.txt", None, (memoryview(f"object {i}{tag}\n".encode()),))
        for i in range(count)
    ]
    oid = commit_sources(repo._ctx, files, prepare_commit(message, None, {"files": count}).on_branch(repo._ctx))
    repo.wait()
    return oid


def pieces_of(repo: Repo, oid: str) -> tuple[ChunkRef, ...]:
    return Repo(repo.path).read_commit(oid).file_list  # a fresh Repo: read from disk, not remembered


def bytes_read_by(monkeypatch: pytest.MonkeyPatch, action) -> int:  # type: ignore[no-untyped-def]
    """Stored bytes of objects read (whole or in part) while ``action`` runs."""
    total = [0]
    real_get, real_prefix = LocalBackend.get, LocalBackend.get_prefix

    def get(self, key: str):  # type: ignore[no-untyped-def]
        data = real_get(self, key)
        total[0] += len(data) if key.startswith("objects/") else 0
        return data

    def get_prefix(self, key: str, n: int):  # type: ignore[no-untyped-def]
        data = real_prefix(self, key, n)
        total[0] += len(data) if key.startswith("objects/") else 0
        return data

    monkeypatch.setattr(LocalBackend, "get", get)
    monkeypatch.setattr(LocalBackend, "get_prefix", get_prefix)
    action()
    monkeypatch.undo()
    return total[0]


@pytest.fixture
def big(tmp_path: Path) -> tuple[Repo, str, str]:
    """A repository whose HEAD is a small commit on top of a 3,000-file one: (repo, big, head)."""
    repo = Repo.init(tmp_path / "repo")
    big_id = commit_many(repo, FILES)
    folder = tmp_path / "small"
    folder.mkdir()
    (folder / "note.txt").write_text("after\n")
    head = repo.commit(folder, message="small after")
    repo.wait()
    return repo, big_id, head


def test_log_reads_the_header_of_a_large_commit_not_its_file_list(
    big: tuple[Repo, str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    repo, big_id, _ = big
    manifest_text = sum(len(p) for p in manifest.split_file_list(repo.read_commit(big_id).files))
    runner = CliRunner()

    def log() -> None:
        result = runner.invoke(main, ["--repo", str(repo.path), "log", "-n", "10"])
        assert result.exit_code == 0, result.output
        assert "many files" in result.output and "small after" in result.output

    def parent() -> None:
        assert Repo(repo.path).resolve("HEAD~1") == big_id

    # The 3,000-file commit's list is ~300 KB (~100 KB stored): log and ~N read a few KB.
    assert manifest_text > 250_000
    assert bytes_read_by(monkeypatch, log) < 16_000
    assert bytes_read_by(monkeypatch, parent) < 16_000


def test_large_file_list_is_stored_apart_and_small_ones_are_not(big: tuple[Repo, str, str]) -> None:
    repo, big_id, head = big
    assert repo._ctx.store.get_commit(big_id).startswith(b'{"ckstore":4,')
    assert len(pieces_of(repo, big_id)) > 1  # cut at entries: consecutive commits share pieces
    assert repo._ctx.store.get_commit(head).startswith(b'{"ckstore":1,')
    assert pieces_of(repo, head) == ()


def test_checkout_and_show_read_every_file_of_a_version_4_commit(big: tuple[Repo, str, str], tmp_path: Path) -> None:
    repo, big_id, _ = big
    out = tmp_path / "out"
    repo.checkout(big_id, out)
    assert len(list(out.rglob("*.txt"))) == FILES
    assert (out / "012" / "01234.txt").read_text() == "object 1234\n"
    result = CliRunner().invoke(main, ["--repo", str(repo.path), "show", big_id[:12], "--json"])
    assert result.exit_code == 0, result.output
    assert "012/01234.txt" in result.output


def test_next_commit_shares_the_unchanged_pieces(big: tuple[Repo, str, str]) -> None:
    repo, big_id, _ = big
    again = commit_many(repo, FILES + 1)  # one file more at the end: only the last piece differs
    old, new = set(pieces_of(repo, big_id)), set(pieces_of(repo, again))
    assert len(new - old) == 1 and len(old & new) == len(old) - 1


def test_gc_keeps_the_file_list(big: tuple[Repo, str, str]) -> None:
    repo, big_id, _ = big
    pieces = pieces_of(repo, big_id)
    repo.gc()
    assert all(repo._ctx.store.has(p.id) for p in pieces)
    assert repo.fsck(read_data=True) == []
    assert len(Repo(repo.path).read_commit(big_id).files) == FILES


def test_damaged_file_list_is_refused_by_readers_and_named_by_fsck(big: tuple[Repo, str, str]) -> None:
    repo, big_id, head = big
    piece = pieces_of(repo, big_id)[0]
    path = repo.path / object_key(piece.id)
    path.chmod(0o644)
    path.unlink()
    fresh = Repo(repo.path)
    assert fresh.log(limit=2)[1].id == big_id  # the header is intact: history still lists
    with pytest.raises(Exception, match=piece.id):
        fresh.read_commit(big_id)
    problems = fresh.fsck()
    assert any(piece.id in p for p in problems), problems


def test_push_clone_and_fetch_carry_the_file_list(big: tuple[Repo, str, str], tmp_path: Path) -> None:
    repo, big_id, head = big
    remote = tmp_path / "remote"
    repo.add_remote("origin", str(remote))
    repo.push()
    clone, _ = Repo.clone(str(remote), tmp_path / "clone")
    assert clone.fsck(read_data=True) == []
    assert len(clone.read_commit(big_id).files) == FILES
    newer = commit_many(repo, FILES, tag=" v2", message="second big")
    repo.push()
    clone.fetch()
    assert clone.resolve("origin/main") == newer
    out = tmp_path / "out"
    clone.checkout(newer, out)
    assert (out / "000" / "00007.txt").read_text() == "object 7 v2\n"
    assert clone.fsck(read_data=True) == []


def test_format_round_trip_and_refusals() -> None:
    files = tuple(FileEntry(f"d/{i:05d}.bin", "blob", 3, chunks=(ChunkRef("ab" * 32, 3),)) for i in range(FILES))
    commit = Commit((), "2026-11-26T06:00:00+00:00", "m", "main", files)
    data, pieces = encode_commit_parts(commit)
    held = {ref.id: raw for ref, raw in pieces}
    decoded = decode_commit(data, read=lambda ref: held[ref.id])
    assert tuple(decoded.files) == files and decoded.file_list == tuple(ref for ref, _ in pieces)
    lazy = decode_commit(data, lazy_files="commit x", read=lambda ref: b"[]" if ref == pieces[0][0] else held[ref.id])
    with pytest.raises(IntegrityError, match="commit x: file list"):
        lazy.files.load()  # type: ignore[attr-defined]
    old = manifest.MANIFEST_VERSION
    try:
        manifest.MANIFEST_VERSION = 3  # a reader of versions 1-3
        with pytest.raises(UnsupportedFormatError):
            decode_commit(data, read=lambda ref: held[ref.id])
    finally:
        manifest.MANIFEST_VERSION = old
    with pytest.raises(IntegrityError, match="file_list"):
        decode_commit(data.replace(b'"file_list":[[', b'"file_list":[["x",1],['))
