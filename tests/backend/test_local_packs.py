"""Local packs (ckstore/backend/local_packs.py, docs/format.md 3.1 and rule 8.8): a large batch
writes its new objects into one pack; compaction settles the packs it replaced objects of, gc spreads
packs into loose objects; every read finds an object in either place, also while a pack disappears
under it."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

import blake3
import pytest
import torch

from ckstore.backend import local_settle
from ckstore.backend.local import LocalBackend
from ckstore.backend.local_packs import PACK_FOLDER
from ckstore.errors import IntegrityError
from ckstore.format.ids import key_object_id
from ckstore.format.settings import PACKS_VERSION
from ckstore.repo import Repo
from ckstore.repository.store import ObjectStore, object_key
from tests.helpers import checkpoint, flip_bit, leftover_temp_files, save_st, tree_digest
from tests.pagecache import cached_bytes, cached_bytes_of, cached_clean, needs_fadvise


@pytest.fixture
def packing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every batch packs, however small (the default needs 8 MiB)."""
    monkeypatch.setattr(LocalBackend, "pack_min_bytes", 0)


@pytest.fixture
def spreading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settling spreads every object loose, however small (the default keeps small ones packed)."""
    monkeypatch.setattr(local_settle, "SMALL_OBJECT", 0)


def packs_of(repo: Repo) -> list[Path]:
    folder = repo.path / PACK_FOLDER  # type: ignore[operator]
    return sorted(folder.glob("*.pack")) if folder.is_dir() else []


def loose_ids(repo: Repo) -> set[str]:
    root = repo.path / "objects"  # type: ignore[operator]
    return {p.parent.name + p.name for p in root.glob("[0-9a-f][0-9a-f]/*") if not p.name.startswith(".")}


def read_errors_while(reader: Repo, oid: str, action: Callable[[], object]) -> list[BaseException]:
    """What reading every chunk of ``oid`` over and over raised while ``action`` ran."""
    ids = [c.id for c in reader.read_commit(oid).all_chunks()]
    errors: list[BaseException] = []
    stop = threading.Event()

    def read_all() -> None:
        while not stop.is_set():
            try:
                for chunk in ids:
                    reader.backend.get(object_key(chunk))
            except BaseException as exc:  # noqa: BLE001 (collected and returned)
                errors.append(exc)
                return

    thread = threading.Thread(target=read_all)
    thread.start()
    try:
        action()
    finally:
        stop.set()
        thread.join()
    return errors


def commit_epoch(repo: Repo, root: Path, seed: int) -> tuple[str, dict[str, str]]:
    src = root / f"epoch{seed}"
    checkpoint(src / "model.safetensors", seed)
    return repo.commit(src, message=f"epoch {seed}"), tree_digest(src)


def fresh(tmp_path: Path, compact: bool = False) -> Repo:
    repo = Repo.init(tmp_path / "repo")
    repo.compact_after_commit = compact
    return repo


def test_object_keys_and_ids_map_both_ways() -> None:
    oid = "ab" * 32
    assert key_object_id(object_key(oid)) == oid
    assert key_object_id("refs/heads/main") is None and key_object_id("objects/ab/cd") is None


def test_a_commit_writes_one_pack_that_reads_back_bit_exact(packing: None, tmp_path: Path) -> None:
    repo = fresh(tmp_path)
    oid, digest = commit_epoch(repo, tmp_path, 1)
    packs = packs_of(repo)
    assert len(packs) == 1
    chunks = {c.id for c in repo.read_commit(oid).all_chunks()}
    assert chunks and not chunks & loose_ids(repo)  # every chunk is in the pack; the manifest is loose
    assert repo.config.version == PACKS_VERSION  # upgraded before the pack was installed
    assert json.loads((repo.path / "config.json").read_text())["version"] == PACKS_VERSION  # type: ignore[operator]
    assert chunks <= set(repo.store.iter_ids())
    repo.checkout(oid, tmp_path / "out")
    assert tree_digest(tmp_path / "out") == digest
    assert repo.fsck(read_data=True) == []
    assert not leftover_temp_files(repo.path)  # type: ignore[arg-type]


def test_compaction_spreads_the_parents_pack_into_loose_objects(packing: None, spreading: None, tmp_path: Path) -> None:
    """The parent's pack, whose chunks compaction replaced, is spread loose; the tip's, of which it
    replaced nothing, stays as the commit wrote it (the next compaction replaces it)."""
    repo = Repo.init(tmp_path / "repo", chunk_size=4096)  # small chunks: every position is compacted
    first, d1 = commit_epoch(repo, tmp_path, 1)
    (first_pack,) = packs_of(repo)
    second, d2 = commit_epoch(repo, tmp_path, 2)
    repo.wait()
    assert first_pack not in packs_of(repo) and len(packs_of(repo)) == 1
    assert {c.id for c in repo.read_commit(first).all_chunks()} <= loose_ids(repo)
    assert not {c.id for c in repo.read_commit(second).all_chunks()} & loose_ids(repo)
    for oid, digest, out in ((first, d1, "o1"), (second, d2, "o2")):
        repo.checkout(oid, tmp_path / out)
        assert tree_digest(tmp_path / out) == digest
    assert repo.fsck(read_data=True) == []


def test_gc_unpacks_then_deletes_what_no_commit_needs(packing: None, spreading: None, tmp_path: Path) -> None:
    repo = fresh(tmp_path)
    keep, digest = commit_epoch(repo, tmp_path, 1)
    repo.create_branch("scratch", keep)
    repo.switch("scratch")
    dropped, _ = commit_epoch(repo, tmp_path, 2)
    repo.switch("main")
    repo.delete_branch("scratch", force=True)
    assert len(packs_of(repo)) == 2
    report = repo.gc(prune_now=True)
    assert packs_of(repo) == []
    assert report.deleted_objects > 0
    assert not repo.store.has(dropped)
    repo.checkout(keep, tmp_path / "out")
    assert tree_digest(tmp_path / "out") == digest
    assert repo.fsck(read_data=True) == []


def test_a_reader_whose_pack_vanished_finds_the_loose_copy(packing: None, spreading: None, tmp_path: Path) -> None:
    repo = fresh(tmp_path)
    oid, digest = commit_epoch(repo, tmp_path, 1)
    reader = Repo(repo.path)
    chunk = next(iter(reader.read_commit(oid).all_chunks())).id
    assert reader.store.has(chunk)  # the reader has loaded the pack's index
    assert Repo(repo.path).backend.unpack() == 1  # another process spreads and deletes the pack
    assert packs_of(repo) == [] and chunk in loose_ids(repo)
    reader.checkout(oid, tmp_path / "out")
    assert tree_digest(tmp_path / "out") == digest


def test_reads_during_an_unpack_never_fail(packing: None, spreading: None, tmp_path: Path) -> None:
    repo = fresh(tmp_path)
    oid, digest = commit_epoch(repo, tmp_path, 1)
    reader = Repo(repo.path)
    assert read_errors_while(reader, oid, lambda: Repo(repo.path).backend.unpack()) == []
    reader.checkout(oid, tmp_path / "out")
    assert tree_digest(tmp_path / "out") == digest


def test_a_failed_batch_leaves_no_pack(packing: None, tmp_path: Path) -> None:
    repo = fresh(tmp_path)
    with pytest.raises(RuntimeError):
        with repo.store.batch(1 << 30) as staged:
            staged.put_chunk(b"x" * 5000)
            raise RuntimeError("the commit failed")
    assert packs_of(repo) == []
    assert not leftover_temp_files(repo.path)  # type: ignore[arg-type]


def test_a_damaged_pack_is_named_by_fsck(packing: None, tmp_path: Path) -> None:
    repo = fresh(tmp_path)
    oid, _ = commit_epoch(repo, tmp_path, 1)
    pack = packs_of(repo)[0]
    flip_bit(pack, -10)  # inside the table's checksum: the table can no longer be trusted
    problems = Repo(repo.path).fsck()
    assert any("is damaged" in p and pack.name in p for p in problems)
    assert any("is missing" in p for p in problems)  # its objects are not stored as far as readers know


def test_a_corrupt_object_in_a_pack_is_caught_and_the_pack_kept(packing: None, tmp_path: Path) -> None:
    repo = fresh(tmp_path)
    oid, _ = commit_epoch(repo, tmp_path, 1)
    pack = packs_of(repo)[0]
    flip_bit(pack, 200)  # inside the first object's body
    fresh_reader = Repo(repo.path)
    with pytest.raises(IntegrityError):
        fresh_reader.checkout(oid, tmp_path / "out")
    assert fresh_reader.backend.unpack() == 0  # its digest fails: the pack stays for fsck to name
    assert packs_of(repo) == [pack]
    assert any("corrupt" in p for p in fresh_reader.fsck(read_data=True))


def test_small_batches_stay_loose(tmp_path: Path) -> None:
    repo = fresh(tmp_path)
    commit_epoch(repo, tmp_path, 1)  # ~40 KB: below the default threshold
    assert packs_of(repo) == [] and repo.config.version == 2


def test_a_version_1_repository_never_gets_a_pack(packing: None, tmp_path: Path) -> None:
    Repo.init(tmp_path / "old")
    (tmp_path / "old" / "config.json").write_text(
        json.dumps({"ckstore": "repository", "version": 1, "chunk_size": 4096, "zstd_level": 3})
    )
    repo = Repo(tmp_path / "old")
    repo.compact_after_commit = False
    oid, digest = commit_epoch(repo, tmp_path, 1)
    assert packs_of(repo) == [] and Repo(tmp_path / "old").config.version == 1
    repo.checkout(oid, tmp_path / "out")
    assert tree_digest(tmp_path / "out") == digest


def many_files(root: Path, name: str, count: int, start: int = 0) -> Path:
    """A folder of ``count`` tiny files (each its own small object)."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(start, start + count):
        (folder / f"f{i:05d}.txt").write_text(f"{name} file {i}\n")
    return folder


