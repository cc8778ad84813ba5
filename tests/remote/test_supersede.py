"""Supersession by push: a remote fed by ``push`` alone after every commit holds what the local
store holds (within 5%), folder and S3 alike, however many epochs; what local compaction
re-encodes after a push goes up with the next push, and the copies it replaces are condemned and
deleted through the two-phase grace, while readers keep reading every commit bit-exact."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from ckstore.remote.names import open_remote
from ckstore.repo import Repo
from ckstore.repository.context import open_context
from tests.remote.epochs import CHUNK, adamw_fine_tune, digests

GRACE = 0.3


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
        repo.push(grace=GRACE)
        ratios.append(remote_bytes(repo) / repo.stats().stored_bytes)
    repo.wait_background()  # ckstore wait
    final = repo.push(grace=GRACE)
    assert final.updated == [] and final.resent_objects > 0 and final.condemned
    time.sleep(GRACE + 0.1)
    later = repo.push(grace=GRACE)
    assert set(final.condemned) <= set(later.deleted) and later.resent_objects == 0
    local = repo.stats().stored_bytes
    assert remote_bytes(repo) <= 1.05 * local, (remote_bytes(repo), local, ratios)
    clone, _ = Repo.clone(url, tmp_path / "b", endpoint_url=endpoint)
    assert_every_commit_reads_back(clone, ids, folders, tmp_path / "out")


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
