"""Refs on remotes: a ref value is never "pruned", odd remote refs are skipped and named, push
refuses what would break a remote (conflicting names, a missing folder remote with history).

Regression tests for findings F4, F5, F12, F17 and newcomer item 3 (docs/reliability.md).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from ckstore.cli import main
from ckstore.errors import ConflictError, IntegrityError, StorageError
from ckstore.remote.gc import MTIME_RESOLUTION
from ckstore.remote.layout import PACKS
from ckstore.remote.names import open_remote
from ckstore.repo import Repo
from ckstore.repository.context import open_context
from ckstore.repository.refs import encode_ref
from tests.remote.epochs import CHUNK, assert_checks_out, epoch_files, make_repo, pushed


def _cli(*args: str, code: int) -> Result:
    result = CliRunner().invoke(main, list(args), prog_name="ckstore")
    assert result.exit_code == code, (args, result.output, result.stderr)
    assert "Traceback" not in result.output
    return result


def _three_epochs_then_remote_gc(tmp_path: Path, url: str, endpoint: str | None) -> tuple[Repo, list[str]]:
    """Three epochs pushed one by one, then ``gc --remote --keep-last 1`` twice (prune, then
    sweep): epochs 1 and 2 are in the remote's pruned record and their packs are gone."""
    a = Repo.init(tmp_path / "a", chunk_size=CHUNK)
    a.add_remote("origin", url, endpoint)
    ids = []
    for e in range(1, 4):
        ids.append(a.commit(epoch_files(tmp_path / "work" / f"e{e}", e), message=f"epoch {e}"))
        a.wait()
        a.push()
    time.sleep(MTIME_RESOLUTION + 0.1)
    assert a.gc_remote(keep_last=1, grace=0).pruned_commits == sorted(ids[:2])
    assert a.gc_remote(keep_last=1, grace=0).deleted
    return a, ids


def _sweep(a: Repo) -> None:
    time.sleep(MTIME_RESOLUTION + 0.1)
    a.gc_remote(keep_last=1, grace=0)
    a.gc_remote(keep_last=1, grace=0)


def test_pushing_a_tag_on_an_epoch_remote_gc_pruned_sends_it(
    tmp_path: Path, remote_url: tuple[str, str | None]
) -> None:
    """F4 variant A: tag the best (old, pruned) epoch and push the tag."""
    url, endpoint = remote_url
    a, ids = _three_epochs_then_remote_gc(tmp_path, url, endpoint)
    a.create_tag("best", ids[0])
    report = a.push(refs=["best"])
    assert report.updated == [("refs/tags/best", None, ids[0])]  # its objects sent, or still there
    b, _ = Repo.clone(url, tmp_path / "b", endpoint_url=endpoint)
    assert b.resolve("best") == ids[0] and b.resolve("main") == ids[2]
    assert b.fsck(read_data=True) == []
    assert_checks_out(b, "best", tmp_path / "out1", tmp_path / "work" / "e1")
    _sweep(a)  # a later remote gc keeps what a ref names, even though its record says pruned
    c, _ = Repo.clone(url, tmp_path / "c", endpoint_url=endpoint)
    assert c.fsck(read_data=True) == []
    assert_checks_out(c, "best", tmp_path / "out2", tmp_path / "work" / "e1")


def test_rolling_back_and_force_pushing_a_pruned_epoch_sends_it(tmp_path: Path) -> None:
    """F4 variant B: reset to epoch 1 and push --force."""
    url = str(tmp_path / "remote")
    a, ids = _three_epochs_then_remote_gc(tmp_path, url, None)
    a.reset(ids[0])
    a.push(force=True)  # sends what the remote lacks (the clone below proves nothing is)
    b, _ = Repo.clone(url, tmp_path / "b")
    assert b.resolve("main") == ids[0] and b.fsck(read_data=True) == []
    assert_checks_out(b, "main", tmp_path / "out", tmp_path / "work" / "e1")


def test_a_tip_the_pruned_record_lists_is_fetched_not_skipped(tmp_path: Path) -> None:
    """F5: the remote's gc/pruned names the commit main points at, and a pack still holds it."""
    url = str(tmp_path / "remote")
    a, ids = pushed(tmp_path, url, None, range(1, 3))
    open_remote(open_context(a.path)).add_pruned({ids[1]: (ids[0],)})
    b, _ = Repo.clone(url, tmp_path / "b")
    assert b.resolve("main") == ids[1] and b.fsck(read_data=True) == []
    assert_checks_out(b, "main", tmp_path / "out", tmp_path / "work" / "e2")
    b.gc()  # the local pruned record does not make local gc drop a commit a ref names
    assert b.fsck(read_data=True) == []


