"""DCP saves to a remote are compacted there (dcp/remote_compaction.py): after each save lands,
the previous save's chunks become deltas of the new ones, so the bucket holds about what a
compacted local repository would, and every save still loads bit-identical."""

from __future__ import annotations

import fcntl
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

import ckstore.dcp
from ckstore.backend.local import LocalBackend
from ckstore.dcp import cache, remote, remote_compaction
from ckstore.errors import InvalidInputError
from ckstore.format.ids import key_object_id
from ckstore.remote.compaction import SCRATCH_PREFIX, RemoteCompactReport
from ckstore.repo import Repo
from ckstore.transport import open_transport
from ckstore.transport.base import RemoteOptions
from tests.remote.epochs import adamw_fine_tune


def _states(tmp_path: Path, epochs: int) -> list[dict[str, torch.Tensor]]:
    """What a training script's state dict holds at each of ``epochs`` epochs of a real AdamW
    fine-tune (weights and both moments)."""
    out = []
    for folder in adamw_fine_tune(tmp_path / "epochs", epochs, steps=8):
        (file,) = folder.iterdir()
        out.append(load_file(file))
    return out


def _url(remote_url: tuple[str, str | None]) -> tuple[str, str | None]:
    url, endpoint = remote_url
    return (url if url.startswith("s3://") else Path(url).as_uri()), endpoint


def _bucket_bytes(url: str, endpoint: str | None) -> int:
    return sum(info.size for info in open_transport(url, RemoteOptions(endpoint_url=endpoint)).list(""))


def _save(state: dict[str, torch.Tensor], url: str, endpoint: str | None, compact: str) -> ckstore.dcp.Writer:
    writer = ckstore.dcp.Writer(url, endpoint_url=endpoint, compact=compact)
    dcp.save(state, storage_writer=writer)
    return writer


