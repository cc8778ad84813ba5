"""`ckstore status`: branch and HEAD, compaction, storage, overlay bases, remotes ahead/behind."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckstore.cli import main
from ckstore.repo import Repo
from tests.helpers import checkpoint


def _status(repo: Path, *extra: str) -> str:
    result = CliRunner().invoke(main, ["--repo", str(repo), "status", *extra], prog_name="ckstore")
    assert result.exit_code == 0, result.output
    return result.stdout


def _json(repo: Path) -> dict:
    return json.loads(_status(repo, "--json"))


def test_empty_repository(tmp_path: Path) -> None:
    Repo.init(tmp_path / "r")
    assert _status(tmp_path / "r").splitlines()[0] == "On branch main: no commits yet"
    doc = _json(tmp_path / "r")
    assert (doc["branch"], doc["head"], doc["commits"], doc["remotes"], doc["bases"]) == ("main", None, 0, [], [])


def test_head_storage_and_what_gc_would_free(tmp_path: Path) -> None:
    repo = Repo.init(tmp_path / "r")
    oid = repo.commit([checkpoint(tmp_path / "a.safetensors", 1)], message="epoch 1")
    repo.wait()  # this process's compaction
    assert _status(tmp_path / "r").splitlines()[0] == f"On branch main, HEAD {oid[:12]} epoch 1"
    repo.store.put_chunk(os.urandom(5000), 1)  # an object no commit names
    doc = _json(tmp_path / "r")
    assert doc["head"] == oid and doc["commits"] == 1
    assert doc["stored_bytes"] == repo.stats().stored_bytes
    assert doc["gc_would_free_bytes"] > 5000
    assert doc["gc_would_free_bytes"] == repo.gc().freed_bytes


def test_compaction_in_another_process_is_reported(tmp_path: Path) -> None:
    repo = Repo.init(tmp_path / "r")
    repo.commit([checkpoint(tmp_path / "a.safetensors", 1)], message="one")
    repo.wait()  # this process's compaction
    assert _json(tmp_path / "r")["compaction_running"] is False
    # flock locks belong to the open file description: a second open is another holder, as a
    # compacting process would be.
    fd = os.open(tmp_path / "r" / "compact.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert _json(tmp_path / "r")["compaction_running"] is True
        assert "compaction: running in another process" in _status(tmp_path / "r")
    finally:
        os.close(fd)


def test_remote_branches_ahead_and_behind(tmp_path: Path) -> None:
    repo = Repo.init(tmp_path / "r")
    repo.commit([checkpoint(tmp_path / "a.safetensors", 1)], message="one")
    repo.add_remote("origin", str(tmp_path / "remote"))
    repo.push("origin")
    assert "main: up to date with origin/main" in _status(tmp_path / "r")
    repo.commit([checkpoint(tmp_path / "a.safetensors", 2)], message="two")
    repo.commit([checkpoint(tmp_path / "a.safetensors", 3)], message="three")
    other, _ = Repo.clone(str(tmp_path / "remote"), tmp_path / "clone")
    other.commit([checkpoint(tmp_path / "b.safetensors", 9)], message="theirs")
    other.push("origin")
    repo.fetch("origin")  # origin/main: one commit main lacks; main: two that origin/main lacks
    (branch,) = _json(tmp_path / "r")["remotes"][0]["branches"]
    assert (branch["branch"], branch["ahead"], branch["behind"]) == ("main", 2, 1)
    assert "main: 2 ahead, 1 behind origin/main" in _status(tmp_path / "r")


def test_overlay_base_reachable_then_moved(tmp_path: Path) -> None:
    base = Repo.init(tmp_path / "base")
    base.commit([checkpoint(tmp_path / "p.safetensors", 1)], message="pretrained")
    overlay = Repo.init(tmp_path / "ovl")
    overlay.commit([checkpoint(tmp_path / "f.safetensors", 2)], message="ft", base="HEAD", base_repo=tmp_path / "base")
    (entry,) = _json(tmp_path / "ovl")["bases"]
    assert entry["reachable"] is True and entry["location"] == str((tmp_path / "base").resolve())
    shutil.move(tmp_path / "base", tmp_path / "elsewhere")
    (entry,) = _json(tmp_path / "ovl")["bases"]
    assert entry["reachable"] is False and "relink" in entry["reason"]
    assert "UNREACHABLE" in _status(tmp_path / "ovl")


@pytest.mark.parametrize("args", [["status", "--json"], ["status"]])
def test_outside_a_repository_is_a_one_line_error(tmp_path: Path, args: list[str]) -> None:
    result = CliRunner().invoke(main, ["--repo", str(tmp_path / "none"), *args], prog_name="ckstore")
    assert result.exit_code == 3 and len(result.stderr.strip().splitlines()) == 1


def _tip_encodings(repo: Repo) -> set[int]:
    """The encodings of the newest commit's chunks large enough to be re-encoded (64 KiB)."""
    from ckstore.codecs.objects import parse_header

    commit = repo.read_commit(repo.resolve("HEAD"))
    chunks = [c for f in commit.files for t in f.tensors for c in t.chunks if c.size >= 1 << 16]
    assert chunks
    return {parse_header(repo.store.read_raw(c.id)).encoding for c in chunks}