def test_a_commit_of_many_small_files_rests_in_one_pack(tmp_path: Path) -> None:
    repo = fresh(tmp_path, compact=True)
    src = many_files(tmp_path, "small", 300)
    checkpoint(src / "model.safetensors", 1, n=1 << 16)  # 256 KiB tensors: chunks too large to rest packed
    oid = repo.commit(src, message="many files")
    repo.wait()
    chunks = {c.id for c in repo.read_commit(oid).all_chunks()}
    large = {c for c in chunks if (repo.store.stored_size(c) or 0) >= local_settle.SMALL_OBJECT}
    # Compaction replaced nothing in the pack: it stays as the commit wrote it.
    assert large and not large & loose_ids(repo) and len(packs_of(repo)) == 1
    repo.gc()
    assert large <= loose_ids(repo)  # gc and repack re-encode these in place
    assert len(packs_of(repo)) == 1 and len(chunks - large) >= 300
    assert not (chunks - large) & loose_ids(repo)  # 300 small objects: no file each
    repo.checkout(oid, tmp_path / "out")
    assert tree_digest(tmp_path / "out") == tree_digest(src)
    assert repo.fsck(read_data=True) == []


def test_settled_packs_are_merged_so_they_never_pile_up(tmp_path: Path) -> None:
    repo = fresh(tmp_path, compact=True)
    commits = []
    for epoch in range(local_settle.MERGE_AT + 2):
        commits.append(repo.commit(many_files(tmp_path, f"e{epoch}", 70), message=f"epoch {epoch}"))
        repo.wait()
        assert 1 <= len(packs_of(repo)) < local_settle.MERGE_AT
    for i, oid in enumerate(commits):
        repo.checkout(oid, tmp_path / f"out{i}")
        assert tree_digest(tmp_path / f"out{i}") == tree_digest(tmp_path / f"e{i}")
    assert repo.fsck(read_data=True) == []


