"""Tests for ckstore.format.values: exact, canonical, pickle-free value encoding."""

from __future__ import annotations

import collections
import enum
import json
import math
import random
import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckstore.errors import IntegrityError, ObjectMissingError, UnencodableValueError
from ckstore.format.values import (
    MAX_DEPTH,
    MAX_INT_DIGITS,
    decode_value,
    encode_value,
    format_path,
)

FAST = settings(deadline=None, max_examples=150, suppress_health_check=[HealthCheck.too_slow])
_NOMETA = object()


# ---------------------------------------------------------------- helpers


def same(a: Any, b: Any) -> bool:
    """Structural equality that also demands identical types, order and float bits."""
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if type(a) in (dict, collections.OrderedDict):
        if len(a) != len(b) or not all(
            same(ka, kb) and same(va, vb) for (ka, va), (kb, vb) in zip(a.items(), b.items())
        ):
            return False
        if type(a) is collections.OrderedDict:
            ma, mb = getattr(a, "_metadata", _NOMETA), getattr(b, "_metadata", _NOMETA)
            return (ma is _NOMETA and mb is _NOMETA) or (ma is not _NOMETA and mb is not _NOMETA and same(ma, mb))
        return True
    return bool(a == b)


def dumps(x: Any) -> str:
    return json.dumps(x, allow_nan=False)


def roundtrip(v: Any, **kw: Any) -> Any:
    """Encode, pass through JSON text, decode; check every invariant on the way."""
    enc = encode_value(v, leaf=kw.get("enc"))
    text = dumps(enc)
    assert dumps(encode_value(v, leaf=kw.get("enc"))) == text  # deterministic
    back = json.loads(text)
    assert dumps(back) == text
    out = decode_value(back, leaf=kw.get("dec"))
    assert dumps(encode_value(out, leaf=kw.get("enc"))) == text  # decode is the exact inverse
    return out


def nan_with_payload(sign: int, quiet: bool, payload: int) -> float:
    mantissa = (int(quiet) << 51) | payload or 1
    return struct.unpack("<d", struct.pack("<Q", (sign << 63) | (0x7FF << 52) | mantissa))[0]


# ---------------------------------------------------------------- strategies

floats = st.one_of(
    st.floats(),
    st.sampled_from([0.0, -0.0, math.inf, -math.inf, math.nan, 5e-324, 1.7976931348623157e308]),
    st.builds(nan_with_payload, st.integers(0, 1), st.booleans(), st.integers(0, 2**51 - 1)),
)
ints = st.one_of(
    st.integers(),
    st.integers(-(2**300), 2**300),
    st.sampled_from([2**53, 2**53 + 1, -(2**53), -(2**53) - 1, 0, -1]),
)
scalars = st.one_of(st.none(), st.booleans(), ints, floats, st.text(max_size=10), st.binary(max_size=10))
dollar_keys = st.sampled_from(["$", "$x", "$dict", "$tuple", "$odict", "$int", "meta", "a.b", ""])
hashables = st.recursive(
    st.one_of(st.text(max_size=6), dollar_keys, ints, floats, st.booleans(), st.none(), st.binary(max_size=4)),
    lambda c: st.lists(c, max_size=3).map(tuple),
    max_leaves=4,
)


def _odict(items: list[tuple[Any, Any]], meta: Any) -> collections.OrderedDict:
    od = collections.OrderedDict(items)
    if meta is not _NOMETA:
        od._metadata = meta  # type: ignore[attr-defined]
    return od


def containers(c: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(c, max_size=4),
        st.lists(c, max_size=4).map(tuple),
        st.dictionaries(st.text(max_size=6), c, max_size=4),
        st.dictionaries(st.one_of(dollar_keys, st.integers(-5, 5)), c, max_size=4),
        st.dictionaries(hashables, c, max_size=4),
        st.builds(_odict, st.lists(st.tuples(hashables, c), max_size=4), st.one_of(st.just(_NOMETA), c)),
    )


values = st.recursive(scalars, containers, max_leaves=30)


# ---------------------------------------------------------------- round trips


