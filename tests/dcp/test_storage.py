"""Distributed checkpoints through torch.distributed.checkpoint (ckstore.dcp), with real process
groups: FSDP2 on CPU with gloo, launched by torchrun (tests/dcp/worker.py), plus in-process
checks of the record, non-tensor items and the format's versioning."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

import ckstore
from ckstore.errors import IntegrityError, UnsupportedFormatError
from ckstore.format.manifest import MANIFEST_VERSION, decode_commit, encode_commit
from tests.helpers import torchrun_script

WORKER = Path(__file__).parent / "worker.py"


def torchrun(nproc: int, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return torchrun_script(WORKER, nproc, *args, check=check)


def report(out: Path) -> dict[str, Any]:
    return json.loads((out / "report.json").read_text())


def checkout_full(repo: ckstore.Repo, ref: str, out: Path) -> dict[str, torch.Tensor]:
    repo.checkout(ref, out)
    return load_file(str(out / "model.safetensors"))


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[ckstore.Repo, Path, dict[str, Any]]:
    """Two ranks train three steps, saving each (the last with async_save), then a fresh model
    resumes from the first commit."""
    root = tmp_path_factory.mktemp("dcp")
    repo = ckstore.Repo.init(root / "repo")
    out = root / "train"
    out.mkdir()
    torchrun(2, "train", str(repo.path), str(out), "main")
    return repo, out, report(out)


def test_resume_at_the_same_world_size_continues_with_identical_losses(trained: Any) -> None:
    repo, _, rep = trained
    assert rep["resumed"] == rep["losses"][1:]  # bit-exact: same floats after the load
    assert rep["step"] == 0 and dict(rep["run"]) == {"name": "test", "lr": 1e-3, "betas": [0.9, 0.999]}
    assert len(rep["commits"]) == 3 and [e.id for e in repo.log()] == rep["commits"][::-1]
    assert rep["async_blocked_s"] < 5


def test_one_save_is_one_commit_recording_every_rank(trained: Any) -> None:
    repo, _, rep = trained
    commit = repo.read_commit(rep["commits"][-1])
    assert commit.dcp is not None and commit.dcp.world_size == 2
    assert [f.path for f in commit.files] == ["dcp/rank-00000.safetensors", "dcp/rank-00001.safetensors"]
    weight = next(t for t in commit.dcp.tensors if t.fqn == "model.l1.weight")
    assert weight.shape == (64, 32) and sorted(p.rank for p in weight.pieces) == [0, 1]
    assert [p.offsets for p in weight.pieces] == [(0, 0), (32, 0)]
    tp = next(t for t in commit.dcp.tensors if t.fqn == "tp")
    assert [p.offsets for p in tp.pieces] == [(0, 0), (0, 8)]
    assert {o.fqn: o.encoding for o in commit.dcp.objects}["run.betas"] == "value"
    assert commit.decoded_metadata() == {"step": 2}
    assert repo.fsck(read_data=True) == []


def test_checkout_writes_the_full_tensors(trained: Any, tmp_path: Path) -> None:
    repo, out, rep = trained
    full = checkout_full(repo, rep["commits"][-1], tmp_path / "co")
    expected = load_file(str(out / "full.safetensors"))
    assert_same_tensors({k: v for k, v in full.items() if k in expected}, expected)
    assert {"replicated", "replicated_copy"} <= set(full)
    repo.checkout(rep["commits"][-1], tmp_path / "sharded", shard_size="20KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    merged: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        merged.update(load_file(str(tmp_path / "sharded" / shard)))
    assert_same_tensors(merged, full)


def test_replicated_tensors_are_stored_once(trained: Any) -> None:
    repo, _, rep = trained
    commit = repo.read_commit(rep["commits"][0])
    assert commit.dcp is not None
    by_fqn = {t.fqn: t for t in commit.dcp.tensors}
    assert len(by_fqn["replicated"].pieces) == 1  # every rank holds it; one copy is written
    chunks = {(f.path, t.name): t.chunks for f in commit.files for t in f.tensors}
    a = chunks[(by_fqn["replicated"].pieces[0].file, by_fqn["replicated"].pieces[0].tensor)]
    b = chunks[(by_fqn["replicated_copy"].pieces[0].file, by_fqn["replicated_copy"].pieces[0].tensor)]
    assert a == b  # same bytes, same chunk ids: one object
    ids = [c.id for c in commit.all_chunks()]
    stored = sum(repo.store.stored_size(i) or 0 for i in set(ids))
    assert stored < sum(repo.store.stored_size(i) or 0 for i in ids) - 50_000  # the 64 KiB copy (stored ~0.85 of raw)


def test_later_steps_store_much_less_than_the_first(trained: Any) -> None:
    repo, _, rep = trained
    first, *later = [repo.read_commit(c) for c in rep["commits"]]
    assert all(c.added_bytes < 0.5 * first.added_bytes for c in later), [c.added_bytes for c in (first, *later)]
    stored = repo.stats().stored_bytes
    assert stored < 2 * first.added_bytes  # three steps on disk, well under three times one


def test_load_into_other_world_sizes(trained: Any, tmp_path: Path) -> None:
    repo, _, rep = trained
    expected = checkout_full(repo, rep["commits"][-1], tmp_path / "expected")
    one = tmp_path / "one"
    one.mkdir()
    torchrun(1, "load", str(repo.path), str(one), rep["commits"][-1], "w1")  # 2 -> 1
    loaded = report(one)
    assert loaded["step"] == 2 and loaded["world"] == 1
    got = load_file(str(one / "full.safetensors"))
    assert_same_tensors(got, {k: v for k, v in expected.items() if k in got})
    assert repo.read_commit(loaded["commit"]).dcp.world_size == 1  # type: ignore[union-attr]
    assert_same_tensors(checkout_full(repo, loaded["commit"], tmp_path / "w1"), expected)
    two = tmp_path / "two"
    two.mkdir()
    torchrun(2, "load", str(repo.path), str(two), loaded["commit"], "w2")  # 1 -> 2
    assert_same_tensors(load_file(str(two / "full.safetensors")), got)
    assert_same_tensors(checkout_full(repo, report(two)["commit"], tmp_path / "w2"), expected)


@pytest.mark.slow
def test_four_ranks_save_and_load_into_two(tmp_path: Path) -> None:
    repo = ckstore.Repo.init(tmp_path / "repo")
    four = tmp_path / "four"
    four.mkdir()
    torchrun(4, "train", str(repo.path), str(four), "main")
    rep = report(four)
    assert rep["resumed"] == rep["losses"][1:]
    assert repo.read_commit(rep["commits"][-1]).dcp.world_size == 4  # type: ignore[union-attr]
    expected = checkout_full(repo, rep["commits"][-1], tmp_path / "expected")
    two = tmp_path / "two"
    two.mkdir()
    torchrun(2, "load", str(repo.path), str(two), rep["commits"][-1], "w2")  # 4 -> 2
    got = load_file(str(two / "full.safetensors"))
    assert_same_tensors(got, {k: v for k, v in expected.items() if k in got})


def test_a_rank_killed_mid_save_leaves_no_commit(tmp_path: Path) -> None:
    repo = ckstore.Repo.init(tmp_path / "repo")
    _single_save(repo, "main", 1.0)
    before = repo.branches()
    result = torchrun(2, "kill", str(repo.path), str(tmp_path), "main", check=False)
    assert result.returncode != 0
    repo = ckstore.Repo(repo.path)
    assert repo.branches() == before
    assert repo.fsck(read_data=True) == []
    assert any(repo.store.iter_ids())  # the dead rank's chunks are there, unreferenced
    oid = _single_save(repo, "main", 2.0)  # the next save works
    assert repo.branches()["main"] == oid and repo.read_commit(oid).parents == (before["main"],)
    changed = {c.name for c in repo.diff(before["main"], oid) if c.status == "changed"}
    assert changed == {"w@0,0"}  # scaled by 2; the complex tensor and the values are unchanged
    report_ = repo.gc(keep_last=1)  # retention and sweep: the dead rank's chunks and the first save go
    assert repo.fsck(read_data=True) == [] and [e.id for e in repo.log()][0] == oid
    assert report_.pruned_commits == [before["main"]] and report_.deleted_objects > 0


# ---- in one process (no process group: DCP saves as a single rank) ------------------------------


def _single_save(repo: ckstore.Repo, branch: str, scale: float, extra: Any = None) -> str:
    import torch.distributed.checkpoint as dcp

    from ckstore.dcp import Writer, saved_commit

    sd = {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4) * scale,
        "c": torch.ones(2, dtype=torch.complex128),
        "meta": {"epoch": 3, "name": "x", "big": 2**70, "t": (1, 2.5)},
    }
    if extra is not None:
        sd["extra"] = extra
    with pytest.warns(UserWarning, match="single process"):
        return saved_commit(dcp.save(sd, storage_writer=Writer(repo, branch=branch, message="single")))


class Opaque:  # not representable in typed JSON: DCP's planner pickles it
    def __init__(self, value: int) -> None:
        self.value = value


def test_non_tensor_items_are_typed_values_or_opaque(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from ckstore.dcp import Reader

    repo = ckstore.Repo.init(tmp_path / "repo")
    oid = _single_save(repo, "main", 1.0, extra=Opaque(7))
    commit = repo.read_commit(oid)
    encodings = {o.fqn: o.encoding for o in commit.dcp.objects}  # type: ignore[union-attr]
    assert encodings == {
        "meta.epoch": "value",
        "meta.name": "value",
        "meta.big": "value",
        "meta.t": "value",
        "extra": "opaque",
    }
    target = {
        "w": torch.zeros(3, 4),
        "c": torch.zeros(2, dtype=torch.complex128),
        "meta": {"epoch": 0, "name": "", "big": 0, "t": ()},
        "extra": None,
    }
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(target, storage_reader=Reader(repo, ref=oid))
    assert target["meta"] == {"epoch": 3, "name": "x", "big": 2**70, "t": (1, 2.5)}
    assert isinstance(target["extra"], Opaque) and target["extra"].value == 7  # through DCP's own load_bytes
    assert torch.equal(target["w"], torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert torch.equal(target["c"], torch.ones(2, dtype=torch.complex128))


def test_a_commit_that_is_not_a_checkpoint_is_refused(tmp_path: Path) -> None:
    from ckstore.dcp import Reader
    from ckstore.errors import InvalidInputError

    repo = ckstore.Repo.init(tmp_path / "repo")
    oid = repo.commit_state({"w": torch.ones(2)})
    with pytest.raises(InvalidInputError, match="not a distributed checkpoint"):
        Reader(repo, ref=oid).read_metadata()


def test_manifest_versions(tmp_path: Path) -> None:
    repo = ckstore.Repo.init(tmp_path / "repo")
    plain = repo.read_commit(repo.commit_state({"w": torch.ones(2)}))
    assert encode_commit(plain).startswith(b'{"ckstore":3,')  # tensor stats (format.md 5.1), no dcp record
    commit = repo.read_commit(_single_save(repo, "main", 1.0))
    raw = encode_commit(commit)
    assert raw.startswith(b'{"ckstore":2,') and decode_commit(raw) == commit
    with pytest.raises(UnsupportedFormatError):
        decode_commit(raw.replace(b'{"ckstore":2,', b'{"ckstore":%d,' % (MANIFEST_VERSION + 1), 1))
    # Old readers refuse version 2 as newer; this reader refuses a record that lies.
    bad = raw.replace(b'"world_size":1', b'"world_size":0', 1)
    with pytest.raises(IntegrityError, match="world_size"):
        decode_commit(bad)
    bad = raw.replace(b'"shape":[3,4]', b'"shape":[2,4]', 1)
    with pytest.raises(IntegrityError, match="outside the global shape"):
        decode_commit(bad)
    with pytest.raises(IntegrityError):
        decode_commit(raw.replace(b',"dcp":{', b',"dcx":{', 1))


def test_cli_show_lists_global_tensors_and_ranks(tmp_path: Path) -> None:
    repo = ckstore.Repo.init(tmp_path / "repo")
    oid = _single_save(repo, "main", 1.0)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run(
        [sys.executable, "-m", "ckstore.cli", "--repo", str(repo.path), "show", oid],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    assert "Distributed checkpoint: 1 rank" in out
    assert "w " in out and "float32" in out and "rank 0" in out
    doc = json.loads(
        subprocess.run(
            [sys.executable, "-m", "ckstore.cli", "--repo", str(repo.path), "show", "--json", oid],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        ).stdout
    )
    assert doc["dcp"]["world_size"] == 1 and doc["dcp"]["tensors"][1]["fqn"] == "w"


# ---- consolidation of any sharding (no torch.distributed: pieces built by hand) ------------------


@st.composite
def _grids(draw: st.DrawFn) -> tuple[tuple[int, ...], list[list[int]], str]:
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
    cuts = [sorted(set(draw(st.lists(st.integers(1, n - 1), max_size=2)))) if n > 1 else [] for n in shape]
    return shape, cuts, draw(st.sampled_from(["float32", "bfloat16", "int8", "float64"]))


@settings(max_examples=40, deadline=None)
@given(_grids(), st.booleans())
def test_consolidated_checkout_reassembles_any_grid_of_pieces(grid: Any, whole_rows: bool) -> None:
    import itertools
    import math

    import numpy as np

    from ckstore.format.dcp_record import DcpPiece, DcpRecord, DcpTensor, piece_name, stored_dtype
    from ckstore.format.dtypes import TORCH_DTYPES as DTYPES
    from ckstore.format.manifest import Commit
    from ckstore.format.safetensors import emit_header, parse_header
    from ckstore.format.values import encode_value
    from ckstore.read.checkout import _get
    from ckstore.read.consolidate import plan_consolidated
    from ckstore.write.ingest import MemoryFile, ingest

    shape, cuts, dtype = grid
    if whole_rows:  # FSDP-like: split on the first dimension only, streamed as stored chunks
        cuts = [cuts[0]] + [[] for _ in shape[1:]]
    width = DTYPES[dtype][0] // 8
    full = np.random.default_rng(len(shape)).integers(0, 256, math.prod(shape) * width, dtype=np.uint8)
    grid_bytes = full.reshape(*shape[:-1], shape[-1] * width)
    bounds = [list(zip([0, *c], [*c, n])) for c, n in zip(cuts, shape)]
    repo = ckstore.Repo.memory(chunk_size=4096)
    pieces, sources = [], []
    for rank, block in enumerate(itertools.product(*bounds)):
        offsets, sizes = tuple(b[0] for b in block), tuple(b[1] - b[0] for b in block)
        index = tuple(slice(a, b) for a, b in block[:-1]) + (slice(block[-1][0] * width, block[-1][1] * width),)
        data = np.ascontiguousarray(grid_bytes[index]).tobytes()
        name = piece_name("t", offsets)
        code, stored_shape = stored_dtype(dtype, sizes)
        header, _ = emit_header([(name, code, stored_shape)], None)
        path = f"dcp/rank-{rank:05d}.safetensors"
        sources.append(
            MemoryFile(path, parse_header(header, len(header) + len(data)), (memoryview(header), memoryview(data)))
        )
        pieces.append(DcpPiece(offsets, sizes, rank, path, name))
    files, _ = ingest(repo.store, sources, 4096)
    record = DcpRecord(
        len(pieces),
        (DcpTensor("t", dtype, shape, False, "strided", "contiguous_format", tuple(pieces)),),
        (),
        encode_value({}),
    )
    commit = Commit(parents=(), time="2026-01-01T00:00:00Z", message="", branch="main", files=tuple(files), dcp=record)
    [output] = plan_consolidated(repo.store, commit)
    written = b"".join(_get(repo.store, piece) for piece in output.pieces)
    assert len(written) == output.size
    layout = parse_header(written[: 8 + int.from_bytes(written[:8], "little")], len(written))
    assert [(t.name, t.dtype, tuple(t.shape)) for t in layout.tensors] == [("t", DTYPES[dtype][1], shape)]
    assert written[layout.data_offset :] == full.tobytes()


def test_a_failed_save_releases_the_repository_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """F13: after a save whose write fails (ENOSPC), gc runs at once, not when the job next saves."""
    import errno

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import ckstore.backend.base
    import ckstore.dcp.storage
    from ckstore.dcp import Writer

    repo = ckstore.Repo.init(tmp_path / "repo")
    first = _single_save(repo, "main", 1.0)

    def no_space(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckstore.dcp.storage, "store_pieces", no_space)
    writer = Writer(repo, message="fails")  # the job keeps it, and trains on
    with pytest.warns(UserWarning, match="single process"), pytest.raises(CheckpointException):
        dcp.save({"w": torch.ones(3, 4)}, storage_writer=writer)
    monkeypatch.undo()
    monkeypatch.setattr(ckstore.backend.base, "REPO_LOCK_TIMEOUT", 0.5)
    assert ckstore.Repo(repo.path).gc().pruned_commits == []  # LockedError while the lock is held
    assert repo.branches()["main"] == first and writer.commit_id is None


def test_the_coordinator_lock_is_released_after_lock_hold_when_another_rank_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """F13, the other ranks' case: DCP never tells the coordinator, so its hold is bounded."""
    import time

    from torch.distributed.checkpoint.planner import SavePlan

    import ckstore.backend.base
    from ckstore.dcp import Writer
    from ckstore.errors import LockedError

    repo = ckstore.Repo.init(tmp_path / "repo")
    writer = Writer(repo, lock_hold=1.0)
    writer.set_up_storage_writer(True)
    writer.prepare_global_plan([SavePlan([]), SavePlan([])])  # rank 1 then fails: no finish
    monkeypatch.setattr(ckstore.backend.base, "REPO_LOCK_TIMEOUT", 0.1)
    with pytest.raises(LockedError):
        ckstore.Repo(repo.path).gc()  # held while ranks may be writing
    time.sleep(1.5)
    assert ckstore.Repo(repo.path).gc().deleted_objects == 0  # released: no wait


