"""The cache folder of saves to a remote stays bounded (dcp/cache.py): other remotes' folders go
after a week untouched, a long log keeps its last lines, index files of packs a remote no longer
holds go; what is in use stays."""

from __future__ import annotations

import os
import time
from pathlib import Path

from ckstore.backend.local import LocalBackend
from ckstore.dcp import cache


def _age(folder: Path, days: float) -> None:
    """Everything in ``folder`` (and it) last modified ``days`` ago."""
    when = time.time() - days * 86400
    for where, dirs, files in os.walk(folder, topdown=False):
        for name in [*files, *dirs]:
            os.utime(os.path.join(where, name), (when, when))
    os.utime(folder, (when, when))


def _remote(root: Path, name: str, days: float) -> Path:
    folder = root / cache.REMOTES / name
    (folder / "indexes").mkdir(parents=True)
    (folder / "indexes" / "p1").write_bytes(b"index")
    _age(folder, days)
    return folder


def test_other_remotes_untouched_for_a_week_go_and_the_rest_stays(tmp_path: Path) -> None:
    own = _remote(tmp_path, "own", 30)  # the remote being compacted, however old its files
    old = _remote(tmp_path, "old", 8)
    recent = _remote(tmp_path, "recent", 6)
    partly = _remote(tmp_path, "partly", 8)
    (partly / "indexes" / "p2").write_bytes(b"read yesterday")  # one file new: in use
    leftover = _remote(tmp_path, ".gone-123", 0)  # a removal that was killed part-way
    (tmp_path / "remote-compact-objects" / "objects").mkdir(parents=True)  # the earlier layout
    removed = cache.remove_stale(tmp_path, own)
    assert sorted(removed) == [".gone-123", "old", "remote-compact-objects"]
    assert own.is_dir() and recent.is_dir() and partly.is_dir()
    assert not old.exists() and not leftover.exists() and not (tmp_path / "remote-compact-objects").exists()
    assert [p.name for p in (tmp_path / cache.REMOTES).iterdir() if p.name.startswith(".gone-")] == []


def test_opening_a_remote_touches_its_folder_so_a_remote_in_use_never_ages(tmp_path: Path) -> None:
    folder = cache.remote_folder(tmp_path, "s3://bucket/a")
    _age(folder, 30)
    assert cache.remote_folder(tmp_path, "s3://bucket/a") == folder
    assert time.time() - cache.last_touched(folder) < 60
    assert cache.remove_stale(tmp_path, tmp_path / cache.REMOTES / "another") == []


def test_a_log_past_one_mib_keeps_its_last_whole_lines_within_256_kib(tmp_path: Path) -> None:
    log = tmp_path / "remote-compact.log"
    lines = [f"ckstore: remote compaction {i:08d} on s3://bucket/prefix: done\n".encode() for i in range(30000)]
    log.write_bytes(b"".join(lines))
    assert log.stat().st_size > cache.LOG_LIMIT
    # A run that has it open for appending (its stdout) goes on writing at the end after the cut.
    with open(log, "ab", buffering=0) as appender:
        assert cache.cut_log(log)
        appender.write(b"the next run's line\n")
    data = log.read_bytes()
    assert len(data) <= cache.LOG_TAIL + 100
    kept = data.splitlines(keepends=True)
    assert kept[-1] == b"the next run's line\n"
    assert kept[:-1] == lines[-(len(kept) - 1) :]  # whole lines, the newest ones, in order
    assert len(kept) > 1000
    assert not cache.cut_log(log)  # short now: left alone


def test_a_log_below_the_limit_is_not_cut(tmp_path: Path) -> None:
    log = tmp_path / "remote-compact.log"
    log.write_bytes(b"x\n" * (cache.LOG_LIMIT // 2))
    assert not cache.cut_log(log)
    assert log.stat().st_size == cache.LOG_LIMIT
    assert not cache.cut_log(tmp_path / "absent.log")


def test_index_files_of_packs_the_remote_no_longer_holds_go(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path)
    for pack in ("a" * 64, "b" * 64, "c" * 64):
        backend.put_if_absent(f"indexes/{pack}", b"index")
    assert cache.prune_indexes(backend, {"a" * 64, "c" * 64, "d" * 64}) == 1
    assert sorted(backend.list("indexes/")) == [f"indexes/{'a' * 64}", f"indexes/{'c' * 64}"]
