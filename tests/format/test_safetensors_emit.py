"""emit_header: the safetensors header ckstore writes at checkout, refused for what safetensors would
refuse, and read back by safe_open exactly as written."""

from __future__ import annotations

import os
import struct
import tempfile
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from ckstore.errors import SafetensorsFormatError
from ckstore.format.safetensors import (
    emit_header,
    parse_header,
)
from tests.format.test_safetensors import assert_offset_order, specs, whole_bytes

# --- emit_header -----------------------------------------------------------------------------


def test_emit_header_layout() -> None:
    spec = [("w", "F32", [2, 3]), ("b", "I8", []), ("e", "F16", (0,))]
    header, offsets = emit_header(spec, {"k": "v"})
    assert offsets == [(0, 24), (24, 25), (25, 25)]
    assert len(header) % 8 == 0
    body = header[8:].rstrip(b" ")
    assert body.startswith(b'{"__metadata__":{"k":"v"},"w":{"dtype":"F32","shape":[2,3]')
    assert b" " not in body
    layout = parse_header(header, len(header) + 25)
    assert layout.metadata == {"k": "v"}
    spans = [(t.name, t.begin, t.end) for t in layout.tensors]
    assert spans == [("w", 0, 24), ("b", 24, 25), ("e", 25, 25)]


def test_emit_header_empty() -> None:
    header, offsets = emit_header([], None)
    assert offsets == [] and header == struct.pack("<Q", 8) + b"{}      "
    assert parse_header(header, len(header)).tensors == ()


@pytest.mark.parametrize(
    ("tensors", "metadata", "match"),
    [
        ([("a", "U8", [1]), ("a", "U8", [1])], None, "duplicate key 'a'"),
        ([("__metadata__", "U8", [1])], None, "reserved"),
        ([("", "U8", [1])], None, "empty tensor name"),
        ([("a\x01", "U8", [1])], None, "control character"),
        ([("a", "F7", [1])], None, "unknown dtype 'F7'"),
        ([("a", "U8", [-1])], None, "shape must be"),
        ([("a", "U8", [True])], None, "shape must be"),
        ([("a", "U8", [1] * 65)], None, "65 dimensions"),
        ([("a", "U8", [0, 2**63])], None, "2\\*\\*63 or more"),
        ([(1, "U8", [1])], None, "not a string"),
        ([("a", "F4", [1])], None, "whole bytes"),
        ([("a", "U8", [2**32, 2**32])], None, "overflows"),
        ([], {"k": 1}, "__metadata__ entry 'k'"),
        ([], {"k": "\ud800"}, "not valid Unicode"),
        ([("\udc80", "U8", [1])], None, "not valid Unicode"),
    ],
)
def test_emit_header_refuses(tensors: Any, metadata: Any, match: str) -> None:
    with pytest.raises(SafetensorsFormatError, match=match):
        emit_header(tensors, metadata)


metadatas = st.none() | st.dictionaries(
    st.text(st.characters(blacklist_categories=("Cs",)), max_size=8),
    st.text(st.characters(blacklist_categories=("Cs",)), max_size=8),
    max_size=4,
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs, metadatas)
def test_emit_header_round_trip_and_safe_open(spec: list[Any], metadata: dict[str, str] | None) -> None:
    spec = [s for s in spec if whole_bytes(s[1], s[2])]
    header, offsets = emit_header(spec, metadata)
    data_len = offsets[-1][1] if offsets else 0
    layout = parse_header(header, len(header) + data_len)
    assert layout.header_bytes == header and len(header) % 8 == 0
    assert layout.metadata == metadata
    parsed = [(t.name, t.dtype, list(t.shape)) for t in layout.tensors]
    assert parsed == [(n, d, list(s)) for n, d, s in spec]
    assert [(t.begin, t.end) for t in layout.tensors] == offsets
    file = header + bytes(data_len)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "e.safetensors")
        with open(path, "wb") as fh:
            fh.write(file)
        with safe_open(path, framework="pt") as f:
            assert sorted(f.keys()) == sorted(n for n, _, _ in spec)
            assert_offset_order(layout, f.offset_keys())
            assert f.metadata() == metadata
            for name, dtype, shape in spec:
                assert f.get_slice(name).get_dtype() == dtype
                assert f.get_slice(name).get_shape() == list(shape)
