"""Every file the safetensors library reads commits and checks out byte-identical; every file it
refuses is refused with a one-line error (exit 5). The installed library is the oracle: each
vector's expectation is checked against it before ckstore is tested on it."""

from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import SafetensorError, deserialize, safe_open
from safetensors.torch import save

from ckstore.errors import NotFoundError, SafetensorsFormatError
from ckstore.format.safetensors import DTYPE_BITS, parse_header
from ckstore.repo import Repo
from tests.helpers import Cli, assert_one_line_error, tree_digest

ST, PLAIN, REFUSED = "safetensors", "blob", "refused"  # stored as a safetensors entry, as plain bytes


def st_file(header: str | bytes, data: bytes = b"", n: int | None = None) -> bytes:
    """Length prefix (the header's length unless ``n``), header text as given, data."""
    raw = header.encode() if isinstance(header, str) else header
    return struct.pack("<Q", len(raw) if n is None else n) + raw + data


def f32(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


I32_2X2 = '{"test":{"dtype":"I32","shape":[2,2],"data_offsets":[0,16]}}'
ONE = '{"dtype":"U8","shape":[1],"data_offsets":[0,1]}'


def json_attack() -> bytes:
    # tensor.rs test_json_attack: ten tensors all claiming the same 16 bytes.
    tensors = {f"weight_{i}": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]} for i in range(10)}
    return st_file(json.dumps(tensors, separators=(",", ":")), bytes(16))


