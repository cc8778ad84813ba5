"""Repo API: byte-identical round trips, dedup, refs and history, diff, checkout rules, finding a repo."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ckstore.errors import (
    AmbiguousRefError,
    IntegrityError,
    InvalidRefNameError,
    OutputExistsError,
    RefExistsError,
    RefNotFoundError,
    RepoNotFoundError,
    StorageError,
)
from ckstore.repo import Repo
from tests.helpers import (
    TORCH_DTYPES,
    checkpoint,
    flip_bit,
    hf_folder,
    leftover_temp_files,
    make_tensor,
    object_count,
    object_file,
    save_st,
    sha256,
    tree_digest,
)


def assert_round_trip(repo: Repo, ref: str, src: Path, out: Path) -> None:
    """Checking ``ref`` out into ``out`` reproduces every file of ``src`` byte for byte."""
    repo.checkout(ref, out)
    assert tree_digest(out) == tree_digest(src)
    assert tree_digest(out)  # never vacuous


def three_epochs(repo: Repo, tmp_path: Path) -> list[str]:
    return [
        repo.commit(
            checkpoint(tmp_path / f"ep{i}" / "ckpt.safetensors", seed=i), message=f"epoch {i}", metadata={"epoch": i}
        )
        for i in range(3)
    ]


# ---- round trips -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES), ids=lambda d: TORCH_DTYPES[d])
def test_every_dtype_round_trips(repo: Repo, tmp_path: Path, dtype: torch.dtype) -> None:
    src = tmp_path / "src"
    tensors = {
        "big": make_tensor(dtype, (100, 50), 1),  # 5000+ bytes: several 4 KiB chunks for wide dtypes
        "empty": make_tensor(dtype, (0, 3), 3),
        "row": make_tensor(dtype, (8,), 4),
    }
    if TORCH_DTYPES[dtype] != "F4":  # safetensors cannot write a lone packed 4-bit element
        tensors["scalar"] = make_tensor(dtype, (), 2)
    save_st(src / "t.safetensors", tensors, metadata={"format": "pt", "note": "ünïcode ✓"})
    oid = repo.commit(src)
    header = {t.name: t.dtype for t in repo.show(oid)[1].files[0].tensors}
    assert header["big"] == TORCH_DTYPES[dtype] and set(header) == set(tensors)
    assert_round_trip(repo, oid, src, tmp_path / "out")


def test_hf_folder_round_trips(repo: Repo, tmp_path: Path) -> None:
    src = hf_folder(tmp_path / "model")
    oid = repo.commit(src, message="hf")
    kinds = {f.path: f.kind for f in repo.read_commit(oid).files}
    assert kinds["model-00001-of-00002.safetensors"] == "safetensors"
    assert kinds["2_Dense/model.safetensors"] == "safetensors"
    assert kinds["model.safetensors.index.json"] == kinds["special_tokens_map.json"] == "blob"
    assert_round_trip(repo, oid, src, tmp_path / "out")


def test_plain_files_round_trip(repo: Repo, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "deep" / "er").mkdir(parents=True)
    (src / "noise.bin").write_bytes(os.urandom(3 * 4096 + 17))
    (src / "deep" / "er" / "zeros.bin").write_bytes(bytes(50_000))
    (src / "empty").write_bytes(b"")
    oid = repo.commit(src)
    assert_round_trip(repo, oid, src, tmp_path / "out")


def test_single_file_commit_uses_its_name(repo: Repo, tmp_path: Path) -> None:
    path = checkpoint(tmp_path / "a" / "ckpt.safetensors", seed=1)
    oid = repo.commit(path)
    assert [f.path for f in repo.read_commit(oid).files] == ["ckpt.safetensors"]
    repo.checkout(oid, tmp_path / "out")
    assert sha256(tmp_path / "out" / "ckpt.safetensors") == sha256(path)


# ---- dedup -----------------------------------------------------------------------------------


def test_identical_commit_writes_no_chunk(repo: Repo, tmp_path: Path) -> None:
    src = hf_folder(tmp_path / "model")
    first = repo.commit(src)
    before = object_count(repo)
    second = repo.commit(src, message="again")
    assert repo.read_commit(second).added_bytes == 0
    assert repo.read_commit(first).added_bytes > 0
    assert object_count(repo) == before + 1  # only the new commit object itself
    assert repo.read_commit(second).parents == (first,)


def test_changing_one_tensor_stores_only_its_chunks(repo: Repo, tmp_path: Path) -> None:
    repo.compact_after_commit = False  # the figures as the commit itself stored them
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(5000, generator=g), "b": torch.randn(3000, generator=g), "c": torch.randn(10)}
    first = repo.commit(save_st(tmp_path / "1" / "m.safetensors", tensors))
    before = set(repo.store.iter_ids())
    tensors["b"] = torch.randn(3000, generator=g)  # 12000 bytes: 3 chunks of at most 4096
    second = repo.commit(save_st(tmp_path / "2" / "m.safetensors", tensors))
    new = set(repo.store.iter_ids()) - before
    b_chunks = {c.id for c in repo.read_commit(second).files[0].tensors[1].chunks}
    assert new == b_chunks | {second}
    assert len(b_chunks) == 3
    assert repo.read_commit(second).added_bytes == sum(repo.store.stored_size(c) or 0 for c in b_chunks)
    changes = {c.name: c for c in repo.diff(first, second)}
    assert {n: c.status for n, c in changes.items()} == {"a": "unchanged", "b": "changed", "c": "unchanged"}
    assert changes["b"].stored_bytes == repo.read_commit(second).added_bytes
    assert changes["a"].stored_bytes == 0


def test_same_tensor_at_another_offset_dedups(repo: Repo, tmp_path: Path) -> None:
    # Chunks are cut from each tensor's start, so a tensor moved within the file still dedups.
    shared = make_tensor(torch.float32, (3000,), 7)
    repo.commit(save_st(tmp_path / "1" / "m.safetensors", {"x": shared}))
    oid = repo.commit(save_st(tmp_path / "2" / "m.safetensors", {"a_first": torch.ones(333), "x": shared}))
    x = next(t for t in repo.read_commit(oid).files[0].tensors if t.name == "x")
    added = {c.id for c in x.chunks} - set(repo.store.iter_ids())
    assert not added
    diff = {c.name: c.status for c in repo.diff("HEAD~1", "HEAD")}
    assert diff == {"a_first": "added", "x": "unchanged"}


# ---- metadata and provenance -----------------------------------------------------------------


def test_metadata_keeps_types(repo: Repo, tmp_path: Path) -> None:
    meta = {
        "epoch": 3,
        "loss": 0.125,
        "final": True,
        "name": "run-7",
        "none": None,
        "nested": {"lrs": [1e-3, 1e-4], "big": 2**70},
        "pair": (1, 2),
    }
    oid = repo.commit(checkpoint(tmp_path / "c.safetensors", 0), metadata=meta)
    got = Repo(repo.path).read_commit(oid).decoded_metadata()  # read back from disk, not the cache
    assert got == meta
    assert type(got["epoch"]) is int and type(got["loss"]) is float and got["final"] is True
    assert type(got["pair"]) is tuple


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def test_provenance(repo: Repo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "work"
    work.mkdir()
    _git(work, "init", "-q")
    _git(work, "commit", "-q", "--allow-empty", "-m", "x")
    monkeypatch.chdir(work)
    oid = repo.commit(checkpoint(tmp_path / "c.safetensors", 0))
    prov = repo.read_commit(oid).provenance
    assert prov["git_commit"] == _git(work, "rev-parse", "HEAD")
    assert prov["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert {"ckstore", "python", "hostname"} <= set(prov)
    outside = tmp_path / "outside"
    outside.mkdir()
    monkeypatch.chdir(outside)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    prov = repo.read_commit(repo.commit(checkpoint(tmp_path / "c.safetensors", 1))).provenance
    assert "git_commit" not in prov


# ---- resolve, log, show ----------------------------------------------------------------------


def test_resolve_forms(repo: Repo, tmp_path: Path) -> None:
    c0, c1, c2 = three_epochs(repo, tmp_path)
    repo.create_tag("v1", c1)
    repo.create_branch("old", c0)
    cases = {
        c2: c2,
        c1[:6]: c1,
        c0[:20]: c0,
        "main": c2,
        "HEAD": c2,
        "v1": c1,
        "old": c0,
        "refs/tags/v1": c1,
        "refs/heads/main": c2,
        "HEAD~2": c0,
        "main~1": c1,
        "main^": c1,
        "main^^": c0,
        "HEAD~": c1,
        "HEAD~0": c2,
        "v1~1": c0,
        "main~1~1": c0,
        "main~1^": c0,
    }
    for spec, expected in cases.items():
        assert repo.resolve(spec) == expected, spec
    for spec in ("nope", "HEAD~3", "old^", "f" * 64, "abcdef0"):
        with pytest.raises(RefNotFoundError):
            repo.resolve(spec)
    for spec in ("a..b", "-x", "a b"):
        with pytest.raises(InvalidRefNameError):
            repo.resolve(spec)


def test_ambiguous_prefix(repo: Repo, tmp_path: Path) -> None:
    c0, c1, _ = three_epochs(repo, tmp_path)
    # A chunk under a name sharing c0's prefix does not make the prefix ambiguous (commits only)...
    chunk = next(c.id for c in repo.read_commit(c0).all_chunks())
    twin = c0[:10] + "0" * 54 if not c0.endswith("0" * 54) else c0[:10] + "1" * 54
    shutil.copy(object_file(repo, chunk), object_file(repo, twin))
    assert repo.resolve(c0[:10]) == c0
    # ...but a second commit object under such a name does.
    object_file(repo, twin).write_bytes(object_file(repo, c1).read_bytes())
    with pytest.raises(AmbiguousRefError):
        repo.resolve(c0[:10])
    assert repo.resolve(c0) == c0  # a full id is never ambiguous


def test_log_order_and_fields(repo: Repo, tmp_path: Path) -> None:
    ids = three_epochs(repo, tmp_path)
    log = repo.log()
    assert [e.id for e in log] == ids[::-1]
    assert [e.commit.message for e in log] == ["epoch 2", "epoch 1", "epoch 0"]
    assert [e.commit.decoded_metadata() for e in log] == [{"epoch": 2}, {"epoch": 1}, {"epoch": 0}]
    size = (tmp_path / "ep0" / "ckpt.safetensors").stat().st_size
    assert all(e.commit.logical_bytes == size and e.commit.added_bytes > 0 for e in log)
    assert all(e.pruned_parents == () for e in log)
    assert [e.id for e in repo.log("main~1")] == ids[1::-1]
    assert log[0].commit.time > log[1].commit.time > log[2].commit.time


def test_show(repo: Repo, tmp_path: Path) -> None:
    oid = repo.commit(hf_folder(tmp_path / "m"), message="msg", metadata={"k": 1})
    got, commit = repo.show("HEAD")
    assert got == oid and commit.message == "msg" and commit.branch == "main"
    shard = next(f for f in commit.files if f.path == "model-00002-of-00002.safetensors")
    # Listed in the order of their data in the file (safetensors puts wider dtypes first).
    assert [(t.name, t.dtype, t.shape) for t in shard.tensors] == [
        ("head.weight", "F32", (16, 300)),
        ("head.bias", "BF16", (300,)),
    ]


# ---- diff ------------------------------------------------------------------------------------


def test_diff_statuses_and_costs(repo: Repo, tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    t = {
        "keep": torch.randn(2000, generator=g),
        "change": torch.randn(2000, generator=g),
        "drop": torch.randn(10, generator=g),
    }
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    save_st(a_dir / "m.safetensors", t)
    (a_dir / "notes.txt").write_text("same")
    (a_dir / "old.txt").write_text("old")
    a = repo.commit(a_dir)
    t2 = {"keep": t["keep"], "change": torch.randn(2000, generator=g), "new": torch.randn(3000, generator=g)}
    save_st(b_dir / "m.safetensors", t2)
    (b_dir / "notes.txt").write_text("same")
    b = repo.commit(b_dir)
    got = {(c.path, c.name): c for c in repo.diff(a, b)}
    assert {k: c.status for k, c in got.items()} == {
        ("m.safetensors", "keep"): "unchanged",
        ("m.safetensors", "change"): "changed",
        ("m.safetensors", "new"): "added",
        ("m.safetensors", "drop"): "removed",
        ("notes.txt", None): "unchanged",
        ("old.txt", None): "removed",
    }
    assert got[("m.safetensors", "change")].stored_bytes > 0
    assert got[("m.safetensors", "new")].stored_bytes > 0
    assert got[("m.safetensors", "keep")].stored_bytes == got[("notes.txt", None)].stored_bytes == 0
    assert got[("m.safetensors", "drop")].stored_bytes == 0
    assert all(c.status == "unchanged" and c.stored_bytes == 0 for c in repo.diff(b, b))


# ---- branches and tags -----------------------------------------------------------------------


def test_branches_and_tags(repo: Repo, tmp_path: Path) -> None:
    c0, c1, c2 = three_epochs(repo, tmp_path)
    assert repo.branches() == {"main": c2} and repo.tags() == {}
    assert repo.create_branch("exp/a", "HEAD~1") == c1
    assert repo.create_tag("best", c0) == c0
    with pytest.raises(RefExistsError):
        repo.create_tag("best", c2)
    with pytest.raises(RefExistsError):
        repo.create_branch("main", c0)
    with pytest.raises(InvalidRefNameError):
        repo.create_branch("bad..name")
    assert repo.branches() == {"main": c2, "exp/a": c1} and repo.tags() == {"best": c0}
    side = repo.commit(checkpoint(tmp_path / "s.safetensors", 9), branch="exp/a")
    assert repo.read_commit(side).parents == (c1,) and repo.branches()["exp/a"] == side
    assert repo.resolve("HEAD") == c2  # committing to another branch leaves HEAD's branch alone
    repo.delete_branch("exp/a")
    repo.delete_tag("best")
    assert repo.branches() == {"main": c2} and repo.tags() == {}
    with pytest.raises(RefNotFoundError):
        repo.delete_branch("exp/a")
    with pytest.raises(RefNotFoundError):
        repo.delete_tag("best")


# ---- checkout --------------------------------------------------------------------------------


def test_checkout_refuses_to_overwrite_and_writes_nothing(repo: Repo, tmp_path: Path) -> None:
    src = hf_folder(tmp_path / "m")
    oid = repo.commit(src)
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("mine")
    with pytest.raises(OutputExistsError, match="config.json"):
        repo.checkout(oid, out)
    assert [p.name for p in out.rglob("*")] == ["config.json"]
    assert (out / "config.json").read_text() == "mine"
    result = repo.checkout(oid, out, force=True)
    assert "config.json" in result.written
    assert tree_digest(out) == tree_digest(src)


def test_checkout_fails_cleanly_when_an_early_flush_fails(
    repo: Repo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checkout flushes each output as it writes (fsio.EarlyFlush); a writeback error seen by an
    early flush is reported once per descriptor, so the checkout must fail on it, not on the
    final fsync (which would not see it again), and leave no file behind."""
    import errno

    import ckstore.backend.fsio as fsio

    src = hf_folder(tmp_path / "m")
    oid = repo.commit(src)
    monkeypatch.setattr(fsio, "EARLY_FLUSH_BYTES", 1)
    out = tmp_path / "out"
    assert_round_trip(repo, oid, src, out)  # flushing after every piece changes no byte

    def failing(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", failing)
    failed = tmp_path / "failed"
    with pytest.raises(StorageError, match="Input/output error"):
        repo.checkout(oid, failed, fsync=True)
    assert [p for p in failed.rglob("*") if p.is_file()] == []


def test_checkout_with_fsync_makes_every_file_and_folder_durable_and_without_it_none(
    repo: Repo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--fsync`` (``fsync=True``) syncs each output before it is renamed into place, then the
    folders; the default writes the same bytes and leaves writeback to the kernel, as cp does."""
    src = hf_folder(tmp_path / "m")
    (src / "sub").mkdir()
    (src / "sub" / "notes.txt").write_text("nested")
    oid = repo.commit(src)
    synced: list[str] = []
    real_fsync, real_fdatasync = os.fsync, os.fdatasync

    def record(real):  # type: ignore[no-untyped-def]
        def call(fd: int) -> None:
            synced.append(os.readlink(f"/proc/self/fd/{fd}"))
            real(fd)

        return call

    monkeypatch.setattr(os, "fsync", record(real_fsync))
    monkeypatch.setattr(os, "fdatasync", record(real_fdatasync))
    plain = tmp_path / "plain"
    repo.checkout(oid, plain)
    assert [p for p in synced if p.startswith(str(plain))] == []
    assert tree_digest(plain) == tree_digest(src)
    durable = tmp_path / "durable"
    result = repo.checkout(oid, durable, fsync=True)
    assert tree_digest(durable) == tree_digest(src)
    files = {p for p in synced if ".ckstore-tmp" in p}
    assert len({p.rsplit(".", 3)[0] for p in files}) == len(result.written)  # one temporary per output
    assert {str(durable), str(durable / "sub")} <= set(synced)


def test_checkout_skips_identical_files(repo: Repo, tmp_path: Path) -> None:
    src = hf_folder(tmp_path / "m")
    oid = repo.commit(src)
    out = tmp_path / "out"
    first = repo.checkout(oid, out)
    mtimes = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    second = repo.checkout(oid, out)
    assert second.written == [] and sorted(second.unchanged) == sorted(first.written)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == mtimes


def test_checkout_only(repo: Repo, tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    tensors = {
        "model.w": torch.randn(40, 30, generator=g),
        "optim.m": torch.randn(2000, generator=g),
        "model.b": torch.arange(5, dtype=torch.int64),
        "optim.step": torch.tensor(7),
    }
    src = save_st(tmp_path / "src" / "ckpt.safetensors", tensors, metadata={"epoch": "4"})
    save_st(tmp_path / "src" / "opt_only.safetensors", {"optim.x": torch.ones(3)})
    (tmp_path / "src" / "config.json").write_text("{}")
    oid = repo.commit(tmp_path / "src")
    out = tmp_path / "out"
    repo.checkout(oid, out, only=["model.*"])
    loaded = load_file(str(out / "ckpt.safetensors"))
    assert sorted(loaded) == ["model.b", "model.w"]
    for name, value in loaded.items():
        assert torch.equal(value, tensors[name]) and value.dtype == tensors[name].dtype
    with safe_open(str(out / "ckpt.safetensors"), "pt") as f:
        assert f.metadata() == {"epoch": "4"}
    assert not (out / "opt_only.safetensors").exists()  # no tensor matched: file left out
    assert (out / "config.json").read_text() == "{}"
    assert sha256(src) != sha256(out / "ckpt.safetensors")
    every = tmp_path / "every"
    repo.checkout(oid, every, only=["model.*", "optim.*"])  # all tensors match: the exact file
    assert sha256(every / "ckpt.safetensors") == sha256(src)


def test_failed_checkout_leaves_no_partial_file(repo: Repo, tmp_path: Path) -> None:
    src = tmp_path / "src"
    checkpoint(src / "ckpt.safetensors", 0)
    oid = repo.commit(src)
    optim = next(t for t in repo.read_commit(oid).files[0].tensors if t.name == "optim.m")
    flip_bit(object_file(repo, optim.chunks[-1].id), -3)
    out = tmp_path / "out"
    with pytest.raises(IntegrityError) as info:
        repo.checkout(oid, out)
    message = str(info.value)
    assert optim.chunks[-1].id in message and "ckpt.safetensors" in message and "optim.m" in message
    assert not (out / "ckpt.safetensors").exists()
    assert leftover_temp_files(out) == []
    # --only that avoids the damaged tensor still works.
    repo.checkout(oid, out, only=["model.*"])
    assert sorted(load_file(str(out / "ckpt.safetensors"))) == ["model.b", "model.w"]


def test_checkout_refuses_directory_in_the_way(repo: Repo, tmp_path: Path) -> None:
    oid = repo.commit(checkpoint(tmp_path / "c.safetensors", 0))
    (tmp_path / "out" / "c.safetensors").mkdir(parents=True)
    with pytest.raises(OutputExistsError):
        repo.checkout(oid, tmp_path / "out")


# ---- finding a repository --------------------------------------------------------------------


def test_find(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CKSTORE_REPO", raising=False)
    project = tmp_path / "project"
    Repo.init(project / ".ckstore")
    deep = project / "a" / "b"
    deep.mkdir(parents=True)
    other = Repo.init(tmp_path / "other")
    assert Repo.find(start=deep).path == project / ".ckstore"
    assert Repo.find(start=project).path == project / ".ckstore"
    monkeypatch.chdir(deep)
    assert Repo.find().path == project / ".ckstore"
    assert Repo.find(tmp_path / "other").path == other.path
    assert Repo.find(project).path == project / ".ckstore"  # the folder holding .ckstore works too
    monkeypatch.setenv("CKSTORE_REPO", str(tmp_path / "other"))
    assert Repo.find().path == other.path
    assert Repo.find(project / ".ckstore").path == project / ".ckstore"  # --repo beats the environment
    monkeypatch.delenv("CKSTORE_REPO")
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    with pytest.raises(RepoNotFoundError):
        Repo.find(start=lonely)
    with pytest.raises(RepoNotFoundError):
        Repo.find(tmp_path / "nowhere")
    monkeypatch.setenv("CKSTORE_REPO", str(lonely))
    with pytest.raises(RepoNotFoundError):
        Repo.find()


def test_init_refuses_existing(tmp_path: Path) -> None:
    Repo.init(tmp_path / "r")
    with pytest.raises(RefExistsError):
        Repo.init(tmp_path / "r")


def test_memory_repo_round_trip(tmp_path: Path) -> None:
    repo = Repo.memory(chunk_size=4096)
    src = hf_folder(tmp_path / "m")
    oid = repo.commit(src)
    assert_round_trip(repo, oid, src, tmp_path / "out")
    assert repo.fsck(read_data=True) == []


def test_commit_losing_the_race_to_create_a_branch_is_reparented(
    repo: Repo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert repo.path is not None
    other = Repo(repo.path)
    real_update = repo.refs.update
    won: list[str] = []

    def update_after_rival(*args: object, **kwargs: object) -> None:
        if not won:  # another process creates the branch between our read and our update
            won.append(other.commit(checkpoint(tmp_path / "b" / "c.safetensors", 2), branch="new"))
        real_update(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(repo.refs, "update", update_after_rival)
    mine = repo.commit(checkpoint(tmp_path / "a" / "c.safetensors", 1), branch="new")
    assert repo.read_commit(mine).parents == (won[0],)
    assert repo.branches()["new"] == mine


def test_commit_and_checkout_of_many_chunks_run_no_garbage_collection(tmp_path: Path) -> None:
    """A collection traverses every object of the process (a training script's too): commit and
    checkout of files create tens of objects per chunk and free them by reference counting, so
    they run none, and leave the interpreter's collector as they found it."""
    import gc
    import threading

    repo = Repo.init(tmp_path / "r", chunk_size=4096)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_st(folder / "model.safetensors", {f"w{i}": torch.randn(150_000) for i in range(8)})
    repo.checkout(repo.commit([folder / "model.safetensors"], message="warm"), tmp_path / "warm")
    repo.wait()
    save_st(folder / "model.safetensors", {f"w{i}": torch.randn(150_000) for i in range(8)})
    collections: list[str] = []
    running = ""

    def note(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and running and threading.current_thread() is threading.main_thread():
            collections.append(running)

    gc.callbacks.append(note)
    try:
        gc.collect()
        running = "commit"
        oid = repo.commit([folder], message="many chunks")
        running = ""
        repo.wait()
        gc.collect()
        running = "checkout"
        repo.checkout(oid, tmp_path / "out")
        running = ""
    finally:
        gc.callbacks.remove(note)
    assert collections.count("commit") <= 1 and collections.count("checkout") <= 1
    assert gc.isenabled()
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
