"""Training state: commit_state / load_state round trips, bit-exact resume in a fresh process,
filters and laziness, refusal of unencodable values, checkout and show of a state commit."""

from __future__ import annotations

import collections
import json
import math
import random
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from safetensors.torch import load_file
from torch import nn

import ckstore
from ckstore.cli import main
from ckstore.errors import ObjectMissingError, UnencodableValueError
from ckstore.repo import Repo
from ckstore.training.state import STATE_TENSORS, STATE_VALUES, rng_state, set_rng_state
from tests.helpers import TORCH_DTYPES, make_tensor, object_count, object_file

TESTS = Path(__file__).resolve().parent

# ---- comparing states exactly ------------------------------------------------------------------


def raw(t: torch.Tensor) -> bytes:
    """A tensor's bytes (float4/float8/bool/complex alike): the bit-exactness oracle."""
    c = t.detach().cpu().resolve_conj().resolve_neg().contiguous()
    return c.reshape(-1).view(torch.uint8).numpy().tobytes() if c.numel() else b""


def assert_same(a: Any, b: Any, path: str = "<root>") -> None:
    """``b`` is ``a`` rebuilt exactly: same types (tuple stays tuple, int keys stay int), same
    bits for floats (nan, -0.0) and tensors, same dtype and shape, same key order."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert (b.dtype, b.shape) == (a.dtype, a.shape), path
        assert raw(b) == raw(a), path
        return
    assert type(b) is type(a), f"{path}: {type(a).__name__} came back as {type(b).__name__}"
    if isinstance(a, np.ndarray):
        # Arrays come back in native byte order (a stored array is little-endian bytes + dtype).
        assert b.dtype == a.dtype.newbyteorder("=") and b.shape == a.shape, path
        assert np.ascontiguousarray(a).astype(b.dtype).tobytes() == b.tobytes(), path
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), path
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), f"{path}: {a!r} != {b!r}"
    elif isinstance(a, dict):
        assert list(a) == list(b) and [type(k) for k in a] == [type(k) for k in b], path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}.{i}")
    else:
        assert a == b, path


# ---- bit-exact resume --------------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def make_training(seed: int) -> tuple[Net, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=17)
    return model, opt, sched


def train_step(model: Net, opt: torch.optim.Optimizer, sched: Any) -> float:
    # Every RNG a real loop touches: torch (data, dropout), NumPy (noise), Python (jitter).
    x = torch.randn(16, 8)
    noise = torch.from_numpy(np.random.standard_normal((16, 1))).float() * 0.01
    y = x.sum(1, keepdim=True) + noise + random.random()
    loss = F.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return loss.item()


def snapshot(model: Net, opt: torch.optim.Optimizer, sched: Any, epoch: int) -> dict[str, Any]:
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "epoch": epoch,
        "rng": ckstore.rng_state(),
    }


def resume_and_train(repo_path: str, ref: str, steps: int) -> list[float]:
    """What the fresh process runs: load, restore everything, continue, commit the result."""
    repo = Repo(repo_path)
    model, opt, sched = make_training(seed=12345)  # deliberately different init: restore must win
    state = repo.load_state(ref)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    ckstore.set_rng_state(state["rng"])
    losses = [train_step(model, opt, sched) for _ in range(steps)]
    repo.commit_state(snapshot(model, opt, sched, state["epoch"] + 1), branch="resumed")
    return losses


CHILD = """
import json, sys
sys.path.insert(0, {root!r})
from tests.training.test_state import resume_and_train
print(json.dumps([x.hex() for x in resume_and_train({repo!r}, {ref!r}, {steps})]))
"""


def test_bit_exact_resume_in_a_fresh_process(tmp_path: Path) -> None:
    repo = Repo.init(tmp_path / "repo")
    model, opt, sched = make_training(seed=0)
    random.seed(1)
    np.random.seed(2)
    for _ in range(6):
        train_step(model, opt, sched)
    oid = repo.commit_state(snapshot(model, opt, sched, epoch=6), metadata={"step": 6})
    expected = [train_step(model, opt, sched) for _ in range(5)]
    # Scramble this process's RNGs: the child must not depend on anything but the commit.
    random.seed(99)
    torch.manual_seed(99)

    code = CHILD.format(root=str(TESTS.parents[1]), repo=str(repo.path), ref=oid, steps=5)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = [float.fromhex(x) for x in json.loads(out.stdout.strip().splitlines()[-1])]
    assert got == expected  # ==, not allclose
    assert len(set(expected)) == len(expected)  # dropout and data really vary per step

    resumed = repo.load_state("resumed")
    for name, tensor in model.state_dict().items():
        assert torch.equal(resumed["model"][name], tensor), name
    mine = opt.state_dict()
    for idx, slots in mine["state"].items():
        for slot, value in slots.items():
            assert raw(resumed["optimizer"]["state"][idx][slot]) == raw(value), (idx, slot)
    assert resumed["scheduler"] == sched.state_dict()


def test_without_the_rng_state_resume_differs(tmp_path: Path) -> None:
    """The control for the test above: RNG restore is what makes dropout and data repeat."""
    repo = Repo.init(tmp_path / "repo")
    model, opt, sched = make_training(seed=0)
    state = snapshot(model, opt, sched, 0)
    oid = repo.commit_state({k: v for k, v in state.items() if k != "rng"})
    expected = [train_step(model, opt, sched) for _ in range(3)]
    model2, opt2, sched2 = make_training(seed=7)
    back = repo.load_state(oid)
    model2.load_state_dict(back["model"])
    opt2.load_state_dict(back["optimizer"])
    sched2.load_state_dict(back["scheduler"])
    assert [train_step(model2, opt2, sched2) for _ in range(3)] != expected


def test_rng_state_round_trips_through_a_commit(repo: Repo) -> None:
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    oid = repo.commit_state({"rng": ckstore.rng_state()})
    first = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    set_rng_state(repo.load_state(oid)["rng"])
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert first[:2] == again[:2] and torch.equal(first[2], again[2])
    assert ckstore.set_rng_state is set_rng_state and ckstore.rng_state is rng_state


# ---- round trips ---------------------------------------------------------------------------------


class Counter(nn.Module):
    """A module whose extra state starts as None and becomes a tensor after some epochs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.extra: Any = None

    def get_extra_state(self) -> Any:
        return self.extra

    def set_extra_state(self, state: Any) -> None:
        self.extra = state


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.inner = Counter()
        self.head = nn.Linear(8, 50, bias=False)
        self.head.weight = self.embed.weight  # tied input embedding and output projection