@FAST
@given(values)
def test_roundtrip_exact(v: Any) -> None:
    assert same(roundtrip(v), v)
    assert same(decode_value(encode_value(v)), v)  # also without the JSON text in between


@pytest.mark.parametrize(
    "v, expected",
    [
        (None, None),
        (True, True),
        (False, False),
        ("$x", "$x"),
        (3, 3),
        (-0.0, -0.0),
        (2**53, 2**53),
        (2**53 + 1, {"$int": "9007199254740993"}),
        (-(2**53) - 1, {"$int": "-9007199254740993"}),
        (math.inf, {"$f64": "000000000000f07f"}),
        (-math.inf, {"$f64": "000000000000f0ff"}),
        (b"hi", {"$bytes": "aGk="}),
        ((1, "a"), {"$tuple": [1, "a"]}),
        ({"a": [1]}, {"a": [1]}),
        ({1: "x"}, {"$dict": [[1, "x"]]}),
        ({"$k": 1}, {"$dict": [["$k", 1]]}),
        ({(1, 2): None}, {"$dict": [[{"$tuple": [1, 2]}, None]]}),
        (collections.OrderedDict(a=1), {"$odict": [["a", 1]]}),
        (np.float32(1.5), {"$npscalar": {"dtype": "float32", "hex": "0000c03f"}}),
        (np.bool_(True), {"$npscalar": {"dtype": "bool", "hex": "01"}}),
    ],
)
def test_documented_encodings(v: Any, expected: Any) -> None:
    assert dumps(encode_value(v)) == dumps(expected)
    assert same(decode_value(expected), v)


def test_odict_metadata_and_key_order() -> None:
    od = collections.OrderedDict([("b", 1), ("a", 2)])
    od._metadata = collections.OrderedDict([("", {"version": 1})])  # type: ignore[attr-defined]
    enc = encode_value(od)
    assert enc == {"$odict": [["b", 1], ["a", 2]], "meta": {"$odict": [["", {"version": 1}]]}}
    assert same(roundtrip(od), od)
    assert list(roundtrip({"z": 1, "a": 2})) == ["z", "a"]


def test_unicode_and_lone_surrogates() -> None:
    assert roundtrip({"ключ": "값 \U0001f600"}) == {"ключ": "값 \U0001f600"}
    # Manifests are UTF-8: a lone surrogate could not be written, so it is refused up front.
    for bad in ({"k\ud800": 1}, {"k": "\udfff"}, {"\ud800": 1, 2: 3}, ("\ud800",)):
        with pytest.raises(UnencodableValueError, match="surrogate"):
            encode_value(bad)
    encs: list[Any] = [{"k\ud800": 1}, {"k": "\udfff"}, {"$dict": [["\ud800", 1], [2, 3]]}]
    for enc in encs:
        with pytest.raises(IntegrityError, match="surrogate|string"):
            decode_value(enc)
    with pytest.raises(ValueError):
        encode_value([FakeTensor([])], leaf=lambda p, v: ("t", {"x": "\ud800"}))


@pytest.mark.parametrize(
    "dt",
    [
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "longdouble",
        "complex64",
        "complex128",
    ],
)
@FAST
@given(data=st.data())
def test_numpy_scalars_bit_exact(dt: str, data: st.DataObject) -> None:
    dtype = np.dtype(dt)
    if dtype.kind == "b":
        raw = data.draw(st.sampled_from([b"\x00", b"\x01"]))
    elif dt == "longdouble":  # x87 80-bit value plus padding that numpy need not keep
        raw = data.draw(st.binary(min_size=10, max_size=10)) + bytes(dtype.itemsize - 10)
    else:
        raw = data.draw(st.binary(min_size=dtype.itemsize, max_size=dtype.itemsize))
    v = np.frombuffer(raw, dtype=dtype.newbyteorder("<"))[0]
    out = roundtrip({"x": [v]})
    assert type(out["x"][0]) is type(v) and same(out["x"][0], v)


# ---------------------------------------------------------------- leaves