def truncated_header() -> bytes:
    # test_pread_backend.py test_truncated_header_is_rejected: the header cut in half.
    whole = save({"a": torch.zeros(4), "b": torch.ones(3, dtype=torch.int64)})
    (n,) = struct.unpack("<Q", whole[:8])
    return whole[: 8 + n // 2]


# From safetensors' own test suite (safetensors/src/tensor.rs and bindings/python/tests), written
# out here; then serde/JSON quirks of the reference reader found by probing the library.
VECTORS: list[tuple[str, bytes, str]] = [
    ("rs/empty_shapes_allowed", st_file(I32_2X2.replace("[2,2]", "[]").replace("16]", "4]"), bytes(4)), ST),
    ("rs/deserialization", st_file(I32_2X2, bytes(16)), ST),
    ("rs/json_attack", json_attack(), REFUSED),
    ("rs/metadata_incomplete_buffer", st_file(I32_2X2, bytes(16) + b"extra_bogus_data_for_polyglot_file"), REFUSED),
    ("rs/metadata_missing_2_bytes", st_file(I32_2X2, bytes(14)), REFUSED),
    ("rs/header_too_large", b"<\x00\x00\x00\x00\xff\xff\xff" + I32_2X2.encode() + bytes(16), REFUSED),
    ("rs/header_too_small", b"", REFUSED),
    ("rs/invalid_header_length", st_file(b"", n=60), REFUSED),
    ("rs/invalid_header_non_utf8", st_file(b"\xff"), REFUSED),
    ("rs/invalid_header_not_json", st_file(b"{"), REFUSED),
    ("rs/whitespace_padded_header", st_file(b"{}\r \t\n"), ST),
    ("rs/whitespace_leading_padded_header", st_file(b"\t\n{}\r "), ST),
    ("rs/zero_sized_tensor", st_file('{"test":{"dtype":"I32","shape":[2,0],"data_offsets":[0, 0]}}'), ST),
    ("rs/invalid_info", st_file(I32_2X2.replace("16]", "4]"), bytes(4)), REFUSED),
    ("rs/validation_overflow_1", st_file(I32_2X2.replace("[2,2]", "[2,18446744073709551614]"), bytes(16)), REFUSED),
    ("rs/validation_overflow_2", st_file(I32_2X2.replace("[2,2]", "[2,9223372036854775807]"), bytes(16)), REFUSED),
    (
        "rs/serialization",
        st_file('{"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}}', f32(0, 1, 2, 3, 4, 5)),
        ST,
    ),
    ("rs/serialization_fp4", st_file('{"attn.0":{"dtype":"F4","shape":[1,2],"data_offsets":[0,1]}}    ', b"\0"), ST),
    ("rs/empty", st_file("{}      "), ST),
    ("rs/empty_with_metadata", st_file('{"__metadata__":{"framework":"pt"}}     '), ST),
    (
        "rs/serialization_forced_alignment",
        st_file('{"attn0":{"dtype":"F32","shape":[1,1,2,3],"data_offsets":[0,24]}}       ', f32(0, 1, 2, 3, 4, 5)),
        ST,
    ),
    ("py/serialization", st_file(I32_2X2 + "    ", bytes(12) + b"\x01\0\0\0"), ST),
    (
        "py/deserialization_metadata",
        st_file(
            '{"__metadata__":{"framework":"pt"},"test1":{"dtype":"I32","shape":[2,2],"data_offsets":[0,16]}}       ',
            bytes(16),
        ),
        ST,
    ),
    (
        "py/serialization_forces_alignment",
        st_file(
            '{"test1":{"dtype":"I32","shape":[2,2],"data_offsets":[0,16]},'
            '"test2":{"dtype":"F16","shape":[2,2],"data_offsets":[16,24]}}      ',
            bytes(24),
        ),
        ST,
    ),
    (
        "py/bf16",
        st_file('{"test":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]}}    ', b"\x10@\x80?\x80?\x80?"),
        ST,
    ),
    (
        "py/complex",
        st_file('{"test":{"dtype":"C64","shape":[2,2],"data_offsets":[0,32]}}    ', bytes(24) + f32(-1.0, 1.0)),
        ST,
    ),
    ("py/multiple_zero_sized", save({"test": torch.zeros(2, 0), "test2": torch.zeros(2, 0)}), ST),
    ("py/pread_truncated_header", truncated_header(), REFUSED),
    (
        "py/pread_data_offset_overflow",
        st_file('{"liar":{"dtype":"F32","shape":[1024,1024],"data_offsets":[0,4194304]}}', b"\0"),
        REFUSED,
    ),
    # Quirks of the reference reader (serde_json + serde derive), each checked below against it.
    ("q/metadata_null", st_file('{"__metadata__":null,"a":' + ONE + "}", b"a"), ST),
    (
        "q/unknown_fields_ignored",
        st_file('{"a":{"x":{"k":1,"k":[-0,1e308]},"dtype":"U8","shape":[1],"data_offsets":[0,1],"y":null}}', b"a"),
        ST,
    ),
    ("q/entry_as_array", st_file('{"a":["F16",[2],[0,4]],"b":["U8",[],[4,5]]}', b"abcde"), ST),
    ("q/dtype_as_tagged_object", st_file('{"a":{"dtype":{"U8":null},"shape":[1],"data_offsets":[0,1]}}', b"a"), ST),
    ("q/escaped_keys", st_file('{"\\u0061":{"\\u0064type":"U\\u0038","shape":[1],"data_offsets":[0,1]}}', b"a"), ST),
    (
        "q/offset_order_differs",
        st_file('{"z":{"dtype":"U8","shape":[2],"data_offsets":[1,3]},"a":' + ONE + "}", b"abc"),
        ST,
    ),
    (
        "q/zero_size_everywhere",
        st_file(
            '{"e":{"dtype":"F4","shape":[0],"data_offsets":[3,3]},"m":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},'
            '"s":{"dtype":"F64","shape":[0,5],"data_offsets":[0,0]},"t":{"dtype":"BOOL","shape":[0],"data_offsets":[3,3]}}',
            b"xyz",
        ),
        ST,
    ),
    (
        "q/rank_64",
        st_file('{"a":{"dtype":"U8","shape":[' + ",".join(["1"] * 64) + '],"data_offsets":[0,1]}}', b"a"),
        ST,
    ),
    (
        "q/nesting_127",
        st_file('{"a":{"x":' + "[" * 125 + "]" * 125 + ',"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"a"),
        ST,
    ),
    (
        "q/non_ascii_names",
        st_file('{"naïve.☃":' + ONE + ',"😀":{"dtype":"U8","shape":[0],"data_offsets":[1,1]}}', b"a"),
        ST,
    ),
    (
        "q/repeated_tensor_name",
        st_file('{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},"a":' + ONE + "}", b"a"),
        PLAIN,
    ),
    ("q/repeated_metadata_key", st_file('{"__metadata__":{"k":"1","k":"2"}}'), PLAIN),
    ("q/empty_name", st_file('{"":' + ONE + "}", b"a"), PLAIN),
    ("q/control_char_name", st_file('{"a\\n\\u001b[2J":' + ONE + "}", b"a"), PLAIN),
    (
        "q/rank_65",
        st_file('{"a":{"dtype":"U8","shape":[' + ",".join(["1"] * 65) + '],"data_offsets":[0,1]}}', b"a"),
        PLAIN,
    ),
    ("q/dimension_2_63", st_file('{"a":{"dtype":"U8","shape":[0,9223372036854775808],"data_offsets":[0,0]}}'), PLAIN),
    ("q/form_feed_padding", st_file("{}\f"), REFUSED),
    ("q/nbsp_padding", st_file("{}\u00a0"), REFUSED),
    ("q/bom", st_file("\ufeff{}"), REFUSED),
    ("q/repeated_metadata", st_file('{"__metadata__":{},"__metadata__":{}}'), REFUSED),
    ("q/repeated_field", st_file('{"a":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"a"), REFUSED),
    ("q/negative_zero_dim", st_file('{"a":{"dtype":"U8","shape":[-0],"data_offsets":[0,0]}}'), REFUSED),
    ("q/float_dim", st_file('{"a":{"dtype":"U8","shape":[1.0],"data_offsets":[0,1]}}', b"a"), REFUSED),
    (
        "q/number_out_of_range",
        st_file('{"a":{"x":1e400,"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"a"),
        REFUSED,
    ),
    ("q/lone_surrogate", st_file('{"a":{"x":"\\udc00","dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"a"), REFUSED),
    (
        "q/nesting_128",
        st_file('{"a":{"x":' + "[" * 126 + "]" * 126 + ',"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"a"),
        REFUSED,
    ),
    ("q/entry_array_of_2", st_file('{"a":["U8",[1]]}', b"a"), REFUSED),
    ("q/dtype_tagged_with_value", st_file('{"a":{"dtype":{"U8":{}},"shape":[1],"data_offsets":[0,1]}}', b"a"), REFUSED),
    (
        "q/shadowed_entry_invalid",
        st_file('{"a":{"dtype":"U9","shape":[1],"data_offsets":[0,1]},"a":' + ONE + "}", b"a"),
        REFUSED,
    ),
    (
        "q/zero_size_inside_other",
        st_file(
            '{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"z":{"dtype":"U8","shape":[0],"data_offsets":[1,1]}}',
            b"ab",
        ),
        REFUSED,
    ),
    ("q/hole", st_file('{"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}', b"ab"), REFUSED),
    ("q/header_length_0", st_file(b""), REFUSED),
    ("q/metadata_value_not_string", st_file('{"__metadata__":{"k":1}}'), REFUSED),
]
IDS = [name for name, _, _ in VECTORS]
FILE_NAMES = {name: name.replace("/", "__") + ".safetensors" for name in IDS}


def reference_accepts(file: bytes) -> bool:
    try:
        deserialize(file)
    except SafetensorError:
        return False
    return True


@pytest.mark.parametrize(("name", "file", "expected"), VECTORS, ids=IDS)
def test_vector_agrees_with_safetensors(name: str, file: bytes, expected: str) -> None:
    assert reference_accepts(file) == (expected != REFUSED), "the vector table disagrees with safetensors"
    if len(file) < 8:
        with pytest.raises(SafetensorsFormatError):
            parse_header(file, len(file))
        return
    (n,) = struct.unpack("<Q", file[:8])
    if expected == REFUSED:
        with pytest.raises(SafetensorsFormatError):
            parse_header(file[: 8 + n], len(file))
        return
    layout = parse_header(file[: 8 + n], len(file))
    assert (layout.plain_reason is None) == (expected == ST)
    assert layout.file_size == len(file) and layout.header_bytes == file[: 8 + n]
    reference = dict(deserialize(file))
    assert {t.name: (t.dtype, list(t.shape), file[8 + n + t.begin : 8 + n + t.end]) for t in layout.tensors} == {
        k: (v["dtype"], v["shape"], bytes(v["data"])) for k, v in reference.items()
    }


def test_cli_round_trips_every_accepted_vector(cli: Cli, tmp_path: Path) -> None:  # noqa: F811
    folder = tmp_path / "in"
    folder.mkdir()
    accepted = {n: (f, e) for n, f, e in VECTORS if e != REFUSED}
    for name, (file, _) in accepted.items():
        (folder / FILE_NAMES[name]).write_bytes(file)
    cli("init", str(tmp_path / "repo"), repo=False)
    cli("commit", str(folder), "-m", "vectors")
    kinds = {f["path"]: f["kind"] for f in json.loads(cli("show", "--json").stdout)["files"]}
    assert kinds == {FILE_NAMES[name]: expected for name, (_, expected) in accepted.items()}
    cli("checkout", "HEAD", "-o", str(tmp_path / "out"))
    assert tree_digest(tmp_path / "out") == tree_digest(folder)
    cli("fsck", "--read-data")
    # --only re-emits a header from what ckstore read: safetensors must read the same tensors.
    cli("checkout", "HEAD", "-o", str(tmp_path / "only"), "--only", "a", "--only", "test*", "--only", "attn*")
    for name in (
        "q/entry_as_array",
        "q/dtype_as_tagged_object",
        "q/unknown_fields_ignored",
        "q/escaped_keys",
        "rs/deserialization",
        "rs/serialization_fp4",
        "q/offset_order_differs",
        "q/metadata_null",
    ):
        path = FILE_NAMES[name]
        original = dict(deserialize((folder / path).read_bytes()))
        selected = dict(deserialize((tmp_path / "only" / path).read_bytes()))
        assert selected == {k: v for k, v in original.items() if k == "a" or k.startswith(("test", "attn"))}
        assert selected


@pytest.mark.parametrize("name", [n for n, _, e in VECTORS if e == REFUSED])
def test_cli_refuses_what_safetensors_refuses(cli: Cli, tmp_path: Path, name: str) -> None:  # noqa: F811
    file = {n: f for n, f, _ in VECTORS}[name]
    (tmp_path / "bad.safetensors").write_bytes(file)
    cli("init", str(tmp_path / "repo"), repo=False)
    result = cli("commit", str(tmp_path / "bad.safetensors"), code=SafetensorsFormatError.exit_code)
    assert_one_line_error(result.stderr)
    assert "bad.safetensors is not a valid safetensors file" in result.stderr
    assert "has no commits yet" in cli("log", code=NotFoundError.exit_code).stderr  # nothing stored


# --- generated headers: ckstore accepts exactly what safetensors accepts, and round-trips it ---

DTYPES = sorted(DTYPE_BITS)
# Hypothesis favours boundary values, so "== 0" would fire far more often than one time in n.
SOMETIMES = st.integers(0, 5).map(lambda i: i == 3)
RARELY = st.integers(0, 19).map(lambda i: i == 13)
WHITESPACE = st.text(st.sampled_from(" \t\r\n"), max_size=3)
NAMES = st.sampled_from(["a", "b", "c", "w.0", "☃", "__METADATA__"] * 3 + ["", "a\x01", "__metadata__"])


def dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


@st.composite
def json_object(draw: st.DrawFn, pairs: list[tuple[str, str]]) -> str:
    """Raw JSON text of an object from (key, raw value) pairs; repeats kept, spacing varied."""
    ws = draw(WHITESPACE)
    return "{" + ws + ",".join(f"{dump(k)}{ws}:{ws}{v}" for k, v in pairs) + ws + "}"


# Mostly harmless, sometimes fatal (out of range, lone surrogate): sampled_from weights evenly.
ODD_NUMBERS = st.sampled_from(["-0", "1e308", "-1.5e-400", "0e999", "9" * 25, "1.0", "2"] * 3 + ["1e400", "9" * 400])
IGNORED = st.recursive(
    st.sampled_from(["null", "true", "[]", "{}", '"s"', '"\\ud83d\\ude00"'] * 3 + ['"\\udc00"']) | ODD_NUMBERS,
    lambda inner: st.lists(inner, max_size=3).map(lambda xs: "[" + ",".join(xs) + "]"),
    max_leaves=6,
)


@st.composite
def tensor_entry(draw: st.DrawFn, begin: int, dtype: str, shape: list[int]) -> tuple[str, int]:
    """A plausible tensor entry (raw JSON) laid at ``begin``, maybe damaged; returns its end."""
    count = 1
    for d in shape:
        count *= d
    end = begin + count * DTYPE_BITS[dtype] // 8
    if draw(RARELY):
        end += draw(st.sampled_from([-1, 1]))
    dtype_json = draw(st.sampled_from([dump(dtype)] * 6 + [f"{{{dump(dtype)}:null}}", f"{{{dump(dtype)}:[]}}"]))
    shape_json = "[" + draw(ODD_NUMBERS) + "]" if draw(RARELY) else dump(shape)
    fields = [dtype_json, shape_json, dump([begin, max(end, 0)])]
    if draw(SOMETIMES):
        return "[" + ",".join(fields[: draw(st.sampled_from([3, 3, 3, 2]))]) + "]", end
    pairs = list(zip(["dtype", "shape", "data_offsets"], fields))
    extra = draw(st.lists(st.tuples(st.sampled_from(["x", "y"] * 4 + ["dtype"]), IGNORED), max_size=2))
    order = draw(st.permutations(pairs + extra))
    return draw(json_object(order)), end


@st.composite
def headers(draw: st.DrawFn) -> tuple[bytes, int]:
    """Raw header JSON (padding included) and the data length it implies."""
    pairs: list[tuple[str, str]] = []
    position = 0
    for _ in range(draw(st.integers(0, 4))):
        dtype = draw(st.sampled_from(DTYPES))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        if sum(DTYPE_BITS[dtype] * (d or 1) for d in shape) % 8 and draw(st.booleans()):
            shape = [*shape, 8]  # usually whole bytes
        raw, end = draw(tensor_entry(position, dtype, shape))
        pairs.append((draw(NAMES), raw))
        position = max(position, end)
    if draw(st.booleans()):
        values = st.sampled_from(['"v"', '"\\u00e9"'] * 4 + ["1", "null"])
        objects = st.lists(st.tuples(st.sampled_from("kjl"), values), max_size=3).flatmap(json_object)
        meta = draw(st.sampled_from(["null", "null", "[]"]) if draw(SOMETIMES) else objects)
        pairs.insert(draw(st.integers(0, len(pairs))), ("__metadata__", meta))
    junk = draw(st.sampled_from(["\f", "x"])) if draw(RARELY) else ""
    body = draw(WHITESPACE) + draw(json_object(pairs)) + draw(WHITESPACE) + junk
    return body.encode("utf-8", "surrogatepass"), max(position + int(draw(RARELY)), 0)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(headers())
def test_generated_headers_agree_with_safetensors_and_round_trip(case: tuple[bytes, int]) -> None:
    body, data_len = case
    file = struct.pack("<Q", len(body)) + body + bytes(range(256)) * (data_len // 256) + bytes(data_len % 256)
    header = file[: 8 + len(body)]
    try:
        layout = parse_header(header, len(file))
    except SafetensorsFormatError:
        layout = None
    assert (layout is not None) == reference_accepts(file)
    if layout is None:
        return
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp, "in", "f.safetensors")
        source.parent.mkdir()
        source.write_bytes(file)
        with safe_open(str(source), "np") as f:
            assert layout.metadata == f.metadata()
            assert {t.name: (t.dtype, list(t.shape)) for t in layout.tensors} == {
                k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape())
                for k in f.keys()  # noqa: SIM118
            }
        repo = Repo.memory(chunk_size=4096)
        oid = repo.commit(str(source))
        [entry] = repo.show(oid)[1].files
        assert entry.kind == (ST if layout.plain_reason is None else PLAIN)
        repo.checkout(oid, os.path.join(tmp, "out"))
        assert Path(tmp, "out", "f.safetensors").read_bytes() == file