def test_values_round_trip_exactly(repo: Repo) -> None:
    state = {
        "tuple": (1, "two", (3.0, None)),
        "int_keys": {0: "a", 7: [1, 2], -3: None},
        "floats": [math.nan, math.inf, -math.inf, -0.0, 0.1, 5e-324, struct.unpack("<d", b"\x01\0\0\0\0\0\xf8\x7f")[0]],
        "big": [2**53 + 1, -(2**200), 10**300],
        "flags": (True, False),
        "text": "naïve ☃",
        "bytes": b"\0\xff",
        "mixed_keys": {1: "int", "1": "str", (2, 3): "tuple", None: 0, 2.5: 1},
        "np_scalars": [np.float32(1.5), np.int64(-4), np.bool_(True), np.float16(np.nan)],
        "odict": collections.OrderedDict([("b", 1), ("a", 2)]),
        "empty": [{}, [], ()],
        "torch_types": [torch.float16, torch.Size([2, 3]), torch.device("cpu")],
    }
    assert_same(state, repo.load_state(repo.commit_state(state)))


def test_state_dict_metadata_and_extra_state_round_trip(repo: Repo) -> None:
    model = Tied()
    sd0 = model.state_dict()
    assert sd0["inner._extra_state"] is None
    back0 = repo.load_state(repo.commit_state({"model": sd0}))["model"]
    assert_same(sd0, back0)
    assert back0._metadata == sd0._metadata  # type: ignore[attr-defined]  # versions for load hooks

    # Some epochs later the extra state is a tensor inside a nested structure.
    model.inner.extra = {"seen": torch.arange(6, dtype=torch.int32).reshape(2, 3), "count": 3, "hist": (0.5, math.nan)}
    sd1 = model.state_dict()
    back1 = repo.load_state(repo.commit_state({"model": sd1}))["model"]
    assert_same(sd1, back1)
    fresh = Tied()
    fresh.load_state_dict(back1)
    assert_same(model.inner.extra, fresh.inner.extra)


def test_tied_weights_are_stored_once_and_load_as_one_tensor(repo: Repo, tmp_path: Path) -> None:
    model = Tied()
    oid = repo.commit_state({"model": model.state_dict()})
    stored = repo.read_commit(oid).files
    names = [t.name for f in stored for t in f.tensors]
    assert sum(n in ("model.embed.weight", "model.head.weight") for n in names) == 1
    back = repo.load_state(oid)["model"]
    assert back["embed.weight"] is back["head.weight"]
    lazy = repo.load_state(oid, lazy=True)["model"]
    assert lazy["embed.weight"] is lazy["head.weight"]
    fresh = Tied()
    fresh.head.weight = fresh.embed.weight
    fresh.load_state_dict(back)
    assert fresh.head.weight.data_ptr() == fresh.embed.weight.data_ptr()
    assert torch.equal(fresh.head.weight, model.head.weight)