def test_packs_that_compaction_leaves_whole_are_merged_before_they_pile_up(packing: None, tmp_path: Path) -> None:
    """Compaction leaves a pack of large objects none of which it replaced (the tip's: the next
    run replaces them); packs whose objects no run replaces (a new file each commit, the old ones
    unchanged) are still spread once MERGE_AT of them have piled up."""
    repo = fresh(tmp_path, compact=True)
    src = tmp_path / "grow"
    commits = []
    for epoch in range(local_settle.MERGE_AT + 2):
        save_st(
            src / f"part{epoch}.safetensors",
            {f"t{epoch}": torch.randn(1 << 15, generator=torch.Generator().manual_seed(epoch))},
        )
        commits.append(repo.commit(src, message=f"epoch {epoch}"))
        repo.wait()
        assert 1 <= len(packs_of(repo)) <= local_settle.MERGE_AT
    assert len(packs_of(repo)) < local_settle.MERGE_AT  # merged at least once
    repo.checkout(commits[-1], tmp_path / "out")
    assert tree_digest(tmp_path / "out") == tree_digest(src)
    assert repo.fsck(read_data=True) == []


def test_gc_drops_packed_garbage_and_keeps_the_rest_packed(tmp_path: Path) -> None:
    repo = fresh(tmp_path)
    keep = repo.commit(many_files(tmp_path, "keep", 100), message="keep")
    repo.create_branch("scratch", keep)
    repo.switch("scratch")
    dropped = repo.commit(many_files(tmp_path, "drop", 100, start=1000), message="drop")
    dropped_chunks = {c.id for c in repo.read_commit(dropped).all_chunks()}
    repo.switch("main")
    repo.delete_branch("scratch", force=True)
    before = sum(p.stat().st_size for p in packs_of(repo))
    report = repo.gc(prune_now=True)
    assert report.deleted_objects >= 101
    assert not repo.store.has(dropped) and not any(repo.store.has(c) for c in dropped_chunks)
    assert len(packs_of(repo)) == 1 and sum(p.stat().st_size for p in packs_of(repo)) < before
    assert len(loose_ids(repo)) <= 2  # the kept commit's own objects, too few to gather
    repo.checkout(keep, tmp_path / "out")
    assert tree_digest(tmp_path / "out") == tree_digest(tmp_path / "keep")
    assert repo.fsck(read_data=True) == [] and not leftover_temp_files(repo.path)  # type: ignore[arg-type]


