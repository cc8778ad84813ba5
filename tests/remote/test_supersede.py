"""Supersession by push: a remote fed by ``push`` alone after every commit holds what the local
store holds (within 5%) right after each push, folder and S3 alike, however many epochs; what
local compaction re-encodes after a push goes up with the next push, and the packs it replaces
are deleted at once, while readers (a fetch or lazy read whose pack goes, concurrent pushers,
pushes killed midway) keep reading every commit bit-exact."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from ckstore.remote import supersede as supersede_module
from ckstore.remote.chains import remote_bases
from ckstore.remote.layout import RemoteRepo
from ckstore.remote.names import open_remote
from ckstore.remote.push import PushReport
from ckstore.repo import Repo
from ckstore.repository.context import RepoContext, open_context
from tests.remote.epochs import CHUNK, adamw_fine_tune, digests

GRACE = 0.3
FAULT_CLI = Path(__file__).resolve().parent.parent / "fault_cli.py"


def remote_bytes(repo: Repo) -> int:
    return sum(info.size for info in open_remote(open_context(repo.path)).transport.list(""))


def assert_every_commit_reads_back(clone: Repo, ids: list[str], folders: list[Path], out: Path) -> None:
    assert clone.fsck(read_data=True) == []
    for i, (commit, folder) in enumerate(zip(ids, folders)):
        clone.checkout(commit, out / f"e{i}")
        assert digests(out / f"e{i}") == digests(folder)


def test_a_remote_fed_by_push_alone_holds_what_the_local_store_holds(
    tmp_path: Path, remote_url: tuple[str, str | None]
) -> None:
    url, endpoint = remote_url
    repo = Repo.init(tmp_path / "a", chunk_size=CHUNK)
    # As the CLI runs it: each push may start before the compaction after its commit has
    # re-encoded the previous epoch; the next push catches up.
    repo.detach_compaction = True
    repo.add_remote("origin", url, endpoint)
    folders = adamw_fine_tune(tmp_path / "work", 6)
    ids, ratios = [], []
    for folder in folders:
        ids.append(repo.commit(folder))
        repo.push()  # the default grace (an hour): nothing here waits for it
        ratios.append(remote_bytes(repo) / repo.stats().stored_bytes)
    repo.wait_background()  # ckstore wait
    final = repo.push()
    # Right after that push, however loaded the machine: what it replaced is deleted at once
    # (by this push, or by the earlier push it was sent by, when the compaction beat it).
    assert final.updated == [] and final.condemned == []
    local = repo.stats().stored_bytes
    assert remote_bytes(repo) <= 1.05 * local, (remote_bytes(repo), local, ratios)
    assert open_remote(open_context(repo.path)).read_condemned().packs == {}
    again = repo.push()
    assert again.objects == 0 and again.deleted == [] and again.condemned == []
    clone, _ = Repo.clone(url, tmp_path / "b", endpoint_url=endpoint)
    assert_every_commit_reads_back(clone, ids, folders, tmp_path / "out")


def pushed_whole(path: Path, url: str, endpoint: str | None, folders: list[Path]) -> tuple[Repo, list[str]]:
    """A repository whose epochs were each pushed before any compaction (the remote holds every
    epoch whole), then compacted here: its next push supersedes what the remote holds."""
    repo = Repo.init(path, chunk_size=CHUNK)
    repo.compact_after_commit = False
    repo.add_remote("origin", url, endpoint)
    ids = []
    for folder in folders:
        ids.append(repo.commit(folder))
        repo.push()
    repo.compact()
    return repo, ids


def test_a_fetch_and_a_lazy_read_whose_pack_a_push_deletes_read_again_and_succeed(
    tmp_path: Path, remote_url: tuple[str, str | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The push deletes the whole copy of epoch 1 between the reader locating it and reading it:
    the reader finds the pack gone, reads the holdings again and reads the new copies."""
    url, endpoint = remote_url
    folders = adamw_fine_tune(tmp_path / "work", 2)
    a, ids = pushed_whole(tmp_path / "a", url, endpoint, folders)
    remote = open_remote(open_context(a.path))
    whole = set(remote.catalogue())
    pushes: list[PushReport] = []
    pusher, started = [a], []
    real = RemoteRepo.read_ranges

    def read_ranges(self: RemoteRepo, pack_id: str, ranges: list[tuple[int, int]]) -> list[bytes | memoryview]:
        if not started:  # the first read of a located pack: a push supersedes it meanwhile
            started.append(True)
            pushes.append(pusher[0].push())
        return real(self, pack_id, ranges)

    monkeypatch.setattr(RemoteRepo, "read_ranges", read_ranges)
    b, _ = Repo.clone(url, tmp_path / "b", endpoint_url=endpoint)
    assert set(pushes[0].deleted) & whole  # the fetch had located objects in a pack now gone
    assert_every_commit_reads_back(b, ids, folders, tmp_path / "out")

    c, lazy_ids = pushed_whole(tmp_path / "c", url + "-lazy", endpoint, folders)
    reader = Repo.init(tmp_path / "d")
    reader.add_remote("origin", url + "-lazy", endpoint)
    reader.use_remote("origin")
    pusher[0] = c  # the next push, from the hook, is this one's
    pushes.clear()
    started.clear()
    reader.checkout(lazy_ids[0], tmp_path / "lazy")
    assert pushes and pushes[0].deleted
    assert digests(tmp_path / "lazy") == digests(folders[0])


