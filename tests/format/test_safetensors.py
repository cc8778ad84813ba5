"""Tests for ckstore.format.safetensors, cross-checked against the safetensors library itself."""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import SafetensorError, deserialize, safe_open
from safetensors.torch import save, save_file

from ckstore.errors import SafetensorsFormatError
from ckstore.format.safetensors import (
    DTYPE_BITS,
    MAX_HEADER_SIZE,
    SafetensorsLayout,
    TensorInfo,
    emit_header,
    header_length,
    parse_header,
)

# Every torch dtype safetensors.torch.save_file can write, with the header dtype it writes.
TORCH_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint64: "U64", torch.uint32: "U32", torch.uint16: "U16", torch.uint8: "U8",
    torch.bool: "BOOL", torch.complex64: "C64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2: "F8_E5M2", torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.float8_e8m0fnu: "F8_E8M0", torch.float4_e2m1fn_x2: "F4",
}  # fmt: skip


def make_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    # Random bytes reinterpreted, so every dtype (even float8/float4) gets distinctive content.
    g = torch.Generator().manual_seed(seed)
    item = torch.empty((), dtype=dtype).element_size()
    count = 1
    for d in shape:
        count *= d
    raw = torch.randint(0, 256, (count * item,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


def split(file: bytes) -> tuple[bytes, int]:
    return file[: 8 + header_length(file[:8])], len(file)


def crafted(header: Any, data_len: int | None = None, pad: bytes = b"", raw: bytes | None = None) -> tuple[bytes, int]:
    """Header bytes and file size for a hand-made header (JSON value or raw JSON bytes)."""
    body = raw if raw is not None else json.dumps(header).encode()
    body += pad
    if data_len is None:
        offsets = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
        data_len = max(offsets, default=0)
    return struct.pack("<Q", len(body)) + body, 8 + len(body) + data_len


def entry(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def assert_fails(match: str, header_bytes: bytes, file_size: int) -> None:
    with pytest.raises(SafetensorsFormatError, match=match):
        parse_header(header_bytes, file_size)


# --- files written by safetensors itself ---------------------------------------------------


def assert_offset_order(layout: SafetensorsLayout, offset_keys: list[str]) -> None:
    # safetensors orders zero-size tensors that share an offset arbitrarily (HashMap order), so
    # only the (begin, end) sequence is comparable, not the names at tied positions.
    by_name = {t.name: (t.begin, t.end) for t in layout.tensors}
    assert [by_name[k] for k in offset_keys] == [(t.begin, t.end) for t in layout.tensors]


def check_against_safetensors(path: str, layout: SafetensorsLayout, file: bytes) -> None:
    with safe_open(path, framework="pt") as f:
        assert sorted(t.name for t in layout.tensors) == sorted(f.keys())
        assert_offset_order(layout, f.offset_keys())
        assert layout.metadata == f.metadata()
        for t in layout.tensors:
            sl = f.get_slice(t.name)
            assert t.dtype == sl.get_dtype()
            assert list(t.shape) == sl.get_shape()
            loaded = f.get_tensor(t.name)
            data = file[layout.data_offset + t.begin : layout.data_offset + t.end]
            assert loaded.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() == data


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES), ids=str)
def test_every_torch_dtype_matches_safe_open(dtype: torch.dtype, tmp_path: Any) -> None:
    tensors = {
        "matrix": make_tensor(dtype, (3, 4), seed=1),
        "scalar": make_tensor(dtype, (), seed=2),
        "empty": make_tensor(dtype, (0, 5), seed=3),
        "vector": make_tensor(dtype, (7,), seed=4),
    }
    if dtype == torch.float4_e2m1fn_x2:
        # A 0-d x2 tensor holds two F4 elements; safetensors refuses to write it as shape [].
        del tensors["scalar"]
    path = str(tmp_path / "f.safetensors")
    save_file(tensors, path)
    with open(path, "rb") as fh:
        file = fh.read()
    layout = parse_header(*split(file))
    assert layout.file_size == len(file)
    assert layout.header_bytes == file[: layout.data_offset]
    assert {t.dtype for t in layout.tensors} == {TORCH_DTYPES[dtype]}
    check_against_safetensors(path, layout, file)


def test_mixed_file_with_metadata(tmp_path: Any) -> None:
    tensors = {f"t{i}.{d}": make_tensor(d, (i + 1, 2), seed=i) for i, d in enumerate(TORCH_DTYPES)}
    tensors["zero"] = torch.zeros(0)
    tensors["0d"] = torch.tensor(3.5)
    meta = {"format": "pt", "note": "naïve ☃ \n tab\t"}
    path = str(tmp_path / "m.safetensors")
    save_file(tensors, path, metadata=meta)
    with open(path, "rb") as fh:
        file = fh.read()
    layout = parse_header(*split(file))
    assert layout.metadata == meta
    assert {t.name for t in layout.tensors} == set(tensors)
    by_name = {t.name: t for t in layout.tensors}
    assert by_name["0d"].shape == () and by_name["0d"].nbytes == 4
    assert by_name["zero"].shape == (0,) and by_name["zero"].nbytes == 0
    check_against_safetensors(path, layout, file)


def test_no_tensors_and_no_metadata() -> None:
    file = save({})
    layout = parse_header(*split(file))
    assert layout.tensors == () and layout.metadata is None
    assert layout.file_size == len(file) == layout.data_offset


def test_layout_properties() -> None:
    header, size = crafted({"a": entry("F32", [2], 0, 8), "b": entry("U8", [3], 8, 11)})
    layout = parse_header(header, size)
    assert layout.data_offset == len(header)
    assert layout.file_size == size
    assert layout.tensors == (
        TensorInfo("a", "F32", (2,), 0, 8),
        TensorInfo("b", "U8", (3,), 8, 11),
    )
    assert layout.tensors[1].nbytes == 3


def test_order_is_by_offset_and_stable_for_zero_size() -> None:
    header, size = crafted(
        {
            "late": entry("U8", [2], 4, 6),
            "z2": entry("U8", [0], 4, 4),
            "early": entry("U8", [4], 0, 4),
            "z1": entry("U8", [0], 4, 4),
            "z0": entry("F32", [0], 0, 0),
            "end": entry("U8", [0], 6, 6),
        }
    )
    names = [t.name for t in parse_header(header, size).tensors]
    assert names == ["z0", "early", "z2", "z1", "late", "end"]


def test_dtype_table() -> None:
    assert len(DTYPE_BITS) == 22
    assert DTYPE_BITS["F4"] == 4 and DTYPE_BITS["F6_E3M2"] == 6 and DTYPE_BITS["C64"] == 64
    assert "C128" not in DTYPE_BITS
    assert set(TORCH_DTYPES.values()) <= set(DTYPE_BITS)


def test_sub_byte_dtypes() -> None:
    header, size = crafted({"a": entry("F6_E2M3", [4], 0, 3), "b": entry("F4", [2, 3], 3, 6)})
    assert [t.nbytes for t in parse_header(header, size).tensors] == [3, 3]
    assert_fails("do not fill whole bytes", *crafted({"a": entry("F4", [3], 0, 2)}))
    assert_fails("do not fill whole bytes", *crafted({"a": entry("F6_E3M2", [2], 0, 2)}))


def test_padding_whitespace_accepted() -> None:
    header, size = crafted({"a": entry("U8", [1], 0, 1)}, pad=b"      \n\t\r")
    assert parse_header(header, size).tensors[0].name == "a"


# --- one test per failure rule -------------------------------------------------------------


def test_prefix_too_short() -> None:
    with pytest.raises(SafetensorsFormatError, match="shorter than the 8-byte header length"):
        header_length(b"\x01\x00")
    assert_fails("shorter than the 8-byte", b"", 0)


def test_header_length_zero() -> None:
    with pytest.raises(SafetensorsFormatError, match="header length is 0"):
        header_length(bytes(8))


def test_header_length_too_large() -> None:
    prefix = struct.pack("<Q", MAX_HEADER_SIZE + 1)
    with pytest.raises(SafetensorsFormatError, match="exceeds the limit"):
        header_length(prefix)
    with pytest.raises(SafetensorsFormatError, match="exceeds the limit"):
        header_length(b"\xff" * 8)
    assert header_length(struct.pack("<Q", MAX_HEADER_SIZE) + b"xyz") == MAX_HEADER_SIZE


def test_header_runs_past_end_of_file() -> None:
    prefix = struct.pack("<Q", 999999)
    assert_fails("header length 999999 runs past the end of the 120-byte file", prefix, 120)


def test_header_bytes_wrong_length() -> None:
    header, size = crafted({"a": entry("U8", [1], 0, 1)})
    assert_fails("header bytes but the header length says", header[:-1], size)
    assert_fails("header bytes but the header length says", header + b"\0", size)


def test_invalid_utf8() -> None:
    assert_fails("not valid UTF-8", *crafted(None, 0, raw=b'{"\xff":1}'))


def test_json_whitespace_before_and_after() -> None:
    # serde_json skips space, tab, CR and LF around the value, and nothing else.
    assert parse_header(*crafted(None, 0, raw=b" \t\r\n{} \t\r\n")).tensors == ()
    for bad in (b"\x0c{}", b"{}\x0c", b"\xc2\xa0{}", b"{}\xe2\x80\xa8", b"\xef\xbb\xbf{}"):
        assert_fails("not valid JSON", *crafted(None, 0, raw=bad))
    assert_fails("header JSON is not an object", *crafted(None, 0, raw=b"[]"))
    assert_fails("header JSON is not an object", *crafted(None, 0, raw=b' "{}" '))


def test_invalid_json() -> None:
    assert_fails("not valid JSON", *crafted(None, 0, raw=b'{"a":'))
    assert_fails("not valid JSON", *crafted(None, 0, raw=b"{} x"))
    assert_fails("not valid JSON", *crafted(None, 0, raw=b"{}\0\0"))
    assert_fails("out of range", *crafted(None, 0, raw=b'{"a":[' + b"9" * 5000 + b"]}"))


def test_duplicate_keys_by_position() -> None:
    # A repeated tensor name or metadata key: safetensors keeps the last; ckstore stores it plain.
    a = json.dumps(entry("U8", [1], 0, 1))
    twice = parse_header(*crafted(None, 1, raw=f'{{"w":{a},"w":{a}}}'.encode()))
    assert twice.plain_reason == "tensor name 'w' appears twice in the header"
    assert [t.name for t in twice.tensors] == ["w"]
    # The shadowed entry's offsets are never checked, its types are (as in safetensors).
    shadowed = b'{"w":{"dtype":"U8","shape":[1],"data_offsets":[9,2]},"w":' + a.encode() + b"}"
    assert parse_header(*crafted(None, 1, raw=shadowed)).plain_reason is not None
    bad_shadow = b'{"w":{"dtype":"U9","shape":[1],"data_offsets":[0,1]},"w":' + a.encode() + b"}"
    assert_fails("unknown dtype 'U9'", *crafted(None, 1, raw=bad_shadow))
    meta = parse_header(*crafted(None, 0, raw=b'{"__metadata__":{"k":"a","j":"x","k":"b"}}'))
    assert meta.metadata == {"k": "b", "j": "x"}
    assert meta.plain_reason == "__metadata__ key 'k' appears twice"
    # A repeated struct field or __metadata__ is an error in safetensors.
    inner = b'{"w":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    assert_fails("tensor 'w': duplicate key 'dtype'", *crafted(None, 1, raw=inner))
    assert_fails("duplicate key '__metadata__'", *crafted(None, 0, raw=b'{"__metadata__":null,"__metadata__":{}}'))
    # Inside an ignored field repeats do not matter.
    ignored = b'{"w":{"x":{"k":1,"k":2},"x":0,"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    assert parse_header(*crafted(None, 1, raw=ignored)).plain_reason is None


def test_nan_and_infinity_refused() -> None:
    for constant in (b"NaN", b"Infinity", b"-Infinity"):
        raw = b'{"w":{"dtype":"U8","shape":[' + constant + b'],"data_offsets":[0,1]}}'
        assert_fails("non-standard constant", *crafted(None, 1, raw=raw))


def test_deep_nesting_refused() -> None:
    raw = b'{"w":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(SafetensorsFormatError, match="nested"):
        parse_header(*crafted(None, 0, raw=raw))
    # serde_json's limit: 127 levels (the header object is the first), even in an ignored field.
    for depth, ok in ((125, True), (126, False)):
        raw = b'{"w":{"x":' + b"[" * depth + b"]" * depth + b',"dtype":"U8","shape":[],"data_offsets":[0,1]}}'
        if ok:
            assert parse_header(*crafted(None, 1, raw=raw)).tensors[0].name == "w"
        else:
            assert_fails("nested more than 127 levels deep", *crafted(None, 1, raw=raw))
    raw = b'{"w":{"dtype":"U8","shape":[[[[1]]]],"data_offsets":[0,1]}}'
    assert_fails("shape must be a list of non-negative integers", *crafted(None, 1, raw=raw))


def test_metadata_must_be_string_map() -> None:
    assert_fails("__metadata__ is not an object", *crafted({"__metadata__": ["a"]}))
    assert parse_header(*crafted({"__metadata__": None})).metadata is None  # serde's Option
    assert_fails("__metadata__ entry 'n'", *crafted({"__metadata__": {"n": 1}}))
    assert_fails("__metadata__ entry 'o'", *crafted({"__metadata__": {"o": {"a": "b"}}}))
    surrogate = b'{"__metadata__":{"k":"\\ud800"}}'
    assert_fails("not valid Unicode", *crafted(None, 0, raw=surrogate))


def test_metadata_only_file() -> None:
    layout = parse_header(*crafted({"__metadata__": {}}))
    assert layout.metadata == {} and layout.tensors == ()


def test_tensor_name_rules() -> None:
    # safetensors reads these names; ckstore stores such a file as plain bytes.
    def reason(name: str) -> str | None:
        return parse_header(*crafted({name: entry("U8", [1], 0, 1)})).plain_reason

    assert reason("") == "empty tensor name in header"
    for name in ("a\x00b", "a\nb", "a\x1b[31m", "a\x7f", "a\x85"):
        assert reason(name) == f"tensor name {name!r} contains a control character"
    assert reason("naïve ☃ 😀 \u2028") is None and reason("__METADATA__") is None
    raw = b'{"\\udc00":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    assert_fails("not valid Unicode", *crafted(None, 1, raw=raw))


def test_tensor_entry_forms() -> None:
    assert_fails("entry is not an object", *crafted({"w": None}, 0))
    assert_fails("entry is not an object", *crafted({"w": "U8"}, 0))
    # Unknown fields are ignored, as safetensors does; the stored header bytes keep them.
    extra = dict(entry("U8", [1], 0, 1), extra={"any": [1, -0, 2.5e3, None, True]})
    layout = parse_header(*crafted({"w": extra}, 1))
    assert layout.tensors == (TensorInfo("w", "U8", (1,), 0, 1),) and layout.plain_reason is None
    missing = {"dtype": "U8", "shape": [1]}
    assert_fails("missing key 'data_offsets'", *crafted({"w": missing}, 1))
    # serde reads a struct from the array of its fields, and an enum from {"variant": null}.
    as_array = parse_header(*crafted({"w": ["F16", [2], [0, 4]]}, 4))
    assert as_array.tensors == (TensorInfo("w", "F16", (2,), 0, 4),)
    tagged = parse_header(*crafted({"w": [{"I8": None}, [], [0, 1]]}, 1))
    assert tagged.tensors == (TensorInfo("w", "I8", (), 0, 1),)
    assert_fails("array of 2 items", *crafted({"w": ["U8", [1]]}, 1))
    assert_fails("array of 4 items", *crafted({"w": ["U8", [1], [0, 1], 0]}, 1))
    for dtype in ({"U8": {}}, {"U8": 1}, {}, {"U8": None, "I8": None}):
        assert_fails("neither a string nor", *crafted({"w": entry(dtype, [1], 0, 1)}, 1))  # type: ignore[arg-type]
    assert_fails("unknown dtype 'X'", *crafted({"w": entry({"X": None}, [1], 0, 1)}, 1))  # type: ignore[arg-type]


def test_unknown_dtype() -> None:
    assert_fails("unknown dtype 'F7'", *crafted({"w": entry("F7", [1], 0, 1)}))
    assert_fails("unknown dtype 'f32'", *crafted({"w": entry("f32", [1], 0, 4)}))
    assert_fails("unknown dtype 'C128'", *crafted({"w": entry("C128", [1], 0, 16)}))
    not_a_string = {"dtype": 8, "shape": [1], "data_offsets": [0, 1]}
    assert_fails("unknown dtype 8", *crafted({"w": not_a_string}))


@pytest.mark.parametrize("shape", [[-1], [1.0], [True], ["2"], 3, None, [2**64], {"a": 1}])
def test_bad_shape(shape: Any) -> None:
    header = {"w": {"dtype": "U8", "shape": shape, "data_offsets": [0, 1]}}
    assert_fails("shape must be a list of non-negative integers", *crafted(header, 1))


def test_shapes_beyond_the_manifest_are_plain() -> None:
    layout = parse_header(*crafted({"w": entry("U8", [1] * 64, 0, 1)}))
    assert layout.tensors[0].shape == (1,) * 64 and layout.plain_reason is None
    layout = parse_header(*crafted({"w": entry("U8", [1] * 65, 0, 1)}))
    assert layout.plain_reason == "tensor 'w': shape has 65 dimensions, more than 64"
    huge = parse_header(*crafted({"w": entry("U8", [0, 2**63], 0, 0)}))
    assert huge.plain_reason is not None and "2**63 or more" in huge.plain_reason
    assert parse_header(*crafted({"w": entry("U8", [0, 2**63 - 1], 0, 0)})).plain_reason is None


def test_numbers_as_serde_reads_them() -> None:
    # -0 is the float -0.0 to serde_json; integers beyond u64 are floats; both are no sizes.
    assert_fails(r"got \[-0.0\]", *crafted(None, 0, raw=b'{"w":{"dtype":"U8","shape":[-0],"data_offsets":[0,0]}}'))
    in_ignored = b'{"w":{"x":[-0,1e308,-1e-400,0e99999,%s],"dtype":"U8","shape":[],"data_offsets":[0,1]}}'
    assert parse_header(*crafted(None, 1, raw=in_ignored % (b"9" * 300))).tensors[0].name == "w"
    for number in (b"1e400", b"-1.8e308", b"9" * 400, b"-" + b"9" * 400):
        assert_fails("out of range", *crafted(None, 1, raw=in_ignored % number))


@pytest.mark.parametrize("offsets", [[0], [0, 1, 2], [-1, 0], [0.0, 1], [False, True], "01", [0, 2**64]])
def test_bad_data_offsets(offsets: Any) -> None:
    header = {"w": {"dtype": "U8", "shape": [1], "data_offsets": offsets}}
    assert_fails("data_offsets must be two non-negative integers", *crafted(header, 1))


def test_offsets_reversed() -> None:
    header, size = crafted({"w": entry("U8", [0], 4, 0)}, 4)
    assert_fails(r"data_offsets \[4, 0\] end before they begin", header, size)


def test_size_mismatch() -> None:
    assert_fails("span 10 bytes but F32 \\[2\\] needs 8", *crafted({"w": entry("F32", [2], 0, 10)}))


def test_size_overflow() -> None:
    big = 2**32
    assert_fails("element count .* overflows", *crafted({"w": entry("U8", [big, big], 0, 0)}, 0))
    # A later zero does not excuse the overflow, as with Rust's checked_mul.
    assert_fails("element count .* overflows", *crafted({"w": entry("U8", [big, big, 0], 0, 0)}, 0))
    assert_fails("bit size .* overflows", *crafted({"w": entry("F64", [2**61], 0, 0)}, 0))
    # 2**61 - 1 bytes fit in 64 bits of size: the offsets are simply wrong.
    assert_fails("needs", *crafted({"w": entry("U8", [2**61 - 1], 0, 1)}, 1))


def test_overlap() -> None:
    header = {"w": entry("U8", [10], 0, 10), "b": entry("U8", [8], 8, 16)}
    assert_fails(r"tensor 'b': data_offsets \[8, 16\] overlap tensor 'w'", *crafted(header))
    inside = {"w": entry("U8", [8], 0, 8), "z": entry("U8", [0], 4, 4)}
    assert_fails("overlap tensor 'w'", *crafted(inside))
    same = {"w": entry("U8", [8], 0, 8), "v": entry("U8", [8], 0, 8)}
    assert_fails("overlap", *crafted(same))


def test_hole() -> None:
    header = {"a": entry("U8", [16], 0, 16), "b": entry("U8", [8], 24, 32)}
    assert_fails("hole in the data between offset 16 and 24", *crafted(header))
    assert_fails("hole in the data between offset 0 and 4", *crafted({"a": entry("U8", [4], 4, 8)}))


def test_trailing_bytes() -> None:
    header, size = crafted({"a": entry("U8", [4], 0, 4)}, data_len=7)
    assert_fails("3 trailing bytes after the last tensor", header, size)


def test_data_runs_past_end() -> None:
    header, size = crafted({"a": entry("U8", [4], 0, 4)}, data_len=3)
    assert_fails(r"tensor 'a': data_offsets \[0, 4\] run past the end of the file", header, size)


def test_no_tensors_requires_empty_data() -> None:
    header, size = crafted({}, data_len=5)
    assert_fails("5 bytes of data after a header that declares no tensors", header, size)


def test_not_an_object() -> None:
    # Starts with '{' but is not JSON; a JSON non-object cannot start with '{'.
    assert_fails("not valid JSON", *crafted(None, 0, raw=b"{1:2}"))


# --- strategies shared with test_safetensors_emit.py ----------------------------------------


names = st.text(st.characters(blacklist_categories=("Cc", "Cs")), min_size=1, max_size=12).filter(
    lambda s: s != "__metadata__"
)
small_shapes = st.lists(st.integers(0, 5), max_size=4)
specs = st.lists(
    st.tuples(names, st.sampled_from(sorted(DTYPE_BITS)), small_shapes),
    max_size=8,
    unique_by=lambda t: t[0],
)


def whole_bytes(dtype: str, shape: list[int]) -> bool:
    count = 1
    for d in shape:
        count *= d
    return count * DTYPE_BITS[dtype] % 8 == 0


# --- robustness: only SafetensorsFormatError, and never accept what safetensors refuses -------


def parse_or_format_error(header_bytes: bytes, file_size: int) -> SafetensorsLayout | None:
    try:
        return parse_header(header_bytes, file_size)
    except SafetensorsFormatError:
        return None


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64), st.integers(-5, 200))
def test_random_bytes_only_format_errors(data: bytes, extra: int) -> None:
    parse_or_format_error(data, len(data) + extra)
    # Also with a plausible length prefix, so the JSON stage is reached.
    header = struct.pack("<Q", len(data)) + data
    parse_or_format_error(header, len(header) + max(extra, 0))