def test_gc_repack_gathers_loose_small_objects_into_a_pack(tmp_path: Path) -> None:
    repo = fresh(tmp_path)
    folder = tmp_path / "one"
    folder.mkdir()
    for step in range(40):  # one tiny file a commit: each batch stays loose
        (folder / "metrics.json").write_text(json.dumps({"step": step}))
        repo.commit(folder, message=f"step {step}")
    assert packs_of(repo) == [] and len(loose_ids(repo)) >= local_settle.GATHER_AT
    repo.gc()  # plain gc frees exactly what its dry run announced: no gather (tests/cli/test_output.py)
    assert packs_of(repo) == []
    repo.gc(repack=True)
    assert len(packs_of(repo)) == 1 and loose_ids(repo) == set()
    assert len(repo.log()) == 40 and repo.fsck(read_data=True) == []


def test_reads_while_a_small_pack_is_rewritten_never_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local_settle, "MERGE_AT", 1)  # every settle rewrites every pack
    repo = fresh(tmp_path)
    oid = repo.commit(many_files(tmp_path, "small", 200), message="small")
    reader = Repo(repo.path)

    def rewrite() -> None:
        for _ in range(20):
            assert Repo(repo.path).backend.unpack() == 1  # the pack is rewritten into a new one

    assert read_errors_while(reader, oid, rewrite) == []
    assert len(packs_of(repo)) == 1 and loose_ids(repo) == {oid}


class _Stop(BaseException):
    """Raised at a chosen mutating step: the gc stops there, as a crash would stop it."""