def test_after_the_readme_loop_and_wait_the_store_is_at_rest_newest_commit_included(tmp_path: Path) -> None:
    """A `ckstore commit` per epoch (a file name per epoch), then `ckstore wait`: the newest
    commit's chunks are in their best whole encoding (byte-grouped), not as the commit stored
    them, with no repack, and status says the store is at rest."""
    from ckstore.codecs.objects import Encoding

    Repo.init(tmp_path / "r")
    for epoch in range(2):
        folder = tmp_path / f"epoch_{epoch}"
        folder.mkdir()
        checkpoint(folder / f"model_epoch_{epoch}.safetensors", epoch, n=1 << 16)
        result = CliRunner().invoke(main, ["--repo", str(tmp_path / "r"), "commit", str(folder)])
        assert result.exit_code == 0, result.output
    assert CliRunner().invoke(main, ["--repo", str(tmp_path / "r"), "wait"]).exit_code == 0
    repo = Repo(tmp_path / "r")
    assert _tip_encodings(repo) <= {Encoding.GROUPED}
    assert _json(tmp_path / "r")["at_rest"] is True
    assert "not yet at rest" not in _status(tmp_path / "r")


def test_a_store_whose_newest_commit_is_as_committed_is_not_at_rest_until_repack(tmp_path: Path) -> None:
    from ckstore.codecs.objects import Encoding

    repo = Repo.init(tmp_path / "r")
    repo.compact_after_commit = False
    for epoch in range(2):
        repo.commit([checkpoint(tmp_path / f"e{epoch}.safetensors", epoch, n=1 << 16)])
    assert _tip_encodings(repo) & {Encoding.ZSTD, Encoding.RAW}
    assert _json(tmp_path / "r")["at_rest"] is False
    assert "not yet at rest" in _status(tmp_path / "r") and "'ckstore wait'" in _status(tmp_path / "r")
    repo.repack()
    assert _json(tmp_path / "r")["at_rest"] is True


def _lock_files(repo: Path) -> set[str]:
    """The files of writers' locks (``lock`` is the readers' too: a reader takes it shared where it can)."""
    names = {"compact.lock", "config.lock"}
    found = {n for n in names if (repo / n).exists()}
    queue = repo / "compact-queue"
    return found | ({f"compact-queue/{p.name}" for p in queue.iterdir()} if queue.is_dir() else set())


def test_status_and_report_create_no_lock_or_queue_file(tmp_path: Path) -> None:
    repo = Repo.init(tmp_path / "r")
    for seed in (1, 2):
        repo.commit([checkpoint(tmp_path / "a.safetensors", seed)], message=f"epoch {seed}")
    repo.wait()
    for name in ("lock", "compact.lock", "config.lock"):
        (tmp_path / "r" / name).unlink(missing_ok=True)
    shutil.rmtree(tmp_path / "r" / "compact-queue", ignore_errors=True)
    _status(tmp_path / "r")
    assert _lock_files(tmp_path / "r") == set()
    result = CliRunner().invoke(main, ["--repo", str(tmp_path / "r"), "report", "-o", str(tmp_path / "r.html")])
    assert result.exit_code == 0, result.output
    assert _lock_files(tmp_path / "r") == set()


@pytest.fixture
def read_only_copy(tmp_path: Path) -> Iterator[Path]:
    """A repository on a read-only bind mount (as an archived run on read-only NFS)."""
    import subprocess

    repo = Repo.init(tmp_path / "src" / "r")
    for seed in (1, 2):
        repo.commit([checkpoint(tmp_path / "a.safetensors", seed)], message=f"epoch {seed}")
    repo.wait()
    (tmp_path / "ro").mkdir()
    mounted = subprocess.run(["mount", "--bind", str(tmp_path / "src"), str(tmp_path / "ro")], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("needs a bind mount (root with CAP_SYS_ADMIN)")
    try:
        remount = ["mount", "-o", "remount,bind,ro", str(tmp_path / "ro")]
        if subprocess.run(remount, capture_output=True).returncode != 0:
            pytest.skip("cannot remount read-only")
        yield tmp_path / "ro" / "r"
    finally:
        subprocess.run(["umount", str(tmp_path / "ro")], check=True)


def test_read_only_commands_work_on_a_read_only_repository(read_only_copy: Path, tmp_path: Path) -> None:
    for args in (
        ["status"],
        ["report", "-o", str(tmp_path / "r.html")],
        ["gc", "--dry-run", "--keep-last", "1"],
        ["log"],
        ["fsck"],
    ):
        result = CliRunner().invoke(main, ["--repo", str(read_only_copy), *args], prog_name="ckstore")
        assert result.exit_code == 0, (args, result.output, result.stderr)
    assert "On branch main" in _status(read_only_copy)
    assert (
        "would delete"
        in CliRunner().invoke(main, ["--repo", str(read_only_copy), "gc", "--dry-run", "--keep-last", "1"]).output
    )
    result = CliRunner().invoke(main, ["--repo", str(read_only_copy), "tag", "v1"], prog_name="ckstore")
    assert result.exit_code == 7 and "Read-only file system" in result.stderr  # writes still fail cleanly


def test_status_on_a_damaged_file_list_piece_shows_the_branch_and_names_the_damage(tmp_path: Path) -> None:
    repo = Repo.init(tmp_path / "r")
    for e in (1, 2):  # 3000 files: the file list is stored apart, in pieces (docs/format.md 5.3)
        folder = tmp_path / f"d{e}"
        folder.mkdir()
        for i in range(3000):
            (folder / f"f{i:05d}.txt").write_text(f"file {i} epoch {e if i % 7 == 0 else 1}\n" * 3)
        head = repo.commit(folder, message=f"e{e}")
    repo.wait()
    piece = repo.read_commit(head, files=False).file_list[0].id
    path = tmp_path / "r" / "objects" / piece[:2] / piece[2:]
    if not path.is_file():
        pytest.skip("the piece is packed")
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40
    path.write_bytes(bytes(data))
    text = _status(tmp_path / "r")
    assert text.splitlines()[0] == f"On branch main, HEAD {head[:12]} e2"
    assert f"storage: not measured: commit {head}" in text and piece in text and "'ckstore fsck'" in text
    assert piece in _json(tmp_path / "r")["storage_problem"]