def test_a_ref_naming_a_commit_no_pack_holds_is_named_and_the_others_still_move(tmp_path: Path) -> None:
    """F5/F12: one ref naming a commit that is nowhere on the remote (a garbage ref file too)
    must not block the other refs; the command names each ref it skipped and exits 4."""
    url = str(tmp_path / "remote")
    a, ids = pushed(tmp_path, url, None)
    Repo.clone(url, tmp_path / "b")
    new = a.commit(epoch_files(tmp_path / "work" / "e2", 2), message="epoch 2")
    a.push()
    (tmp_path / "remote" / "refs" / "heads" / "ghost").write_text("ab" * 32 + "\n")
    (tmp_path / "remote" / "refs" / "heads" / "zz").write_text("garbage\n")
    result = _cli("--repo", str(tmp_path / "b"), "fetch", code=4)
    assert "refs/heads/ghost" in result.stderr and "refs/heads/zz" in result.stderr
    assert "refs/remotes/origin/main" in result.output  # the good ref moved
    b = Repo(tmp_path / "b")
    assert b.resolve("origin/main") == new and b.fsck(read_data=True) == []
    assert set(b.refs.list("refs/remotes/origin/")) == {"main"}
    # A clone keeps what it could fetch and says what it skipped.
    result = _cli("clone", url, str(tmp_path / "c"), code=4)
    assert "refs/heads/ghost" in result.stderr
    c = Repo(tmp_path / "c")
    assert c.branches() == {"main": new} and c.fsck(read_data=True) == []


def test_push_refuses_a_branch_that_conflicts_with_a_remote_ref(
    tmp_path: Path, remote_url: tuple[str, str | None]
) -> None:
    """F12: user 1 pushes ``exp``, user 2 pushes ``exp/lr-1e-4``: the second push is refused."""
    url, endpoint = remote_url
    a, _ = pushed(tmp_path, url, endpoint)
    a.create_branch("exp")
    a.push(refs=["exp"])
    b, _ = Repo.clone(url, tmp_path / "b", endpoint_url=endpoint)
    b.refs.delete("refs/heads/exp")
    b.create_branch("exp/lr-1e-4")
    with pytest.raises(ConflictError, match="'exp' exists there"):
        b.push(refs=["exp/lr-1e-4"])
    b.create_branch("x/y")
    b.push(refs=["x/y"])
    a.create_branch("x")
    with pytest.raises(ConflictError, match="refs exist below it there"):
        a.push(refs=["x"])
    assert set(open_remote(open_context(a.path)).list_refs()) == {"refs/heads/main", "refs/heads/exp", "refs/heads/x/y"}
    assert Repo.clone(url, tmp_path / "c", endpoint_url=endpoint)[0].fsck() == []


@pytest.mark.parametrize("remote_url", ["s3"], indirect=True)
def test_conflicting_and_unnamable_remote_refs_are_skipped_and_named(
    tmp_path: Path, remote_url: tuple[str, str | None]
) -> None:
    """F12 (S3 holds both ``exp`` and ``exp/x``, as two older clients could leave it) and F17
    (remote branches ``HEAD`` and ``-x``): clone and fetch take the refs they can."""
    url, endpoint = remote_url
    a, ids = pushed(tmp_path, url, endpoint)
    transport = open_remote(open_context(a.path)).transport
    for branch in ("exp", "exp/x", "HEAD", "-x"):
        transport.put(encode_ref("refs/heads/" + branch), f"{ids[0]}\n".encode())
    result = _cli("clone", url, str(tmp_path / "b"), "--endpoint-url", endpoint or "", code=0)
    for skipped in ("exp/x", "HEAD", "-x"):
        assert f"refs/heads/{skipped}:" in result.stderr
    b = Repo(tmp_path / "b")
    assert b.branches() == {"main": ids[0], "exp": ids[0]}
    assert set(b.refs.list("refs/remotes/origin/")) == {"main", "exp"}
    assert "skipped" in _cli("--repo", str(tmp_path / "b"), "fetch", code=0).stderr


