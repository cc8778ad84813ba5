"""Strict parsing and emission of safetensors headers.

A safetensors file is ``u64 N`` (little-endian), then N bytes of UTF-8 JSON, then the data
section. The JSON maps tensor names to ``{"dtype", "shape", "data_offsets"}`` (offsets relative
to the data section) plus an optional ``"__metadata__"`` object of strings.

The rules follow the safetensors Rust parser, which is the reference reader, but are stricter
wherever that parser is lenient or nondeterministic, because ckstore content-addresses what it
accepts and must never store a file that some reader interprets differently:

* ``0 < N <= MAX_HEADER_SIZE`` and ``8 + N <= file size``; the JSON starts with ``{`` and may
  only be followed by whitespace (the writer pads with spaces to an 8-byte boundary).
* duplicate keys (any level), NaN/Infinity, unknown or extra fields are refused.
* every integer fits a u64 and sizes are computed with the Rust overflow checks:
  ``prod(shape) * bits`` must not overflow, must be whole bytes, and must equal the byte span.
* sorted by ``(begin, end)`` (ties in JSON key order) the tensors tile the data section exactly:
  no hole, no overlap, no trailing byte.

No file I/O happens here: callers read the bytes and pass them in.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from ckstore.errors import SafetensorsFormatError

MAX_HEADER_SIZE: int = 100_000_000

# Mirrors `Dtype::bitsize` of the safetensors Rust crate (0.8): exactly the dtypes it can read.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8,
    "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
    "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}  # fmt: skip

_PREFIX_LEN = 8
_METADATA_KEY = "__metadata__"
_TENSOR_FIELDS = ("dtype", "shape", "data_offsets")
# The Rust reader holds sizes and offsets in usize; refusing beyond u64 keeps us in agreement.
_U64_MAX = 2**64 - 1
_MAX_DIMS = 64
# C0, DEL and C1 controls: invisible in listings and unsafe in paths, so never a tensor name.
_CONTROL_CHARS = re.compile("[\x00-\x1f\x7f-\x9f]")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsLayout:
    header_bytes: bytes
    metadata: dict[str, str] | None
    tensors: tuple[TensorInfo, ...]

    @property
    def data_offset(self) -> int:
        return len(self.header_bytes)

    @property
    def file_size(self) -> int:
        return self.data_offset + max((t.end for t in self.tensors), default=0)


def _fail(message: str) -> NoReturn:
    raise SafetensorsFormatError(message)


def header_length(prefix: bytes) -> int:
    """Return N, the JSON header length announced by the first 8 bytes of a file."""
    if len(prefix) < _PREFIX_LEN:
        _fail("file is shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", bytes(prefix[:_PREFIX_LEN]))
    if n == 0:
        _fail("header length is 0")
    if n > MAX_HEADER_SIZE:
        _fail(f"header length {n} exceeds the limit of {MAX_HEADER_SIZE} bytes")
    return int(n)


def _check_text(value: str, what: str) -> None:
    # json.loads lets lone surrogates (\ud800) through; they cannot be written back as UTF-8.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        _fail(f"{what} {value!r} is not valid Unicode")


def _check_name(name: Any) -> str:
    if not isinstance(name, str):
        _fail(f"tensor name {name!r} is not a string")
    if not name:
        _fail("empty tensor name in header")
    _check_text(name, "tensor name")
    if _CONTROL_CHARS.search(name):
        _fail(f"tensor name {name!r} contains a control character")
    return name


def _check_metadata(metadata: Any) -> dict[str, str]:
    if not isinstance(metadata, Mapping):
        _fail("__metadata__ is not an object")
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            _fail(f"__metadata__ entry {key!r} is not a string-to-string pair")
        _check_text(key, "__metadata__ key")
        _check_text(value, "__metadata__ value")
    return dict(metadata)


def _is_u64(value: Any) -> bool:
    # bool is an int subclass; true/false in a shape is a malformed file, not 1 or 0.
    return type(value) is int and 0 <= value <= _U64_MAX


def _check_shape(name: str, shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, (list, tuple)) or not all(_is_u64(d) for d in shape):
        _fail(f"tensor {name!r}: shape must be a list of non-negative integers, got {shape!r}")
    if len(shape) > _MAX_DIMS:
        _fail(f"tensor {name!r}: shape has {len(shape)} dimensions, more than {_MAX_DIMS}")
    return tuple(shape)


def _data_size(name: str, dtype: str, shape: tuple[int, ...]) -> int:
    """Byte size of the tensor, with the overflow and whole-byte checks of the Rust reader."""
    count = 1
    for dim in shape:
        # Checked at each step like usize::checked_mul: a later 0 does not excuse an overflow.
        count *= dim
        if count > _U64_MAX:
            _fail(f"tensor {name!r}: element count of shape {list(shape)} overflows 64 bits")
    bits = count * DTYPE_BITS[dtype]
    if bits > _U64_MAX:
        _fail(f"tensor {name!r}: bit size of shape {list(shape)} overflows 64 bits")
    if bits % 8:
        _fail(f"tensor {name!r}: {count} elements of {dtype} do not fill whole bytes")
    return bits // 8


def _check_dtype(name: str, dtype: Any) -> str:
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        _fail(f"tensor {name!r}: unknown dtype {dtype!r}")
    return dtype


def _parse_tensor(name: str, entry: Any) -> TensorInfo:
    if not isinstance(entry, dict):
        _fail(f"tensor {name!r}: entry is not an object")
    for key in entry:
        if key not in _TENSOR_FIELDS:
            _fail(f"tensor {name!r}: unexpected key {key!r}")
    for key in _TENSOR_FIELDS:
        if key not in entry:
            _fail(f"tensor {name!r}: missing key {key!r}")
    dtype = _check_dtype(name, entry["dtype"])
    shape = _check_shape(name, entry["shape"])
    offsets = entry["data_offsets"]
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_u64, offsets))):
        _fail(f"tensor {name!r}: data_offsets must be two non-negative integers, got {offsets!r}")
    begin, end = offsets
    if begin > end:
        _fail(f"tensor {name!r}: data_offsets [{begin}, {end}] end before they begin")
    size = _data_size(name, dtype, shape)
    if end - begin != size:
        _fail(
            f"tensor {name!r}: data_offsets [{begin}, {end}] span {end - begin} bytes"
            f" but {dtype} {list(shape)} needs {size}"
        )
    return TensorInfo(name, dtype, shape, begin, end)


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads silently keeps the last duplicate; two readers could disagree on which wins.
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            _fail(f"duplicate key {key!r} in header")
        result[key] = value
    return result


def _refuse_constant(token: str) -> NoReturn:
    _fail(f"header JSON contains the non-standard constant {token}")


def _load_json(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        _fail(f"header is not valid UTF-8 (byte {exc.start} of the JSON)")
    if not text.startswith("{"):
        _fail("header JSON does not start with '{'")
    try:
        # Trailing whitespace is accepted by json.loads, as by serde_json: it is the padding.
        value = json.loads(
            text, object_pairs_hook=_unique_object, parse_constant=_refuse_constant
        )
    except json.JSONDecodeError as exc:
        _fail(f"header is not valid JSON: {exc.msg} at character {exc.pos}")
    except RecursionError:
        _fail("header JSON is nested too deeply")
    except ValueError as exc:  # e.g. an integer literal longer than int's digit limit
        _fail(f"header is not valid JSON: {exc}")
    if not isinstance(value, dict):
        _fail("header JSON is not an object")
    return value


def parse_header(header_bytes: bytes, file_size: int) -> SafetensorsLayout:
    """Validate the first ``8 + N`` bytes of a ``file_size``-byte safetensors file."""
    header_bytes = bytes(header_bytes)
    n = header_length(header_bytes)
    data_offset = _PREFIX_LEN + n
    if data_offset > file_size:
        _fail(f"header length {n} runs past the end of the {file_size}-byte file")
    if len(header_bytes) != data_offset:
        _fail(f"got {len(header_bytes)} header bytes but the header length says 8 + {n}")
    document = _load_json(header_bytes[_PREFIX_LEN:])

    metadata: dict[str, str] | None = None
    parsed: list[TensorInfo] = []
    for key, entry in document.items():
        if key == _METADATA_KEY:
            metadata = _check_metadata(entry)
        else:
            parsed.append(_parse_tensor(_check_name(key), entry))

    # sorted() is stable, so zero-size tensors sharing an offset keep their JSON key order.
    tensors = tuple(sorted(parsed, key=lambda t: (t.begin, t.end)))
    data_size = file_size - data_offset
    position = 0
    previous: TensorInfo | None = None
    for tensor in tensors:
        if tensor.begin > position:
            _fail(f"hole in the data between offset {position} and {tensor.begin}")
        if tensor.begin < position:
            assert previous is not None  # position > 0 only after a tensor
            _fail(
                f"tensor {tensor.name!r}: data_offsets [{tensor.begin}, {tensor.end}]"
                f" overlap tensor {previous.name!r}"
            )
        position = tensor.end
        previous = tensor
    if position > data_size:
        assert previous is not None
        _fail(
            f"tensor {previous.name!r}: data_offsets [{previous.begin}, {previous.end}] run past"
            f" the end of the file (the data section holds {data_size} bytes)"
        )
    if position < data_size:
        if previous is None:
            _fail(f"{data_size} bytes of data after a header that declares no tensors")
        _fail(f"{data_size - position} trailing bytes after the last tensor")
    return SafetensorsLayout(header_bytes, metadata, tensors)


def emit_header(
    tensors: Sequence[tuple[str, str, Sequence[int]]],
    metadata: Mapping[str, str] | None,
) -> tuple[bytes, list[tuple[int, int]]]:
    """Build a header laying ``tensors`` out contiguously in the given order.

    The JSON is compact, ``__metadata__`` first (entries in the mapping's order), and padded
    with spaces to an 8-byte boundary as the safetensors writer does. Returns the header bytes
    (prefix included) and each tensor's ``(begin, end)`` in the data section.
    """
    document: dict[str, Any] = {}
    if metadata is not None:
        document[_METADATA_KEY] = _check_metadata(metadata)
    offsets: list[tuple[int, int]] = []
    position = 0
    for name, dtype, shape in tensors:
        _check_name(name)
        if name == _METADATA_KEY:
            _fail(f"{_METADATA_KEY!r} is reserved and cannot name a tensor")
        if name in document:
            _fail(f"duplicate key {name!r} in header")
        _check_dtype(name, dtype)
        dims = _check_shape(name, shape)
        end = position + _data_size(name, dtype, dims)
        if end > _U64_MAX:
            _fail(f"tensor {name!r}: data section would exceed 2**64 bytes")
        document[name] = {"dtype": dtype, "shape": list(dims), "data_offsets": [position, end]}
        offsets.append((position, end))
        position = end
    # ensure_ascii=False matches serde_json, which writes non-ASCII names as raw UTF-8.
    raw = json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % _PREFIX_LEN)
    if len(raw) > MAX_HEADER_SIZE:
        _fail(f"header of {len(raw)} bytes exceeds the limit of {MAX_HEADER_SIZE} bytes")
    return struct.pack("<Q", len(raw)) + raw, offsets