json_scalars = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True)
    | st.text(max_size=6) | st.sampled_from(sorted(DTYPE_BITS))
)  # fmt: skip
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
plausible_entries = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(sorted(DTYPE_BITS)) | json_scalars,
        "shape": st.lists(st.integers(-1, 4), max_size=3) | json_values,
        "data_offsets": st.lists(st.integers(-1, 40), min_size=0, max_size=3) | json_values,
    },
    optional={"extra": json_values},
)
plausible_headers = st.dictionaries(
    st.sampled_from(["a", "b", "c", "__metadata__", "", "x\x00"]) | st.text(max_size=4),
    plausible_entries | st.dictionaries(st.text(max_size=3), st.text(max_size=3)) | json_values,
    max_size=5,
)


@settings(max_examples=400, deadline=None)
@given(
    plausible_headers | json_values,
    st.sampled_from([b"", b"  ", b" \n", b"\0", b"x"]),
    st.integers(0, 64),
)
def test_random_json_only_format_errors(document: Any, pad: bytes, data_len: int) -> None:
    body = json.dumps(document).encode("utf-8", "surrogatepass") + pad
    header = struct.pack("<Q", len(body)) + body
    layout = parse_or_format_error(header, len(header) + data_len)
    try:
        reference = dict(deserialize(header + bytes(data_len)))
    except SafetensorError:
        reference = None
    # We accept exactly what the reference reader accepts, with the same tensors and layout.
    assert (layout is None) == (reference is None)
    if layout is not None and reference is not None:
        assert set(reference) == {t.name for t in layout.tensors}
        for t in layout.tensors:
            assert reference[t.name]["dtype"] == t.dtype
            assert reference[t.name]["shape"] == list(t.shape)
            assert len(reference[t.name]["data"]) == t.nbytes
        assert layout.file_size == len(header) + data_len


