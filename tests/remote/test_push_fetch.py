"""push, fetch, pull and clone end to end, against the real S3 server and a folder remote.

Every round trip is checked byte for byte (sha256 of every checked-out file) and by fsck of the
receiving repository; transfer sizes come from the push/fetch reports, which count the pack
bytes actually handed to the transport.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckstore.cli import main
from ckstore.errors import ConflictError, IntegrityError, NotFoundError, StorageError
from ckstore.format.pack import ENTRY
from ckstore.remote.layout import PACKS, pack_name
from ckstore.remote.push import FetchFirstError
from ckstore.repo import Repo
from ckstore.transport.testserver import S3Server
from tests.remote.epochs import assert_checks_out, digests, epoch_files, make_repo, pushed


def test_push_clone_round_trip_is_byte_identical(tmp_path: Path, remote_url: tuple[str, str | None]) -> None:
    url, endpoint = remote_url
    a, ids = make_repo(tmp_path / "a", tmp_path / "work", range(1, 4))
    a.add_remote("origin", url, endpoint)
    report = a.push()
    assert report.updated == [("refs/heads/main", None, ids[-1])]
    assert a.resolve("origin/main") == ids[-1]
    b, _ = Repo.clone(url, tmp_path / "b", endpoint_url=endpoint)
    assert [e.id for e in b.log()] == [e.id for e in a.log()]
    for i, oid in enumerate(ids, start=1):
        out = tmp_path / f"out{i}"
        b.checkout(oid, out)
        assert digests(out) == digests(tmp_path / "work" / f"e{i}")
    assert b.fsck(read_data=True) == []
    assert b.resolve("origin/main") == ids[-1] and b.head_branch == "main"


def test_second_push_sends_only_what_the_epoch_added(tmp_path: Path, remote_url: tuple[str, str | None]) -> None:
    url, endpoint = remote_url
    a, _ = make_repo(tmp_path / "a", tmp_path / "work", range(1, 2))
    a.add_remote("origin", url, endpoint)
    first = a.push()
    before = set(a.store.iter_ids())
    oid = a.commit(epoch_files(tmp_path / "work" / "e2", 2), message="epoch 2")
    added = set(a.store.iter_ids()) - before
    second = a.push()
    # Besides the epoch, the push sends again what compaction re-encoded smaller (epoch 1's pack).
    assert second.objects - second.resent_objects == len(added) and second.packs >= 1
    stored = sum(a.store.stored_size(o) or 0 for o in added)
    # Pack framing and the index are an entry (72 bytes) an object each on top of the stored bytes.
    assert stored < second.bytes - second.resent_bytes <= stored + 2 * ENTRY.size * len(added) + 200
    assert second.bytes - second.resent_bytes < first.bytes
    assert a.push().objects == 0  # nothing new: nothing sent
    assert a.resolve("origin/main") == oid


def test_fetch_and_pull_fast_forward(tmp_path: Path, remote_url: tuple[str, str | None]) -> None:
    url, endpoint = remote_url
    a, ids = pushed(tmp_path, url, endpoint)
    b, _ = Repo.clone(url, tmp_path / "b", endpoint_url=endpoint)
    new = a.commit(epoch_files(tmp_path / "work" / "e2", 2), message="epoch 2")
    a.create_tag("best")
    a.push(refs=["main", "best"])
    report, old, now = b.pull()
    assert (old, now) == (ids[0], new) and report.commits == 1
    assert b.resolve("main") == new and b.resolve("best") == new
    assert b.pull()[1:] == (new, new)  # already up to date
    assert_checks_out(b, "main", tmp_path / "out", tmp_path / "work" / "e2")


def test_diverged_push_needs_fetch_first_or_force(tmp_path: Path, remote_url: tuple[str, str | None]) -> None:
    url, endpoint = remote_url
    a, _ = pushed(tmp_path, url, endpoint)
    b, _ = Repo.clone(url, tmp_path / "b", endpoint_url=endpoint)
    a.commit(epoch_files(tmp_path / "work" / "e2", 2), message="a's epoch 2")
    a.push()
    theirs = b.commit(epoch_files(tmp_path / "work" / "e3", 3), message="b's epoch 2")
    with pytest.raises(FetchFirstError, match="fetch first") as err:
        b.push()
    assert err.value.exit_code == 6
    with pytest.raises(ConflictError, match="diverged"):
        b.pull()
    b.push(force=True)
    assert b.fetch().updated == [] and b.resolve("origin/main") == theirs


def test_concurrent_pushers_exactly_one_wins(tmp_path: Path, remote_url: tuple[str, str | None]) -> None:
    url, endpoint = remote_url
    base, _ = make_repo(tmp_path / "base", tmp_path / "work", range(1, 2))
    base.add_remote("origin", url, endpoint)
    base.push()
    pushers = [Repo.clone(url, tmp_path / f"p{i}", endpoint_url=endpoint)[0] for i in range(4)]
    tips = [
        p.commit(epoch_files(tmp_path / "work" / f"x{i}", 10 + i), message=f"pusher {i}") for i, p in enumerate(pushers)
    ]
    outcome: dict[int, object] = {}
    start = threading.Barrier(len(pushers))

    def run(i: int) -> None:
        start.wait()
        try:
            pushers[i].push()
            outcome[i] = "won"
        except FetchFirstError as exc:
            outcome[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(pushers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, o in outcome.items() if o == "won"]
    assert len(winners) == 1 and len(outcome) == len(pushers)
    # Nothing lost: the winner's commit is on the remote, whole; each loser still has its own.
    check, _ = Repo.clone(url, tmp_path / "check", endpoint_url=endpoint)
    assert check.resolve("main") == tips[winners[0]] and check.fsck(read_data=True) == []
    for i, p in enumerate(pushers):
        assert p.resolve("main") == tips[i]


def _damage(url: str, server: S3Server | None, tmp_path: Path, how: Callable[[bytes], bytes]) -> str:
    """Apply ``how`` to the largest pack on the remote; return its id."""
    from ckstore.transport import open_transport

    t = open_transport(url, server.options() if server else None)
    packs = sorted(t.list(PACKS), key=lambda i: i.size)
    key = packs[-1].key
    t.put(key, how(t.get(key)))
    return key[len(PACKS) : -len(".pack")]


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_remote_pack_is_detected_and_named(
    tmp_path: Path, remote_url: tuple[str, str | None], damage: str, request: pytest.FixtureRequest
) -> None:
    url, endpoint = remote_url
    pushed(tmp_path, url, endpoint)
    server = request.getfixturevalue("s3_server") if url.startswith("s3://") else None

    def flip(data: bytes) -> bytes:
        middle = len(data) // 2
        return data[:middle] + bytes([data[middle] ^ 0x40]) + data[middle + 1 :]

    pack_id = _damage(url, server, tmp_path, flip if damage == "flip" else lambda d: d[: len(d) // 2])
    b = Repo.init(tmp_path / "b")  # a fetch (a failed clone removes its repository)
    b.add_remote("origin", url, endpoint)
    with pytest.raises(IntegrityError, match=pack_id[:16]) as err:
        b.fetch()
    assert err.value.exit_code == 4
    assert b.refs.list("refs/remotes/") == {} and b.fsck() == []  # nothing half-fetched is named by a ref


def test_remote_commands(tmp_path: Path, remote_url: tuple[str, str | None], monkeypatch: pytest.MonkeyPatch) -> None:
    url, endpoint = remote_url
    make_repo(tmp_path / "a", tmp_path / "work", range(1, 2))
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()

    def run(*args: str, code: int = 0) -> str:
        result = runner.invoke(main, ["--repo", str(tmp_path / "a"), *args])
        assert result.exit_code == code, result.output
        return result.output

    run("remote", "add", "origin", url, *(["--endpoint-url", endpoint] if endpoint else []))
    assert run("remote") == "origin\n"
    assert url in run("remote", "-v")
    assert "already exists" in run("remote", "add", "origin", url, code=6)
    assert "invalid remote name" in run("remote", "add", "bad/name", url, code=5)
    assert "sent" in run("push")
    assert "up to date" in run("push", "origin", "main")
    assert "no remote named 'nope'" in run("push", "nope", code=3)
    assert "no branch or tag 'nothere'" in run("push", "origin", "nothere", code=3)
    assert "fetched 0 commit(s)" in run("fetch")
    result = runner.invoke(
        main, ["clone", url, str(tmp_path / "b"), *(["--endpoint-url", endpoint] if endpoint else [])]
    )
    assert result.exit_code == 0, result.output
    assert "removed remote origin" in run("remote", "remove", "origin")
    assert run("remote") == ""
    with pytest.raises(NotFoundError):
        Repo(tmp_path / "a").resolve("origin/main")


def test_clone_of_an_empty_or_missing_remote_is_refused(tmp_path: Path, remote_url: tuple[str, str | None]) -> None:
    url, endpoint = remote_url
    with pytest.raises(StorageError, match="holds no ckstore repository|does not exist"):
        Repo.clone(url, tmp_path / "b", endpoint_url=endpoint)
    assert not (tmp_path / "b").exists()


def test_unknown_remote_and_bad_names(tmp_path: Path) -> None:
    repo = Repo.init(tmp_path / "a")
    with pytest.raises(NotFoundError, match="no remote named 'origin'"):
        repo.fetch()
    from ckstore.errors import InvalidInputError

    for bad in ("", "-x", "a/b", "a..b", "x.lock"):
        with pytest.raises(InvalidInputError):
            repo.add_remote(bad, str(tmp_path / "r"))
    with pytest.raises(InvalidInputError, match="s3:// remotes only"):
        repo.add_remote("r", str(tmp_path / "r"), endpoint_url="http://127.0.0.1:1")


@pytest.mark.parametrize("group", ["one batch", "batch per commit"])
def test_clone_verifies_deltas_against_bases_fetched_with_them(
    tmp_path: Path, group: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Older epochs are stored as deltas of newer ones, so a clone (oldest commit first) meets
    deltas before their bases: in one batch they wait for the base's in-memory verification, one
    batch per commit fetches the base in a later round. Either way a damaged base is named."""
    from ckstore.format.pack import parse_pack
    from ckstore.remote import landing
    from ckstore.transport import open_transport

    if group == "batch per commit":
        monkeypatch.setattr(landing, "LAND_BATCH", 1)
    url = (tmp_path / "remote").as_uri()
    a, ids = make_repo(tmp_path / "a", tmp_path / "work", range(1, 4))
    deltas = {o: a.store.bases_of(o) for o in a.store.iter_ids() if a.store.bases_of(o) != ()}
    assert deltas, "the epochs should share chunks as deltas"
    a.add_remote("origin", url)
    a.push()
    b, _ = Repo.clone(url, tmp_path / "b")
    assert {o: b.store.bases_of(o) for o in deltas} == deltas  # stayed deltas on the way
    b.checkout(ids[0], tmp_path / "out")
    assert digests(tmp_path / "out") == digests(tmp_path / "work" / "e1")
    assert b.fsck(read_data=True) == []

    (base,) = next(iter(deltas.values()))
    t = open_transport(url, None)
    for info in t.list(PACKS):
        data = t.get(info.key)
        entry = parse_pack(data, pack_name(info.key)).find(base)
        if entry is not None:  # flip a byte in the base's body, past its header
            at = entry.offset + entry.length - 1
            t.put(info.key, data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1 :])
    c = Repo.init(tmp_path / "c")  # a fetch (a failed clone removes its repository)
    c.add_remote("origin", url)
    with pytest.raises(IntegrityError, match=base) as err:
        c.fetch()
    assert err.value.exit_code == 4
    assert c.refs.list("refs/remotes/") == {} and c.fsck() == []
