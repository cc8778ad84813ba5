"""Push and pull cost what is new (issue 22 item 4): the walk of history stops at commits the
remote holds, and counting on another ref's history stays safe against a concurrent remote gc."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import ckstore.format.pack as pack_format
from ckstore.format.ids import ObjectId
from ckstore.format.manifest import Commit
from ckstore.format.pack import PackEntry
from ckstore.remote.layout import Condemned, RemoteRepo
from ckstore.remote.names import open_remote
from ckstore.repo import Repo
from ckstore.repository.context import open_context
from ckstore.repository.graph import CommitGraph
from ckstore.repository.store import ObjectStore
from tests.helpers import commit_many_files, counting_parsed_entries
from tests.remote.epochs import assert_checks_out, pushed

HISTORY = 30


def _small_history(path: Path, work: Path, n: int) -> tuple[Repo, list[str]]:
    repo = Repo.init(path)
    repo.compact_after_commit = False
    folder = work / "metrics"
    folder.mkdir(parents=True)
    ids = []
    for i in range(n):
        (folder / "metrics.json").write_text(f'{{"step": {i}}}')
        ids.append(repo.commit(folder, message=f"step {i}"))
    return repo, ids


def _one_more(repo: Repo, work: Path, text: str) -> str:
    folder = work / "more"
    folder.mkdir(exist_ok=True)
    (folder / "note.txt").write_text(text)
    return repo.commit(folder, message=text)


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every commit any graph reads from now on (cached or not)."""
    read: list[str] = []
    original = CommitGraph.read_commit

    def counting(self: CommitGraph, oid: str, *args: object, **kwargs: object) -> Commit:
        read.append(oid)
        return original(self, oid, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(CommitGraph, "read_commit", counting)
    return read


def test_push_of_one_commit_reads_only_what_the_remote_lacks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, ids = _small_history(tmp_path / "a", tmp_path / "work", HISTORY)
    a.add_remote("origin", str(tmp_path / "remote"))
    a.push()
    new = _one_more(a, tmp_path / "work", "one more")
    read = _count_reads(monkeypatch)
    report = a.push()
    assert report.updated == [("refs/heads/main", ids[-1], new)]
    assert report.objects == 2  # the new file's chunk and the commit
    assert set(read) <= {new, ids[-1]}
    # A new branch off the pushed one: the walk stops at the remote's main, which it tracks.
    a.create_branch("dev", new)
    a.switch("dev")
    dev = _one_more(a, tmp_path / "work", "on dev")
    read.clear()
    assert a.push(refs=["dev"]).objects == 2
    assert set(read) <= {dev, new}
    b, _ = Repo.clone(str(tmp_path / "remote"), tmp_path / "b")
    assert b.fsck(read_data=True) == [] and b.resolve("dev") == dev and len(b.log("dev")) == HISTORY + 2


def test_pull_of_one_commit_reads_only_what_it_brings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, ids = _small_history(tmp_path / "a", tmp_path / "work", HISTORY)
    a.add_remote("origin", str(tmp_path / "remote"))
    a.push()
    b, _ = Repo.clone(str(tmp_path / "remote"), tmp_path / "b")
    new = _one_more(a, tmp_path / "work", "one more")
    a.push()
    read = _count_reads(monkeypatch)
    _, old, now = b.pull()
    assert (old, now) == (ids[-1], new)
    assert set(read) <= {new, ids[-1]}
    read.clear()
    assert b.pull()[1:] == (new, new)  # up to date
    assert len(read) <= 2


def _count_index_work(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """From now on: pack entries made as Python objects (one per object an index lists, when an
    index is parsed whole), and pack tables checked whole (order and tiling)."""
    counts = {"entries": 0, "tables checked": 0}
    make_entry, check_table = PackEntry.__init__, pack_format._table_arrays

    def making(self: PackEntry, *args: object, **kwargs: object) -> None:
        counts["entries"] += 1
        make_entry(self, *args, **kwargs)  # type: ignore[arg-type]

    def checking(table: bytes, count: int, data_end: int, what: str, *args: object, **kwargs: object) -> object:
        validated = bool(kwargs.get("validated", args[1] if len(args) > 1 else False))
        counts["tables checked"] += what.startswith("index") and not validated  # a remote's index, not a local pack
        return check_table(table, count, data_end, what, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(PackEntry, "__init__", making)
    monkeypatch.setattr(pack_format, "_table_arrays", checking)
    return counts


def test_push_and_fetch_of_one_commit_look_up_only_its_objects(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over a remote of many packs and objects, a push or fetch of one commit does not parse
    every index into an entry per object (10^6 objects cost 12 s that way) nor check every
    cached index's table again: it looks up the objects it sends or brings."""
    a, ids = _small_history(tmp_path / "a", tmp_path / "work", HISTORY)
    a.add_remote("origin", str(tmp_path / "remote"))
    for i in range(0, HISTORY, 3):  # a pack per push
        a.create_branch(f"at-{i}", ids[i])
        a.push(refs=[f"at-{i}"])
    many = tmp_path / "work" / "many"
    many.mkdir()
    for i in range(300):
        (many / f"{i:03d}.txt").write_text(f"object {i}\n")
    a.commit(many, message="many objects")
    a.push()
    remote = open_remote(open_context(a.path))
    assert len(remote.catalogue()) > 10 and sum(len(t) for t in remote.catalogue().values()) > 300
    b, _ = Repo.clone(str(tmp_path / "remote"), tmp_path / "b")
    new = _one_more(a, tmp_path / "work", "one more")
    counts = _count_index_work(monkeypatch)
    report = a.push()
    assert report.objects == 2
    assert counts["entries"] <= 10 and counts["tables checked"] == 0
    counts.update(entries=0, **{"tables checked": 0})
    assert b.fetch().commits == 1
    assert counts["entries"] <= 10 and counts["tables checked"] == 1  # the new pack's index, downloaded
    assert b.fsck(read_data=True) == [] and b.resolve("origin/main") == new


def test_push_and_fetch_of_a_large_commit_with_one_file_changed_look_at_the_changed_piece(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The new commit shares all but one piece of its file list (docs/format.md 5.3) with the
    commit the remote holds: push reads that piece's entries, not all 3,000, and fetch asks
    whether only that piece's chunks are here."""
    files = 3000
    a = Repo.init(tmp_path / "a")
    commit_many_files(a, files)
    a.add_remote("origin", str(tmp_path / "remote"))
    a.push()
    b, _ = Repo.clone(str(tmp_path / "remote"), tmp_path / "b")
    new = commit_many_files(a, files, changed=1234)
    assert len(set(a.read_commit(new).file_list) - set(a.read_commit(a.resolve(new + "~1")).file_list)) == 1
    with counting_parsed_entries(monkeypatch) as parsed:
        pushing = Repo(a.path)  # nothing remembered from the commit
        report = pushing.push()
    assert report.objects == 3  # the changed file's chunk, the piece that lists it, the commit
    assert 0 < parsed[0] < files  # the changed piece's entries (~500 on average), not all 3,000 again
    asked: list[str] = []
    has_durable = ObjectStore.has_durable

    def asking(self: ObjectStore, oid: str) -> bool:
        asked.append(oid)
        return has_durable(self, oid)

    monkeypatch.setattr(ObjectStore, "has_durable", asking)
    assert b.fetch().commits == 1
    monkeypatch.undo()
    assert 0 < len(asked) < files  # twice the changed piece's chunks (here? complete?), not twice 3,000
    assert b.fsck(read_data=True) == [] and b.resolve("origin/main") == new
    b.checkout(new, tmp_path / "out")
    assert (tmp_path / "out" / "012" / "01234.txt").read_text() == "object 1234 changed\n"


def test_a_tracking_ref_of_a_replaced_remote_is_not_trusted(tmp_path: Path) -> None:
    """The remote was replaced by an empty one behind our back: the new branch's push sends its
    whole history, not just what is newer than the tracking ref."""
    a, _ = _small_history(tmp_path / "a", tmp_path / "work", 5)
    a.add_remote("origin", str(tmp_path / "remote"))
    a.push()
    remote = open_remote(open_context(a.path))
    remote.delete_ref("refs/heads/main")  # gone: only the tracking ref still says where it was
    a.create_branch("dev", a.resolve("main"))
    a.switch("dev")
    dev = _one_more(a, tmp_path / "work", "on dev")
    a.push(refs=["dev"])
    b, _ = Repo.clone(str(tmp_path / "remote"), tmp_path / "b")
    assert b.fsck(read_data=True) == [] and b.resolve("dev") == dev and len(b.log("dev")) == 6


def test_counting_on_another_ref_survives_a_gc_sweep_before_the_refs_move(
    tmp_path: Path, remote_url: tuple[str, str | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A push of a new branch counts on the remote's main for the history below it. The packs of
    that history were condemned long ago (a gc that read the refs before main was pushed), and
    just before the push moves its ref, main is deleted and a gc sweeps: the push must have
    rescued what its branch needs, as it does when it walks the whole history."""
    url, endpoint = remote_url
    grace = 60.0
    a, ids = pushed(tmp_path, url, endpoint, range(1, 3))
    remote = open_remote(open_context(a.path))
    history = remote.pack_ids()
    listed = remote.read_condemned()
    assert remote.write_condemned(Condemned({p: (time.time() - 2 * grace, False) for p in history}, listed.token))
    a.create_branch("dev", ids[-1])
    a.switch("dev")
    dev = _one_more(a, tmp_path / "work", "on dev")  # shares no object with the history below
    swap = RemoteRepo.swap_ref
    swept: list[list[str]] = []

    def sweep_first(self: RemoteRepo, ref: str, new: str, token: str | None) -> bool:
        if not swept:
            remote.delete_ref("refs/heads/main")
            swept.append(Repo(tmp_path / "a").gc_remote(grace=grace).deleted)
        return swap(self, ref, new, token)

    monkeypatch.setattr(RemoteRepo, "swap_ref", sweep_first)
    a.push(refs=["dev"], grace=grace)
    assert swept == [[]]  # the push took every pack its history needs off the list first
    assert not set(remote.read_condemned().packs) & history
    b, _ = Repo.clone(url, tmp_path / "b", endpoint_url=endpoint)
    assert b.fsck(read_data=True) == [] and b.resolve("dev") == ObjectId(dev)
    assert_checks_out(b, "dev~1", tmp_path / "out", tmp_path / "work" / "e2")