class FakeTensor:
    def __init__(self, data: list[float], dtype: str = "float32") -> None:
        self.data, self.dtype = data, dtype


def fake_enc(seen: list[Any]) -> Any:
    def enc(path: tuple[str | int, ...], v: object) -> Any:
        seen.append(path)
        if isinstance(v, FakeTensor):
            return "tensor", {"dtype": v.dtype, "data": v.data}
        return NotImplemented

    return enc


def fake_dec(tag: str, payload: Any) -> object:
    assert tag == "tensor"
    return FakeTensor(payload["data"], payload["dtype"])


def test_leaf_roundtrip_and_paths() -> None:
    seen: list[Any] = []
    state = {"opt": {"state": {0: {"exp_avg": FakeTensor([1.5, -0.0])}}}, "t": (FakeTensor([]),)}
    enc: Any = encode_value(state, leaf=fake_enc(seen))
    assert seen == [("opt", "state", 0, "exp_avg"), ("t", 0)]
    assert enc["t"] == {"$tuple": [{"$tensor": {"dtype": "float32", "data": []}}]}
    out = roundtrip(state, enc=fake_enc([]), dec=fake_dec)
    assert isinstance(out["opt"]["state"][0]["exp_avg"], FakeTensor)
    assert out["opt"]["state"][0]["exp_avg"].data == [1.5, -0.0]


@pytest.mark.parametrize(
    "answer",
    [
        ("tuple", 1),
        ("int", "5"),
        ("npscalar", {}),
        ("$x", 1),
        ("", 1),
        ("t", math.nan),
        ("t", {1: 2}),
        ("t", {1}),
        ("t", (1,)),
        "t",
        ("t",),
        None,
    ],
)
def test_bad_leaf_answers_are_value_errors(answer: Any) -> None:
    with pytest.raises(ValueError):
        encode_value([FakeTensor([])], leaf=lambda p, v: answer)


def test_leaf_decoder_errors() -> None:
    enc: Any = {"a": {"$tensor": {}}}
    with pytest.raises(IntegrityError, match=r"at a: .*unknown tag \$tensor"):
        decode_value(enc)
    with pytest.raises(IntegrityError, match=r"at a: .*KeyError"):
        decode_value(enc, leaf=fake_dec)

    def missing(tag: str, payload: Any) -> object:
        raise ObjectMissingError("object abc missing")

    with pytest.raises(ObjectMissingError):  # a leaf's own CkstoreError passes through
        decode_value(enc, leaf=missing)


# ---------------------------------------------------------------- unencodable values


class Point(collections.namedtuple("Point", "x y")):
    pass


class Color(enum.IntEnum):
    RED = 1


def _func() -> None:
    pass


@pytest.mark.parametrize(
    "bad, typename",
    [
        ({1, 2}, "set"),
        (frozenset(), "frozenset"),
        (object(), "object"),
        (lambda: 0, "function"),
        (_func, "function"),
        (bytearray(b"x"), "bytearray"),
        (Point(1, 2), "Point"),
        (Color.RED, "Color"),
        (collections.defaultdict(int), "defaultdict"),
        (1j, "complex"),
        (FakeTensor([]), "FakeTensor"),
    ],
)
def test_unencodable_names_path_and_type(bad: Any, typename: str) -> None:
    v = {"optimizer": {"state": {0: {"foo": bad}}}}
    with pytest.raises(UnencodableValueError, match=rf"{typename}'> at optimizer\.state\.0\.foo"):
        encode_value(v)
    with pytest.raises(UnencodableValueError):  # a leaf answering NotImplemented changes nothing
        encode_value(v, leaf=lambda p, x: NotImplemented)


def test_unencodable_dict_key_and_odict_attribute() -> None:
    with pytest.raises(UnencodableValueError, match="object"):
        encode_value({"a": {object(): 1}})
    od: Any = collections.OrderedDict()
    od.other = 1  # type: ignore[attr-defined]
    with pytest.raises(UnencodableValueError, match="attributes"):
        encode_value(od)