def _record_doc(shape: list[int], pieces: list[tuple[list[int], list[int]]]) -> tuple[dict[str, Any], dict[Any, Any]]:
    docs, stored = [], {}
    for rank, (offsets, sizes) in enumerate(pieces):
        path = f"dcp/rank-{rank:05d}.safetensors"
        stored[(path, "t@" + str(rank))] = ("F32", tuple(sizes))
        docs.append({"offsets": offsets, "sizes": sizes, "rank": rank, "file": path, "tensor": "t@" + str(rank)})
    tensor = {
        "fqn": "x",
        "dtype": "float32",
        "shape": shape,
        "requires_grad": False,
        "layout": "strided",
        "memory_format": "contiguous_format",
        "pieces": docs,
    }
    return {"world_size": len(pieces), "tensors": [tensor], "objects": [], "extra": {}}, stored


@pytest.mark.parametrize(
    "shape, pieces",
    [
        ([4], [([0], [2]), ([1], [2])]),  # the review's: sizes sum to 4, element 3 saved by no rank
        ([2, 4], [([0, 0], [2, 2]), ([0, 1], [2, 2]), ([1, 3], [1, 1]), ([0, 3], [1, 1])]),
        ([2, 2], [([0, 0], [2, 2]), ([0, 0], [1, 1])]),  # more than the tensor: one element twice
    ],
)
def test_pieces_that_overlap_or_leave_a_hole_are_refused(shape: list[int], pieces: Any) -> None:
    """F14: coverage is checked exactly (disjoint pieces whose volumes sum to the tensor's)."""
    from ckstore.errors import IntegrityError
    from ckstore.format.dcp_record import parse_record

    doc, stored = _record_doc(shape, pieces)
    with pytest.raises(IntegrityError, match="pieces"):
        parse_record(doc, stored)


