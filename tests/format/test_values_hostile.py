"""Typed values from a hostile manifest: malformed input is an IntegrityError naming its path, and
no arbitrary or mutated JSON decodes to anything but a value or that error."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckstore.errors import IntegrityError
from ckstore.format.values import (
    MAX_INT_DIGITS,
    decode_value,
    encode_value,
)
from tests.format.test_values import FAST, nest, values

# ---------------------------------------------------------------- hostile input


@pytest.mark.parametrize(
    "bad",
    [
        2**53 + 1,
        math.nan,
        math.inf,
        (1,),
        {1: 2},
        b"x",
        {"$int": "5"},
        {"$int": "0123456789012345678"},
        {"$int": "-0"},
        {"$int": 5},
        {"$int": "1" * (MAX_INT_DIGITS + 1)},
        {"$f64": "000000000000f03f"},
        {"$f64": "000000000000F07F"},
        {"$f64": "00"},
        {"$bytes": "aGk"},
        {"$bytes": "aGl="},
        {"$bytes": "a Gk="},
        {"$bytes": 1},
        {"$tuple": {}},
        {"$dict": [[1]]},
        {"$dict": [["a", 1]]},
        {"$dict": []},
        {"$dict": [[1, 2], [1, 3]]},
        {"$dict": [[1, 2], [True, 3]]},
        {"$dict": [[[1], 2]]},
        {"$dict": [["$a", 1]], "meta": 1},
        {"$odict": [], "x": 1},
        {"$tuple": [], "$dict": []},
        {"$npscalar": {"dtype": "float", "hex": "0000000000000000"}},
        {"$npscalar": {"dtype": "bool", "hex": "02"}},
        {"$npscalar": {"dtype": "float32", "hex": "00"}},
        {"$npscalar": {"dtype": "garbage", "hex": "00"}},
        {"$npscalar": {"dtype": "V1", "hex": "00"}},
        {"$npscalar": {"dtype": "float32", "hex": "0000C03F"}},
        {"$npscalar": []},
        {"$": 1},
        {"$1x": 1},
        {"$unknown": 1},
        {"a": {"$tuple": 1}},
        nest(10_000, lambda v: [v]),
        nest(10_000, lambda v: {"$tuple": [v]}),
        {"a": object()},
    ],
)
def test_malformed_input_is_integrity_error(bad: Any) -> None:
    with pytest.raises(IntegrityError) as info:
        decode_value(bad)
    assert "\n" not in str(info.value) and " at " in str(info.value)


def test_error_names_path() -> None:
    with pytest.raises(IntegrityError, match=r"at optimizer\.state\.0\.step: "):
        decode_value({"optimizer": {"state": {"$dict": [[0, {"step": {"$f64": "zz"}}]]}}})


junk_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=6),
    st.sampled_from(
        [
            "000000000000f87f",
            "000000000000f03f",
            "aGk=",
            "AAAA",
            "=",
            "-0",
            "0",
            "12345678901234567890",
            "float32",
            "bool",
            "0000c03f",
            "01",
            "02",
            "tensor",
        ]
    ),
)
junk_keys = st.one_of(
    st.sampled_from(
        [
            "$tuple",
            "$dict",
            "$odict",
            "meta",
            "$int",
            "$f64",
            "$bytes",
            "$npscalar",
            "$foo",
            "$",
            "$1x",
            "a",
            "dtype",
            "hex",
        ]
    ),
    st.text(max_size=4),
)
junk = st.recursive(
    junk_scalars,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(junk_keys, c, max_size=3),
    max_leaves=20,
)


def _check_decode_strict(data: Any) -> None:
    """Decoding either raises IntegrityError or yields a value that re-encodes to ``data``."""
    try:
        out = decode_value(data)
    except IntegrityError:
        return
    assert json.dumps(encode_value(out)) == json.dumps(data)


@FAST
@given(junk)
def test_fuzz_decode_arbitrary_json(data: Any) -> None:
    _check_decode_strict(data)


def _nodes(x: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [at]
    if type(x) is list:
        for i, y in enumerate(x):
            out += _nodes(y, at + (i,))
    elif type(x) is dict:
        for k, y in x.items():
            out += _nodes(y, at + (k,))
    return out


def _replace(x: Any, at: tuple[Any, ...], new: Any) -> Any:
    if not at:
        return new
    copy = list(x) if type(x) is list else dict(x)
    copy[at[0]] = _replace(x[at[0]], at[1:], new)
    return copy


@FAST
@given(values, st.data())
def test_fuzz_decode_mutated_encodings(v: Any, data: st.DataObject) -> None:
    enc = encode_value(v)
    at = data.draw(st.sampled_from(_nodes(enc)))
    _check_decode_strict(_replace(enc, at, data.draw(junk)))