def test_a_push_sends_nothing_again_when_compaction_made_nothing_smaller(
    tmp_path: Path, remote_url: tuple[str, str | None]
) -> None:
    url, endpoint = remote_url
    repo = Repo.init(tmp_path / "a", chunk_size=CHUNK)
    repo.add_remote("origin", url, endpoint)
    folders = adamw_fine_tune(tmp_path / "work", 1)
    repo.commit(folders[0])
    first = repo.push(grace=GRACE)
    again = repo.push(grace=GRACE)
    assert first.resent_objects == 0 and first.condemned == []
    assert again.objects == 0 and again.condemned == [] and again.deleted == []


@pytest.mark.slow
def test_readers_during_supersession_read_every_commit_bit_exact(
    tmp_path: Path, remote_url: tuple[str, str | None]
) -> None:
    """Clones and fetches run back to back while pushes send smaller copies and delete the packs
    they supersede (a grace longer than one read): every clone reads every commit it names."""
    url, endpoint = remote_url
    grace = 4.0
    repo = Repo.init(tmp_path / "a", chunk_size=CHUNK)
    repo.add_remote("origin", url, endpoint)
    folders = adamw_fine_tune(tmp_path / "work", 5)
    by_id: dict[str, Path] = {}
    stop = threading.Event()
    errors: list[BaseException] = []
    reads = [0]

    def read() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            try:
                clone, _ = Repo.clone(url, tmp_path / f"r{n}", endpoint_url=endpoint)
                ids = [e.id for e in clone.log("main") if e.id in by_id]
                assert_every_commit_reads_back(clone, ids, [by_id[c] for c in ids], tmp_path / f"out{n}")
                reads[0] += 1
            except BaseException as exc:  # noqa: BLE001  (reported by the main thread)
                errors.append(exc)
                return

    first = repo.commit(folders[0])
    by_id[first] = folders[0]
    repo.push(grace=grace)
    reader = threading.Thread(target=read)
    reader.start()
    deleted: list[str] = []
    try:
        for folder in folders[1:]:
            oid = repo.commit(folder)
            by_id[oid] = folder
            deleted += repo.push(grace=grace).deleted
            time.sleep(grace * 0.6)
        time.sleep(grace)
        deleted += repo.push(grace=grace).deleted
    finally:
        stop.set()
        reader.join()
    assert errors == []
    assert deleted and reads[0] > 1