def test_gc_stopped_at_any_step_of_a_pack_rewrite_loses_nothing_kept(tmp_path: Path) -> None:
    """Every mutating step of a gc that drops packed garbage and rewrites the pack (fsio's seam,
    in process: finally blocks still run, unlike a kill; tests/reliability kills processes)."""
    import shutil

    from ckstore.backend import fsio

    template = fresh(tmp_path / "t")
    keep = template.commit(many_files(tmp_path, "keep", 70), message="keep")
    template.create_branch("scratch", keep)
    template.switch("scratch")
    dropped = template.commit(many_files(tmp_path, "drop", 70, start=1000), message="drop")
    template.switch("main")
    template.delete_branch("scratch", force=True)
    steps = 0

    def count() -> None:
        nonlocal steps
        steps += 1

    probe = Repo(shutil.copytree(template.path, tmp_path / "probe"))
    fsio.observe_steps(count)
    try:
        probe.gc(prune_now=True)
    finally:
        fsio.observe_steps(None)
    assert steps > 70  # the rewrite's writes, renames, deletes and barriers are all steps
    # Every 7th step through the object writes, every step from the pack's install on.
    for stop_at in sorted({*range(0, steps, 7), *range(steps - 16, steps)}):
        work = Repo(shutil.copytree(template.path, tmp_path / f"w{stop_at}"))
        seen = 0

        def stop() -> None:
            nonlocal seen
            seen += 1
            if seen > stop_at:
                raise _Stop

        fsio.observe_steps(stop)
        try:
            with pytest.raises(_Stop):
                work.gc(prune_now=True)
        finally:
            fsio.observe_steps(None)
        after = Repo(work.path)
        assert after.fsck(read_data=True) == [], stop_at
        after.checkout(keep, tmp_path / f"o{stop_at}")
        assert tree_digest(tmp_path / f"o{stop_at}") == tree_digest(tmp_path / "keep"), stop_at
        after.gc(prune_now=True)  # the next gc finishes the job
        assert not after.store.has(dropped) and after.fsck(read_data=True) == [], stop_at
        shutil.rmtree(work.path)  # type: ignore[arg-type]
        shutil.rmtree(tmp_path / f"o{stop_at}")


@needs_fadvise
def test_packed_objects_read_for_the_last_time_leave_the_page_cache_in_steps(tmp_path: Path) -> None:
    """Compaction reads a superseded epoch's pack once (backend.forget_cached after each object):
    the pack's pages go once enough of them were forgotten, aligned to the kernel's folios,
    while the objects not forgotten stay cached and every object still reads back."""
    backend = LocalBackend(tmp_path)
    backend.allow_packs = lambda: True
    size, count = (1 << 20) + 80, 72  # past one 64 MiB step, objects not aligned to folios
    with ObjectStore(backend).batch(expected_bytes=size * count) as staged:
        ids = [staged.put_chunk(os.urandom(size), fast=True).id for _ in range(count)]
    blobs = {oid: backend.get(object_key(oid)) for oid in ids}
    (pack,) = sorted((tmp_path / PACK_FOLDER).glob("*.pack"))
    cached_clean(pack)
    order = sorted(blobs, key=lambda oid: backend.packs.locate(oid).entry.offset)  # type: ignore[union-attr]
    for oid in order[:-4]:
        backend.forget_cached(object_key(oid))
    tail = backend.packs.locate(order[-4]).entry.offset  # type: ignore[union-attr]
    assert cached_bytes_of(pack, 0, tail - (8 << 20)) < 16 << 20  # what the last step has not reached, at most
    assert cached_bytes_of(pack, tail, 4 * size) >= 4 * size - (1 << 20)  # not forgotten: left alone
    assert all(backend.get(object_key(oid)) == data for oid, data in blobs.items())


@needs_fadvise
def test_a_loose_object_forgotten_leaves_the_page_cache(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path)
    oid = blake3.blake3(b"loose").hexdigest()
    backend.put_if_absent(object_key(oid), os.urandom(3 << 20))
    path = tmp_path / object_key(oid)
    cached_clean(path)
    backend.forget_cached(object_key(oid))
    assert cached_bytes(path) == 0