def _load(url: str, endpoint: str | None, ref: str, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    target = {k: torch.empty_like(v) for k, v in like.items()}
    dcp.load(target, storage_reader=ckstore.dcp.Reader(url, ref=ref, endpoint_url=endpoint))
    return target


def test_saves_compacted_on_the_remote_hold_a_local_repositorys_bytes_and_load_bit_identical(
    tmp_path: Path, remote_url: tuple[str, str | None]
) -> None:
    url, endpoint = _url(remote_url)
    whole_url = url.rstrip("/") + "-whole"
    states = _states(tmp_path, 4)
    commits, reports = [], []
    for state in states:
        writer = _save(state, url, endpoint, "inline")
        _save(state, whole_url, endpoint, "off")
        assert writer.commit_id is not None
        commits.append(writer.commit_id)
        reports.append(writer.compaction)
    assert all(isinstance(r, RemoteCompactReport) for r in reports)
    assert reports[0].parent is None  # type: ignore[union-attr]  # checked just above
    assert all(r.deltas > 0 for r in reports[1:])  # type: ignore[union-attr]

    local = Repo.init(tmp_path / "local")
    for state in states:
        dcp.save(state, storage_writer=ckstore.dcp.Writer(local.path))
    local.wait()
    compacted, whole = _bucket_bytes(url, endpoint), _bucket_bytes(whole_url, endpoint)
    held = local.stats().stored_bytes
    assert compacted <= 1.1 * held, (compacted, held)
    assert compacted < 0.8 * whole, (compacted, whole)

    for commit, state in zip(commits, states):
        loaded = _load(url, endpoint, commit, state)
        assert all(torch.equal(loaded[k], state[k]) for k in state), commit


def test_the_background_compaction_is_a_detached_process_that_shrinks_the_remote(
    tmp_path: Path, remote_url: tuple[str, str | None]
) -> None:
    url, endpoint = _url(remote_url)
    whole_url = url.rstrip("/") + "-whole"
    first, second = _states(tmp_path, 2)
    for state in (first, second):
        _save(state, whole_url, endpoint, "off")
    _save(first, url, endpoint, "off")
    writer = _save(second, url, endpoint, "background")
    assert writer.compaction is not None and not isinstance(writer.compaction, RemoteCompactReport)
    assert writer.compaction.wait(timeout=300) == 0
    # The first save is a delta of the second now, where the uncompacted remote keeps both whole.
    compacted, whole = _bucket_bytes(url, endpoint), _bucket_bytes(whole_url, endpoint)
    assert compacted < 0.9 * whole, (compacted, whole)
    assert writer.commit_id is not None
    loaded = _load(url, endpoint, writer.commit_id, second)
    assert all(torch.equal(loaded[k], second[k]) for k in second)


def test_an_unknown_compaction_mode_is_refused_before_any_save() -> None:
    with pytest.raises(InvalidInputError, match="compact='sometimes'"):
        ckstore.dcp.Writer("s3://bucket/prefix", compact="sometimes")


def _threads_idle(pid: int) -> bool:
    """Whether every thread of ``pid`` runs under SCHED_IDLE at nice 19 (False once it is gone)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        return bool(tids) and all(
            os.sched_getscheduler(t) == os.SCHED_IDLE and os.getpriority(os.PRIO_PROCESS, t) == 19 for t in tids
        )
    except OSError:
        return False


@pytest.mark.skipif(sys.platform != "linux", reason="SCHED_IDLE and per-thread priorities are Linux's")
def test_the_background_compaction_runs_at_the_lowest_priority_while_the_saver_keeps_its_own(
    tmp_path: Path, remote_url: tuple[str, str | None]
) -> None:
    url, endpoint = _url(remote_url)
    first, second = _states(tmp_path, 2)
    cache_dir = tmp_path / "cache_dir"
    dcp.save(first, storage_writer=ckstore.dcp.Writer(url, endpoint_url=endpoint, compact="off", cache_dir=cache_dir))
    writer = ckstore.dcp.Writer(url, endpoint_url=endpoint, compact="background", cache_dir=cache_dir)
    dcp.save(second, storage_writer=writer)
    child = writer.compaction
    assert isinstance(child, subprocess.Popen)
    seen_idle = False
    while child.poll() is None:
        seen_idle = seen_idle or _threads_idle(child.pid)
        time.sleep(0.01)
    assert child.returncode == 0
    # Observed from outside on every thread of the running process, and stated by its own log.
    assert seen_idle
    assert "(SCHED_IDLE, nice 19)" in (cache_dir / remote_compaction.LOG_NAME).read_text().splitlines()[-1]
    assert os.sched_getscheduler(0) != os.SCHED_IDLE and os.getpriority(os.PRIO_PROCESS, 0) < 19


def _clone_is_whole(url: str, endpoint: str | None, into: Path) -> None:
    clone, _ = Repo.clone(url, into, endpoint_url=endpoint)
    assert clone.fsck(read_data=True) == []


def test_a_background_compaction_killed_at_random_moments_leaves_every_save_whole_and_the_next_one_shrinks_the_remote(
    tmp_path: Path, remote_url: tuple[str, str | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, endpoint = _url(remote_url)
    scratch = tmp_path / "tmp"  # the runs' temporary folder, where a killed one leaves its scratch
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", None)
    states = _states(tmp_path, 3)
    seed = random.randrange(2**32)
    rng = random.Random(seed)

    def save(where: str, state: dict[str, torch.Tensor], mode: str, cache_dir: Path) -> ckstore.dcp.Writer:
        writer = ckstore.dcp.Writer(where, endpoint_url=endpoint, compact=mode, cache_dir=cache_dir)
        dcp.save(state, storage_writer=writer)
        assert writer.commit_id is not None
        return writer

    def two_saves(where: str, cache_dir: Path) -> tuple[list[str], subprocess.Popen[bytes]]:
        """The first two saves on a fresh remote; the second's compaction, running."""
        writers = [save(where, states[0], "off", cache_dir), save(where, states[1], "background", cache_dir)]
        assert isinstance(writers[1].compaction, subprocess.Popen)
        return [str(w.commit_id) for w in writers], writers[1].compaction

    def third_save_frees(where: str, cache_dir: Path) -> tuple[str, int]:
        """The third save, its compaction held back by this machine's lock until the bytes
        before it have been counted, then waited for; its commit and the bytes it freed."""
        lock = remote_compaction.lock_path(remote.find_target(where, endpoint, cache_dir))
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            writer = save(where, states[2], "background", cache_dir)
            before = _bucket_bytes(where, endpoint)
        finally:
            os.close(fd)
        assert isinstance(writer.compaction, subprocess.Popen)
        assert writer.compaction.wait(timeout=300) == 0
        return str(writer.commit_id), before - _bucket_bytes(where, endpoint)

    # How long an uninterrupted run takes on this machine now (the kills are drawn within it),
    # and what the next one frees after it.
    _, child = two_saves(url + "-clean", tmp_path / "cache_dir-clean")
    began = time.monotonic()
    assert child.wait(timeout=300) == 0
    took = time.monotonic() - began
    _, clean_frees = third_save_frees(url + "-clean", tmp_path / "cache_dir-clean")
    assert clean_frees > 0

    killed, leaked = [], []
    for k in range(3):
        where, cache_dir = f"{url}-k{k}", tmp_path / f"cache_dir-k{k}"
        context = f"seed {seed}, kill {k}"
        commits, child = two_saves(where, cache_dir)
        time.sleep(rng.uniform(0.02, 0.95) * took)
        child.send_signal(signal.SIGKILL)
        killed.append(child.wait(timeout=60) == -signal.SIGKILL)
        leaked.append(len(list(scratch.glob(SCRATCH_PREFIX + "*"))))
        # Whatever the moment: the remote clones and checks whole, and both saves load bit-identical.
        _clone_is_whole(where, endpoint, tmp_path / f"clone-k{k}")
        for commit, state in zip(commits, states):
            loaded = _load(where, endpoint, commit, state)
            assert all(torch.equal(loaded[n], state[n]) for n in state), context

        # The next save's compaction completes and frees about what it frees after a whole run.
        third, frees = third_save_frees(where, cache_dir)
        assert frees > 0.9 * clean_frees, (context, frees, clean_frees)
        # and removes the scratch repository (two saves' paired chunks) the killed run left.
        assert list(scratch.glob(SCRATCH_PREFIX + "*")) == [], (context, leaked)
        for commit, state in zip([*commits, third], states):
            loaded = _load(where, endpoint, commit, state)
            assert all(torch.equal(loaded[n], state[n]) for n in state), context
    # The kills are meant to land mid-run; at least one did, whatever the machine's load.
    assert any(killed), (seed, took, leaked)


def _held(folder: Path) -> set[str]:
    """The objects an object folder (a cache's) holds."""
    return {oid for key in LocalBackend(folder).list("objects/") if (oid := key_object_id(key)) is not None}


def test_the_cache_folder_keeps_the_newest_saves_chunks_for_the_compaction_and_forgets_old_remotes(
    tmp_path: Path, remote_url: tuple[str, str | None]
) -> None:
    url, endpoint = _url(remote_url)
    root = tmp_path / "cache"
    others = {}
    for name, days in (("stale", 8), ("recent", 6)):  # other remotes' folders, untouched that long
        others[name] = root / cache.REMOTES / (name * 4)
        (others[name] / "indexes").mkdir(parents=True)
        (others[name] / "indexes" / "p").write_bytes(b"index")
        when = time.time() - days * 86400
        for path in (others[name] / "indexes" / "p", others[name] / "indexes", others[name]):
            os.utime(path, (when, when))
    log = root / remote_compaction.LOG_NAME
    log.write_bytes(b"an old run's line\n" * (2 * cache.LOG_LIMIT // 18))

    states = _states(tmp_path, 4)
    commits, sizes = [], []
    for i, state in enumerate(states):
        mode = "background" if i == len(states) - 1 else "inline"
        writer = ckstore.dcp.Writer(url, endpoint_url=endpoint, compact=mode, cache_dir=root)
        dcp.save(state, storage_writer=writer)
        assert writer.commit_id is not None
        commits.append(writer.commit_id)
        if isinstance(writer.compaction, subprocess.Popen):
            assert writer.compaction.wait(timeout=300) == 0
        target = remote.find_target(url, endpoint, root)
        own = target.cache_path()
        assert own is not None
        # The compaction's objects: only the newest save's chunks (and commit objects), which
        # the next save's compaction pairs with its own; never an older save's.
        newest = {c.id for c in remote.RemoteView(target).graph.read_commit(writer.commit_id).all_chunks()}
        held = _held(own / cache.COMPACTION)
        assert held <= newest | set(commits), (i, len(held - newest - set(commits)))
        if i:
            assert len(held & newest) > 0.5 * len(newest)
        sizes.append(sum(p.stat().st_size for p in (own / cache.COMPACTION).rglob("*") if p.is_file()))
        # Index files of packs the compaction deleted from the remote are gone from the cache.
        indexes = {k.split("/", 1)[1] for k in LocalBackend(own).list("indexes/")}
        assert indexes <= target.open().pack_ids()
        # Another remote's folder untouched for a week went with the first run; one of 6 days stays.
        assert not others["stale"].exists() and (others["recent"] / "indexes" / "p").exists()
    assert max(sizes[1:]) < 1.5 * min(sizes[1:]), sizes  # one save's worth, not the history's
    # The detached run cut the log to its last lines, its own last.
    text = log.read_bytes()
    assert len(text) < cache.LOG_TAIL + 1024 and text.startswith(b"an old run's line\n")
    assert text.splitlines()[-1].startswith(b"ckstore: remote compaction of " + commits[-1][:12].encode())
    for commit, state in zip(commits, states):
        loaded = _load(url, endpoint, commit, state)
        assert all(torch.equal(loaded[n], state[n]) for n in state), commit