def test_what_compaction_makes_smaller_during_the_push_that_sent_it_goes_with_that_push(
    tmp_path: Path, remote_url: tuple[str, str | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The detached compaction re-encodes epoch 0 as deltas of epoch 1 while the push sending
    both is in flight (after it sent the whole copies, before it looks for smaller ones): that
    push sends the smaller copies and deletes the whole pack it had itself just sent, rather
    than leaving it condemned for the grace (an hour by default: the remote at ~2x the store)."""
    url, endpoint = remote_url
    repo = Repo.init(tmp_path / "a", chunk_size=CHUNK)
    repo.compact_after_commit = False
    repo.add_remote("origin", url, endpoint)
    folders = adamw_fine_tune(tmp_path / "work", 2)
    ids = [repo.commit(folder) for folder in folders]
    real = supersede_module.resend_superseded
    sent_whole: list[str] = []

    def compacted_meanwhile(ctx: RepoContext, remote: RemoteRepo, *args: Any) -> PushReport:
        sent_whole.extend(args[1].sent_packs)  # the report: what this push sent before
        repo.compact()
        return real(open_context(repo.path), remote, *args)

    monkeypatch.setattr(supersede_module, "resend_superseded", compacted_meanwhile)
    report = repo.push()
    assert sent_whole and report.resent_objects > 0 and report.condemned == []
    assert set(sent_whole) & set(report.deleted), (sent_whole, report.deleted)
    assert remote_bytes(repo) <= 1.05 * repo.stats().stored_bytes
    clone, _ = Repo.clone(url, tmp_path / "b", endpoint_url=endpoint)
    assert_every_commit_reads_back(clone, ids, folders, tmp_path / "out")


def _push_process(
    repo: Path, grace: float, fault: str = "", count: Path | None = None, barrier: str = "", delay: float = 0.0
) -> subprocess.Popen[str]:
    """``ckstore push --grace G`` in a process of its own (tests/fault_cli.py: ``kill@K`` SIGKILLs
    it at its K-th mutating step; ``count`` receives the number of steps; ``barrier`` DIR:N
    starts the push once N processes are ready, ``delay`` seconds after)."""
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    env["CKSTORE_FAULT"] = fault
    env["CKSTORE_TEST_BARRIER"], env["CKSTORE_TEST_DELAY"] = barrier, str(delay)
    if count is not None:
        env["CKSTORE_FAULT_COUNT"] = str(count)
    return subprocess.Popen(
        [sys.executable, str(FAULT_CLI), "--repo", str(repo), "push", "--grace", str(grace)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finished(proc: subprocess.Popen[str]) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=300)
    return proc.returncode, out


def assert_remote_whole(repo: Repo) -> None:
    """Every index names a pack that is there; every object the history needs is held outside
    any claimed pack, with its delta bases as stored on the remote."""
    ctx = open_context(repo.path)
    remote = open_remote(ctx)
    packs = remote.pack_ids()
    assert all(p in packs for p in remote.catalogue())
    held = remote.holdings()
    needed = {e.id for e in repo.log("main")}
    needed |= {chunk.id for oid in needed for chunk in ctx.graph.read_commit(oid).all_chunks()}
    assert all(oid in held for oid in remote_bases(remote, held, needed))


@pytest.mark.slow
def test_concurrent_pushers_racing_supersession_never_delete_each_others_copies(
    tmp_path: Path, remote_url: tuple[str, str | None]
) -> None:
    """Two repositories holding the same compacted history push at once (two processes), both
    sending the same smaller copies and deleting what they supersede, over rounds with one
    start shifted a little more each time: the remote always holds everything, every commit
    clones bit-exact, and a push a grace later leaves no duplicate copy behind."""
    url, endpoint = remote_url
    grace = 1.0
    folders = adamw_fine_tune(tmp_path / "work", 3)
    raced = 0
    for n, delay in enumerate([0.0, 0.0, 0.0, 0.0, 0.05, 0.3]):
        where = f"{url}-round{n}"
        a, ids = pushed_whole(tmp_path / f"a{n}", where, endpoint, folders)
        shutil.copytree(a.path, tmp_path / f"b{n}")
        # Both start together once both have started up (imports take seconds under load).
        barrier = f"{tmp_path / f'barrier{n}'}:2"
        first = _push_process(a.path, grace, barrier=barrier)
        second = _push_process(tmp_path / f"b{n}", grace, barrier=barrier, delay=delay)
        results = [_finished(first), _finished(second)]
        assert [code for code, _ in results] == [0, 0], results
        # Both sent the smaller copies: they raced (each saw the remote before the other's copies).
        raced += all(int(re.findall(r"sent (\d+) object", out)[0]) > 0 for _, out in results)
        assert_remote_whole(a)
        clone, _ = Repo.clone(where, tmp_path / f"c{n}", endpoint_url=endpoint)
        assert_every_commit_reads_back(clone, ids, folders, tmp_path / f"out{n}")
        time.sleep(grace + 0.2)
        a.push(grace=grace)
        assert remote_bytes(a) <= 1.05 * a.stats().stored_bytes, results
    assert raced, "no round raced: the two pushes never overlapped"


@pytest.mark.parametrize("every", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_push_killed_at_each_step_of_a_supersession_loses_nothing(tmp_path: Path, every: bool) -> None:
    """The push that sends epoch 1's smaller copies and deletes its whole pack is SIGKILLed at
    each of its steps in turn (the copies' pack and index, the claim, the index and the pack
    deleted, the list settled, the local index cache): the remote still holds every commit, a
    push finishes what the killed one began (copies it sent leave the packs they replace to the
    grace: they are equal copies of no push's own), and a push a grace later leaves the remote
    at the local store's size; every commit clones bit-exact."""
    grace = 0.5
    folders = adamw_fine_tune(tmp_path / "work", 2)
    remote_path, template_remote = tmp_path / "remote", tmp_path / "template-remote"
    template, ids = pushed_whole(tmp_path / "template", str(remote_path), None, folders)
    shutil.copytree(remote_path, template_remote)
    shutil.copytree(template.path, tmp_path / "count")
    assert _finished(_push_process(tmp_path / "count", grace, "none@0", tmp_path / "steps"))[0] == 0
    steps = int((tmp_path / "steps").read_text())
    assert steps >= 6
    for k in range(1, steps + 1) if every else (steps // 2, steps - 2):
        shutil.rmtree(remote_path)
        shutil.copytree(template_remote, remote_path)
        repo_dir = tmp_path / f"r{k}"
        shutil.copytree(template.path, repo_dir)
        code, out = _finished(_push_process(repo_dir, grace, f"kill@{k}"))
        assert code in (-9, 0), (k, out)
        r = Repo(repo_dir)
        assert_remote_whole(r)
        r.push(grace=grace)  # deletes at once what it can, condemns the rest
        time.sleep(2 * grace + 1.1)  # a pack without its index goes after twice the grace
        r.push(grace=grace)
        assert remote_bytes(r) <= 1.05 * r.stats().stored_bytes, k
        assert_remote_whole(r)
        clone, _ = Repo.clone(str(remote_path), tmp_path / f"c{k}")
        assert_every_commit_reads_back(clone, ids, folders, tmp_path / f"out{k}")
        shutil.rmtree(repo_dir)
        shutil.rmtree(tmp_path / f"c{k}")