def test_push_to_a_folder_remote_that_went_away_is_refused(tmp_path: Path) -> None:
    """Newcomer item 3: the share is unmounted (or an empty mount point is left): push must not
    create a fresh remote there, since origin/main records that the remote had history."""
    url = str(tmp_path / "share")
    a, ids = pushed(tmp_path, url, None)
    os.rename(tmp_path / "share", tmp_path / "share_offline")
    a.commit(epoch_files(tmp_path / "work" / "e2", 2), message="epoch 2")
    with pytest.raises(StorageError, match="holds no ckstore repository, but origin/main was at"):
        a.push()
    assert not (tmp_path / "share").exists()
    (tmp_path / "share").mkdir()  # an empty mount point
    result = _cli("--repo", str(tmp_path / "a"), "push", code=7)
    assert "origin/main" in result.stderr
    assert list((tmp_path / "share").iterdir()) == []
    os.rmdir(tmp_path / "share")
    os.rename(tmp_path / "share_offline", tmp_path / "share")  # back: the push goes through
    assert a.push().objects > 0


def test_a_first_push_still_creates_the_folder(tmp_path: Path) -> None:
    a, _ = make_repo(tmp_path / "a", tmp_path / "work", range(1, 2))
    a.add_remote("origin", str(tmp_path / "new"))
    assert a.push().objects > 0 and (tmp_path / "new" / "ckstore-remote.json").is_file()


def test_a_remote_pack_removed_under_a_ref_is_reported_by_fetch(tmp_path: Path) -> None:
    """The ref's commit vanished from every pack: fetch fails on that ref, naming it."""
    url = str(tmp_path / "remote")
    a, _ = pushed(tmp_path, url, None)
    for pack in (tmp_path / "remote" / PACKS).iterdir():
        pack.unlink()
    for index in (tmp_path / "remote" / "indexes").iterdir():
        index.unlink()
    with pytest.raises(IntegrityError, match="refs/heads/main.*no pack"):
        Repo.clone(url, tmp_path / "b")


def test_push_fast_forwards_over_a_commit_local_retention_pruned(
    tmp_path: Path, remote_url: tuple[str, str | None]
) -> None:
    """A push killed after the remote's ref moved but before the tracking ref did leaves the
    remote at a commit the tracking ref does not protect; local retention then prunes it. The
    local branch still descends from it (the pruned record says so): later pushes must go on,
    not be refused as non-fast-forward forever (found by the soak: 644 of 1,030 pushes refused)."""
    url, endpoint = remote_url
    a = Repo.init(tmp_path / "a", chunk_size=CHUNK)
    a.add_remote("origin", url, endpoint)
    ids = [a.commit(epoch_files(tmp_path / "work" / "e1", 1), message="epoch 1")]
    a.wait()
    a.push()
    ids.append(a.commit(epoch_files(tmp_path / "work" / "e2", 2), message="epoch 2"))
    a.wait()
    a.push()
    ctx = open_context(a.path)
    ctx.refs.update("refs/remotes/origin/main", ids[0])  # as the killed push left it
    for e in (3, 4):
        ids.append(a.commit(epoch_files(tmp_path / "work" / f"e{e}", e), message=f"epoch {e}"))
        a.wait()
    a.gc(keep_last=1, prune_now=True)
    assert not open_context(a.path).store.has(ids[1])  # epoch 2, where the remote is, is gone here
    a.push()
    clone, _ = Repo.clone(url, tmp_path / "clone", endpoint_url=endpoint)
    assert clone.branches()["main"] == ids[3]
    assert_checks_out(clone, ids[3], tmp_path / "out", tmp_path / "work" / "e4")


def test_a_clone_that_skipped_a_damaged_ref_is_resumed_by_the_same_clone(tmp_path: Path) -> None:
    """A clone whose remote names a missing commit keeps the branches it could fetch; running
    the same clone again is not blocked ("a repository already exists") but resumes, and once
    the remote is repaired it completes."""
    url = str(tmp_path / "remote")
    a, ids = pushed(tmp_path, url, None)
    ghost = tmp_path / "remote" / "refs" / "heads" / "ghost"
    ghost.write_text("ab" * 32 + "\n")
    _cli("clone", url, str(tmp_path / "c"), code=4)
    assert (tmp_path / "c" / "clone-incomplete").is_file()
    result = _cli("clone", url, str(tmp_path / "c"), code=4)  # again: resumed, still skipping
    assert "already exists" not in result.stderr and "refs/heads/ghost" in result.stderr
    a.create_branch("ghost")
    ghost.unlink()
    a.push(refs=["ghost"])  # the remote is repaired
    _cli("clone", url, str(tmp_path / "c"), code=0)
    c = Repo(tmp_path / "c")
    assert set(c.branches()) == {"main", "ghost"} and c.fsck(read_data=True) == []
    assert not (tmp_path / "c" / "clone-incomplete").exists()
    result = _cli("clone", url, str(tmp_path / "c"), code=6)  # a complete clone is not cloned into
    assert "already exists" in result.stderr