EXTRA_DTYPES = [torch.complex128, torch.complex32]


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("dtype", [*TORCH_DTYPES, *EXTRA_DTYPES], ids=str)
def test_every_dtype_and_shape_round_trips(repo: Repo, dtype: torch.dtype) -> None:
    is_x2 = dtype == torch.float4_e2m1fn_x2
    tensors = {
        "matrix": make_tensor(dtype, (3, 4), seed=1),
        "scalar": make_tensor(dtype, (), seed=2),
        "empty": make_tensor(dtype, (0, 5), seed=3),
        "transposed": make_tensor(dtype, (4, 3), seed=4).t(),  # non-contiguous
        "strided": make_tensor(dtype, (10,), seed=5)[::3],
    }
    assert not tensors["transposed"].is_contiguous() and not tensors["strided"].is_contiguous()
    state = {"t": tensors, "epoch": 1}
    if is_x2:  # shape semantics of packed x2 tensors are torch's; bytes must still survive
        state["t"]["big"] = make_tensor(dtype, (64, 33), seed=6)
    assert_same(state, repo.load_state(repo.commit_state(state)))


def test_numpy_arrays_round_trip(repo: Repo) -> None:
    rng = np.random.default_rng(0)
    arrays = {
        "f64": rng.standard_normal((3, 4)),
        "f16": rng.standard_normal(5).astype(np.float16),
        "bool": rng.integers(0, 2, 7).astype(bool),
        "c128": rng.standard_normal(3) + 1j,
        "u64": np.array([0, 2**64 - 1], dtype=np.uint64),
        "i8": np.arange(-4, 4, dtype=np.int8),
        "big_endian": np.arange(6, dtype=">f4"),
        "sliced": np.arange(20.0).reshape(4, 5)[:, ::2],
        "zero_d": np.array(3.25),
        "empty": np.zeros((0, 3), dtype=np.int32),
    }
    back = repo.load_state(repo.commit_state(arrays))
    assert_same(arrays, back)
    assert all(type(v) is np.ndarray for v in back.values())