@settings(max_examples=60, deadline=None)
@given(_grids())
def test_any_grid_of_pieces_is_an_exact_cover(grid: Any) -> None:
    import itertools

    from ckstore.format.dcp_record import parse_record

    shape, cuts, _ = grid
    bounds = [list(zip([0, *c], [*c, n])) for c, n in zip(cuts, shape)]
    pieces = [([b[0] for b in block], [b[1] - b[0] for b in block]) for block in itertools.product(*bounds)]
    doc, stored = _record_doc(list(shape), pieces)
    assert len(parse_record(doc, stored).tensors[0].pieces) == len(pieces)


def test_a_large_valid_cover_is_checked_in_bounded_time() -> None:
    """Column pieces split at a different row in every column (a disjoint, exact cover that kept
    every piece in the sweep's active set): 40,000 pieces are checked in well under a second of
    CPU, where comparing every pair took minutes."""
    import time

    from ckstore.format.dcp_record import parse_record

    n = 20_000
    pieces = [([i, i], [n - i, 1]) for i in range(n)] + [([0, i], [i, 1]) for i in range(1, n)]
    doc, stored = _record_doc([n, n], pieces)
    started = time.process_time()
    assert len(parse_record(doc, stored).tensors[0].pieces) == len(pieces)
    assert time.process_time() - started < 10  # about 0.5 s here; the pairwise check took > 5 min