@st.composite
def near_valid_files(draw: st.DrawFn) -> tuple[bytes, int]:
    """A valid header and data length, then maybe one small corruption of the layout."""
    spec = [s for s in draw(specs) if whole_bytes(s[1], s[2])]
    header, offsets = emit_header(spec, None)
    document = json.loads(header[8:])
    data_len = offsets[-1][1] if offsets else 0
    if spec and draw(st.booleans()):
        name = draw(st.sampled_from([n for n, _, _ in spec]))
        targets = [("data_offsets", 0), ("data_offsets", 1), ("shape", 0)]
        field, index = draw(st.sampled_from(targets))
        values = document[name][field]
        if index < len(values):
            values[index] = max(0, values[index] + draw(st.sampled_from([-2, -1, 1, 2])))
    elif draw(st.booleans()):
        data_len = max(0, data_len + draw(st.sampled_from([-1, 1, 3])))
    items = list(document.items())
    body = json.dumps(dict(draw(st.permutations(items))), ensure_ascii=False).encode()
    return struct.pack("<Q", len(body)) + body, data_len


@settings(max_examples=300, deadline=None)
@given(near_valid_files())
def test_agrees_with_safetensors_on_near_valid_files(case: tuple[bytes, int]) -> None:
    header, data_len = case
    file = header + bytes(data_len)
    try:
        reference = dict(deserialize(file))
    except SafetensorError:
        reference = None
    layout = parse_or_format_error(header, len(file))
    assert (layout is None) == (reference is None)
    if layout is not None and reference is not None:
        assert {t.name: (t.dtype, list(t.shape), t.nbytes) for t in layout.tensors} == {
            k: (v["dtype"], v["shape"], len(v["data"])) for k, v in reference.items()
        }