def test_grad_scaler_state_round_trips(repo: Repo) -> None:
    # torch.amp.GradScaler works on CPU in torch >= 2.3; its state is floats and ints.
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(4):
        scaler.scale(model(torch.randn(2, 4)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    state = scaler.state_dict()
    assert state["_growth_tracker"] != 0 or state["scale"] != 1024.0  # it did something
    back = repo.load_state(repo.commit_state({"scaler": state}))["scaler"]
    assert_same(state, back)
    fresh = torch.amp.GradScaler("cpu")
    fresh.load_state_dict(back)
    assert fresh.get_scale() == scaler.get_scale()


# ---- only= and lazy ------------------------------------------------------------------------------


def _big_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "model": {
            "layer1.weight": torch.randn(64, 64, generator=g),
            "layer1.bias": torch.randn(64, generator=g),
            "layer2.weight": torch.randn(64, 64, generator=g),
        },
        "optimizer": {
            "state": {0: {"exp_avg": torch.randn(64, 64, generator=g), "step": torch.tensor(3.0)}},
            "param_groups": [{"lr": 0.1, "params": [0]}],
        },
        "epoch": 4,
    }


def _chunks_of(repo: Repo, oid: str, prefix: str) -> set[str]:
    return {c.id for f in repo.read_commit(oid).files for t in f.tensors if t.name.startswith(prefix) for c in t.chunks}


def test_only_reads_no_chunk_of_what_it_leaves_out(repo: Repo, monkeypatch: pytest.MonkeyPatch) -> None:
    state = _big_state()
    oid = repo.commit_state(state)
    excluded = _chunks_of(repo, oid, "optimizer.") | _chunks_of(repo, oid, "model.layer2.")
    assert excluded and not excluded & _chunks_of(repo, oid, "model.layer1.")
    read: list[str] = []
    real_get = repo.store.get_chunk
    monkeypatch.setattr(repo.store, "get_chunk", lambda oid, *a, **k: (read.append(oid), real_get(oid, *a, **k))[1])

    back = repo.load_state(oid, only="model.layer1.*")
    assert list(back) == ["model"] and list(back["model"]) == ["layer1.weight", "layer1.bias"]
    assert torch.equal(back["model"]["layer1.weight"], state["model"]["layer1.weight"])
    assert read and not set(read) & excluded

    # Deleting the excluded tensors' objects proves it again: only= still loads, a full load fails.
    for chunk in excluded:
        object_file(repo, chunk).unlink()
    assert torch.equal(
        repo.load_state(oid, only=["model.layer1"])["model"]["layer1.bias"], state["model"]["layer1.bias"]
    )
    assert repo.load_state(oid, only="epoch") == {"epoch": 4}
    with pytest.raises(ObjectMissingError):
        repo.load_state(oid)


def test_only_matches_int_keys_and_globs(repo: Repo) -> None:
    oid = repo.commit_state(_big_state())
    back = repo.load_state(oid, only=["optimizer.state.0.exp_avg", "*.bias"])
    assert list(back) == ["model", "optimizer"]
    assert list(back["model"]) == ["layer1.bias"]
    assert list(back["optimizer"]["state"][0]) == ["exp_avg"]
    assert repo.load_state(oid, only="nothing.here") == {}


def test_lazy_reads_a_tensor_only_when_accessed(repo: Repo) -> None:
    state = _big_state()
    oid = repo.commit_state(state)
    lazy = repo.load_state(oid, lazy=True)
    assert lazy.bytes_read == 0
    assert lazy["epoch"] == 4 and lazy.bytes_read == 0
    model = lazy["model"]
    assert set(model) == {"layer1.weight", "layer1.bias", "layer2.weight"} and lazy.bytes_read == 0
    assert torch.equal(model["layer1.bias"], state["model"]["layer1.bias"])
    assert lazy.bytes_read == 64 * 4
    model["layer1.bias"]
    assert lazy.bytes_read == 64 * 4  # cached, not read twice
    assert_same(state, lazy.materialize())


# ---- refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, where",
    [
        (object(), "optimizer.state.0.weird"),
        ({1, 2}, "optimizer.state.0.weird"),
        (lambda: 0, "optimizer.state.0.weird"),
        (torch.eye(3).to_sparse(), "optimizer.state.0.weird"),
        (np.array(["text"]), "optimizer.state.0.weird"),
    ],
    ids=["object", "set", "lambda", "sparse", "str-array"],
)
def test_unencodable_value_names_its_path_and_commits_nothing(repo: Repo, bad: Any, where: str) -> None:
    repo.commit_state({"w": torch.ones(3)})
    before = (repo.branches(), repo.tags(), object_count(repo))
    state = _big_state()
    state["optimizer"]["state"][0]["weird"] = bad
    with pytest.raises(UnencodableValueError, match=where.replace(".", r"\.")):
        repo.commit_state(state, branch="other")
    assert (repo.branches(), repo.tags(), object_count(repo)) == before


# ---- checkout and show ---------------------------------------------------------------------------


def test_checkout_of_a_state_is_plain_safetensors_and_json(repo: Repo, tmp_path: Path) -> None:
    model = Tied()
    state = {"model": model.state_dict(), "epoch": 2, "c": torch.ones(2, dtype=torch.complex128)}
    oid = repo.commit_state(state, metadata={"loss": 0.5})
    out = tmp_path / "out"
    repo.checkout(oid, out)
    assert sorted(p.name for p in out.iterdir()) == sorted([STATE_TENSORS, STATE_VALUES])
    tensors = load_file(str(out / STATE_TENSORS))
    assert torch.equal(tensors["model.embed.weight"], model.embed.weight)
    assert torch.equal(tensors["model.inner.lin.bias"], model.inner.lin.bias)
    # complex128 has no safetensors dtype: raw bytes, with the real dtype recorded in the JSON.
    assert tensors["c"].dtype == torch.uint8 and tensors["c"].numel() == 32
    doc = json.loads((out / STATE_VALUES).read_text())
    assert doc["value"]["epoch"] == 2
    assert doc["value"]["c"] == {"$tensor": {"name": "c", "dtype": "complex128", "shape": [2]}}


def test_cli_show_displays_the_state(repo: Repo) -> None:
    repo.commit_state({"model": {"w": torch.ones(2, 3)}, "epoch": 7}, metadata={"loss": 0.25})
    result = CliRunner().invoke(main, ["--repo", str(repo.path), "show", "HEAD"])
    assert result.exit_code == 0, result.output
    # In words (issue 23): the tensor is named under its module, with dtype, size and shape.
    assert "epoch: 7" in result.output and "loss" in result.output
    assert "model: 1 tensor (F32, 24 B): w [2, 3]" in result.output
    result = CliRunner().invoke(main, ["--repo", str(repo.path), "show", "--json", "HEAD"])
    assert json.loads(result.output)["state"]["epoch"] == 7