def _epoch_state(step: int) -> dict[str, torch.Tensor]:
    """A slowly moving weight (its older chunks become deltas) and a first-moment-like tensor
    drawn anew every step (no delta pays; the tip's chunks settle whole, replaced loose)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(2 << 20, generator=g) * 0.05 + step * 1e-5 * torch.randn(
        2 << 20, generator=torch.Generator().manual_seed(step + 1)
    )
    return {"w": w, "m": torch.randn(512 << 10, generator=torch.Generator().manual_seed(100 + step)) * 0.01}


def _object_bytes(repo: Repo) -> int:
    """Bytes of every object copy on disk: loose files and packed entries, replaced ones too."""
    root = repo.path / "objects"  # type: ignore[operator]
    loose = sum(p.stat().st_size for p in root.glob("[0-9a-f][0-9a-f]/*") if not p.name.startswith("."))
    return loose + sum(sum(ix.columns()[2]) for ix in repo.backend.packs.indexes())  # type: ignore[attr-defined]


def test_compaction_leaves_the_tips_pack_as_committed(tmp_path: Path) -> None:
    """Compaction replaces none of the tip's chunks (its first moments settle when they are the
    parent's): the tip's pack stays, so the tip is not written again nor pushed out of the page
    cache before the checkout that reads it; the parent's pack, replaced by deltas and settled
    chunks, is rewritten. The next compaction replaces the old tip's chunks and rewrites its pack.
    (The compaction each commit runs; settling a quiet tip, as ``ckstore wait`` does, is apart.)"""
    from ckstore.compaction.compact import compact_branch

    def compact_after_commit() -> None:
        compact_branch(repo._ctx, repo.head_branch)

    repo = fresh(tmp_path)
    first = repo.commit_state(_epoch_state(0))
    (parent_pack,) = packs_of(repo)
    second = repo.commit_state(_epoch_state(1))
    (tip_pack,) = set(packs_of(repo)) - {parent_pack}
    tip_chunks = {c.id for c in repo.read_commit(second).all_chunks()}
    compact_after_commit()
    assert tip_pack in packs_of(repo) and parent_pack not in packs_of(repo)
    assert not tip_chunks & loose_ids(repo)
    assert repo.backend.superseded_bytes() == 0  # type: ignore[attr-defined]
    assert repo.stats().stored_bytes == _object_bytes(repo)
    third = repo.commit_state(_epoch_state(2))
    compact_after_commit()
    assert tip_pack not in packs_of(repo)  # the next compaction replaced most of it: rewritten
    assert repo.stats().stored_bytes == _object_bytes(repo)
    for oid, step in ((first, 0), (second, 1), (third, 2)):
        assert all(torch.equal(repo.load_state(oid)[k], v) for k, v in _epoch_state(step).items())
    assert repo.fsck(read_data=True) == []


def _replace_one(repo: Repo, pack: Path) -> None:
    """Store one large object of ``pack`` loose too, as a re-encoding would (same bytes here)."""
    index = next(ix for ix in repo.backend.packs.indexes() if ix.pack_id == pack.stem)  # type: ignore[attr-defined]
    entry = max(index.in_pack_order(), key=lambda e: e.length)
    key = object_key(entry.id)
    with repo.backend.batch() as staged:
        staged.replace_object(key, repo.backend.get(key))  # type: ignore[attr-defined]


def test_a_pack_with_replaced_objects_rests_only_when_large(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compaction's settle rewrites a pack of which an object was replaced when it is under 1 GiB
    (cheap, and no replaced copy is kept), and leaves a larger one with at most half replaced."""
    repo = fresh(tmp_path)
    repo.commit_state(_epoch_state(0))
    (pack,) = packs_of(repo)
    _replace_one(repo, pack)
    monkeypatch.setattr(local_settle, "RESTING_MIN_BYTES", 0)
    repo.backend.unpack(keep_clean=True)  # type: ignore[attr-defined]
    assert packs_of(repo) == [pack] and repo.backend.superseded_bytes() > 0  # type: ignore[attr-defined]
    assert repo.stats().stored_bytes == _object_bytes(repo)
    monkeypatch.setattr(local_settle, "RESTING_MIN_BYTES", 1 << 30)
    repo.backend.unpack(keep_clean=True)  # type: ignore[attr-defined]
    assert pack not in packs_of(repo)
    assert repo.backend.superseded_bytes() == 0  # type: ignore[attr-defined]
    assert repo.stats().stored_bytes == _object_bytes(repo)
    assert repo.fsck(read_data=True) == []


def test_a_lookup_that_missed_finds_a_pack_installed_since_and_searches_once_when_none_was(
    packing: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    writer = fresh(tmp_path)
    commit_epoch(writer, tmp_path, 1)
    reader = Repo(writer.path)  # another process's view: its own table of packs
    absent = "ab" * 32
    assert not reader.store.has(absent)
    oid, _ = commit_epoch(writer, tmp_path, 2)  # a new pack the reader has not loaded
    new = [c.id for c in writer.read_commit(oid).all_chunks()]
    assert all(reader.store.has(c) for c in new)

    searches: list[str] = []
    packs = reader.backend.packs  # type: ignore[attr-defined]
    for table in packs.indexes():
        original = table.find
        monkeypatch.setattr(table, "find", lambda key, original=original: searches.append(key) or original(key))
    assert not reader.store.has(absent)
    assert len(searches) == len(packs.indexes())  # each table asked once: nothing changed to search again