def test_cycles_are_errors() -> None:
    lst: list[Any] = [1]
    lst.append(lst)
    with pytest.raises(UnencodableValueError, match=r"cycle at 1"):
        encode_value(lst)
    d: dict[str, Any] = {"a": {}}
    d["a"]["b"] = d
    with pytest.raises(UnencodableValueError, match=r"cycle at a\.b"):
        encode_value(d)
    od: Any = collections.OrderedDict()
    od._metadata = [od]  # type: ignore[attr-defined]
    with pytest.raises(UnencodableValueError, match="cycle"):
        encode_value(od)
    shared = [1.5]
    assert roundtrip([shared, shared]) == [[1.5], [1.5]]  # sharing is fine, stored as copies


def nest(n: int, wrap: Any) -> Any:
    v: Any = 0
    for _ in range(n):
        v = wrap(v)
    return v


@pytest.mark.parametrize(
    "wrap",
    [
        lambda v: [v],
        lambda v: (v,),
        lambda v: {1: v},
        lambda v: {"a": v},
        lambda v: {(1,): collections.OrderedDict(a=v)},
    ],
)
def test_depth_limit(wrap: Any) -> None:
    deepest = nest(MAX_DEPTH, lambda v: [v])
    assert same(roundtrip(deepest), deepest)
    ok = nest(MAX_DEPTH // 2, wrap)  # wrap may add two levels
    assert same(roundtrip(ok), ok)
    with pytest.raises(UnencodableValueError, match="deeper"):
        encode_value(nest(MAX_DEPTH + 1, wrap))


def test_huge_ints() -> None:
    assert roundtrip(10 ** (MAX_INT_DIGITS - 1)) == 10 ** (MAX_INT_DIGITS - 1)
    assert roundtrip(-(2**5000)) == -(2**5000)
    with pytest.raises(UnencodableValueError, match="digits"):
        encode_value({"a": 10**MAX_INT_DIGITS})


# ---------------------------------------------------------------- real training state


def test_format_path() -> None:
    assert format_path(()) == "<root>"
    assert format_path(("optimizer", "state", 0, "exp_avg")) == "optimizer.state.0.exp_avg"
    assert format_path(("a.b", "")) == "'a.b'.''"


def test_torch_training_state_roundtrip() -> None:
    torch = pytest.importorskip("torch")

    def enc(path: tuple[str | int, ...], v: object) -> Any:
        if isinstance(v, (torch.Tensor, np.ndarray)):
            arr = v.detach().numpy() if isinstance(v, torch.Tensor) else v
            return (
                "tensor" if isinstance(v, torch.Tensor) else "ndarray",
                {"dtype": arr.dtype.str, "shape": list(arr.shape), "hex": arr.tobytes().hex()},
            )
        return NotImplemented

    def dec(tag: str, p: Any) -> object:
        arr = np.frombuffer(bytes.fromhex(p["hex"]), dtype=p["dtype"]).reshape(p["shape"]).copy()
        return torch.from_numpy(arr) if tag == "tensor" else arr

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    for _ in range(3):
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        sched.step()
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "epoch": 3,
        "rng": {
            "python": random.getstate(),
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state(),
            "pcg64": np.random.default_rng(1).bit_generator.state,
        },
    }
    out: Any = roundtrip(state, enc=enc, dec=dec)

    assert isinstance(out["model"], collections.OrderedDict)
    assert out["model"]._metadata == state["model"]._metadata  # type: ignore[attr-defined]
    assert out["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert list(out["optimizer"]["state"]) == list(state["optimizer"]["state"])  # int keys
    for k, t in state["model"].items():
        assert torch.equal(out["model"][k], t) and out["model"][k].dtype == t.dtype
    random.setstate(out["rng"]["python"])
    np.random.set_state(out["rng"]["numpy"])
    torch.set_rng_state(out["rng"]["torch"])
    opt2 = torch.optim.AdamW(model.parameters())
    opt2.load_state_dict(out["optimizer"])
    for k, s in opt.state_dict()["state"].items():
        for name, t in s.items():
            assert torch.equal(opt2.state_dict()["state"][k][name], t)
    model.load_state_dict(out["model"])