def test_load_state_refuses_a_tensor_name_in_two_files(tmp_path: Path) -> None:
    """Newcomer item 2: model + EMA weights side by side; one flat mapping must not drop one."""
    from safetensors.torch import save_file

    from ckstore.errors import InvalidInputError

    (tmp_path / "e").mkdir()
    save_file({"w": torch.zeros(3)}, str(tmp_path / "e" / "model.safetensors"))
    save_file(
        {"w": torch.ones(5, dtype=torch.float16), "decay": torch.ones(1)}, str(tmp_path / "e" / "ema.safetensors")
    )
    repo = Repo.init(tmp_path / "r" / ".ckstore")
    cid = repo.commit([tmp_path / "e"], message="model+ema")
    with pytest.raises(InvalidInputError, match="'w' is in both .*ema.safetensors.* and .*model.safetensors"):
        repo.load_state(cid)
    with repo.open(cid, path="ema.safetensors") as ema:
        assert torch.equal(ema["w"], torch.ones(5, dtype=torch.float16))


def test_compacted_states_load_bit_exact_from_grouped_and_delta_chunks(tmp_path: Path) -> None:
    """load_state decodes byte-grouped and delta chunks straight into the tensor it returns: every
    chunk lands at its own offset, whatever its encoding, and a later load is unaffected by a
    change the caller makes to an earlier result."""
    from ckstore.codecs.objects import Encoding, parse_header

    repo = Repo.init(tmp_path / "r", chunk_size=4096)
    g = torch.Generator().manual_seed(3)
    weights = {
        "w": torch.randn(3000, generator=g),
        "h": torch.randn(2500, generator=g).to(torch.bfloat16),
        "i": torch.arange(1500, dtype=torch.int32),
    }
    states, oids = [], []
    for epoch in range(3):
        state = {"model": {k: v.clone() for k, v in weights.items()}, "epoch": epoch}
        states.append(state)
        oids.append(repo.commit_state(state))
        repo.wait()  # compaction: the tip byte-grouped, its parent a delta against it
        weights = {
            k: (v.float() + 1e-3 * torch.randn(v.shape, generator=g)).to(v.dtype) if v.is_floating_point() else v
            for k, v in weights.items()
        }
    encodings = {
        parse_header(repo.store.read_local(c.id) or b"").encoding
        for oid in oids
        for f in repo.read_commit(oid).files
        for t in f.tensors
        for c in t.chunks
    }
    assert {Encoding.GROUPED, Encoding.DELTA} <= encodings | {Encoding.PREDICTED} and len(encodings) > 1
    for oid, state in zip(oids, states):
        loaded = repo.load_state(oid)
        assert [k for k, v in state["model"].items() if raw(loaded["model"][k]) != raw(v)] == []
        loaded["model"]["w"].zero_()  # the caller owns the result: the next read is unaffected
    for oid, state in zip(oids, states):
        assert raw(repo.load_state(oid)["model"]["w"]) == raw(state["model"]["w"]), oid


def test_commit_and_load_of_many_chunks_run_no_garbage_collection(tmp_path: Path) -> None:
    """A collection traverses every object of the training process (0.32 s in a 3 GB commit):
    commit_state and load_state keep the objects they create to themselves, and leave the
    interpreter's collector as they found it."""
    import gc
    import threading

    repo = Repo.init(tmp_path / "r", chunk_size=4096)
    state = {"w": torch.randn(4000, 100), "moments": [torch.randn(1000, 100) for _ in range(8)], "step": 3}
    collections: list[str] = []
    running = ""

    def note(phase: str, info: dict[str, int]) -> None:
        # The caller's thread only: the compaction's runs on after commit_state returns.
        if phase == "start" and running and threading.current_thread() is threading.main_thread():
            collections.append(running)

    repo.load_state(repo.commit_state({"warm": torch.zeros(3)}))  # the modules they import, once
    repo.wait()
    gc.callbacks.append(note)
    try:
        gc.collect()
        running = "commit_state"
        oid = repo.commit_state(state)
        running = ""
        repo.wait()
        gc.collect()
        running = "load_state"
        loaded = repo.load_state(oid)
        running = ""
    finally:
        gc.callbacks.remove(note)
    # At most the young generation's, as the collector comes back on (before: 3 in this commit).
    assert collections.count("commit_state") <= 1 and collections.count("load_state") <= 1
    assert gc.isenabled()
    assert_same(loaded, state)