@pytest.mark.parametrize(
    "pieces",
    [
        # a pinwheel: disjoint and exact, but no cut along an axis separates it
        [([0, 0], [1, 2]), ([0, 2], [2, 1]), ([1, 0], [2, 1]), ([2, 1], [1, 2]), ([1, 1], [1, 1])],
        # two pieces overlapping in the middle, the volumes made up by a hole elsewhere
        [([0, 0], [2, 2]), ([1, 1], [2, 2]), ([0, 2], [1, 1])],
    ],
)
def test_pieces_that_cuts_cannot_separate_are_refused(pieces: Any) -> None:
    from ckstore.format.dcp_record import parse_record

    doc, stored = _record_doc([3, 3], pieces)
    with pytest.raises(IntegrityError, match="cuts along its axes"):
        parse_record(doc, stored)


def test_compaction_copies_no_step_s_weights_out_of_its_pack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compaction replaces none of a step's chunks while it is the tip (its first moments settle
    when they are the parent's): the tip's large weights and moments stay packed, and no pack is
    left holding an object that also lies loose (each pack went whole, nothing copied)."""
    from ckstore.backend import local_settle
    from ckstore.backend.local import LocalBackend
    from ckstore.format.optstate import FIRST, SECOND, WEIGHT, member
    from tests.helpers import assert_reads_back, dcp_adamw_run

    monkeypatch.setattr(LocalBackend, "pack_min_bytes", 0)  # a step of this small model packs too
    repo = ckstore.Repo.init(tmp_path / "repo")
    runs = dcp_adamw_run(repo, 3, width=256)  # 256 KiB weights: large objects, one chunk each
    backend = ckstore.Repo(repo.path).backend
    packed = {oid for index in backend.packs.indexes() for oid in index.columns()[0]}
    loose = {
        p.parent.name + p.name for p in (repo.path / "objects").glob("[0-9a-f][0-9a-f]/*") if not p.name.startswith(".")
    }
    roles: dict[str, set[str]] = {WEIGHT: set(), FIRST: set(), SECOND: set()}
    for f in repo.read_commit(runs[-1][0]).files:
        for t in f.tensors:
            found = member(t.name)
            if found is not None:
                roles[found.role] |= {
                    c.id for c in t.chunks if (repo.store.stored_size(c.id) or 0) >= local_settle.SMALL_OBJECT
                }
    assert roles[WEIGHT] and roles[SECOND] and roles[FIRST]
    assert roles[WEIGHT] | roles[SECOND] | roles[FIRST] <= packed - loose  # the next compaction replaces them
    assert not packed & loose
    assert_reads_back(repo, runs, tmp_path / "out")
    assert repo.fsck(read_data=True) == []
