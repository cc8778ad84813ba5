"""Parsing and emission of safetensors headers.

A safetensors file is ``u64 N`` (little-endian), then N bytes of UTF-8 JSON, then the data
section. The JSON maps tensor names to ``{"dtype", "shape", "data_offsets"}`` (offsets relative
to the data section) plus an optional ``"__metadata__"`` object of strings.

``parse_header`` accepts exactly the files the safetensors reference reader (the Rust crate, which
the Python package wraps) accepts, and reads them the same way, quirks of its JSON layer (serde)
included: whitespace before and after the JSON, unknown fields in a tensor entry (ignored), a
tensor entry written as the array ``[dtype, shape, data_offsets]``, a dtype written as
``{"F32": null}``, ``"__metadata__": null``, and a repeated tensor name or metadata key (the last
one wins). It refuses what that reader refuses, with a one-line reason. ckstore content-addresses
what it accepts, so ambiguity matters: a file that safetensors reads but that ckstore's manifest
should not model (a repeated key, which other JSON readers may resolve the other way; a tensor
name that is empty or holds control characters; a rank above 64 or a dimension of 2**63 or more)
is returned with ``plain_reason`` set, and the caller stores it as plain bytes. docs/format.md
(section 13) is the normative list.

No file I/O happens here: callers read the bytes and pass them in.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from ckstore.errors import SafetensorsFormatError
from ckstore.format.dtypes import DTYPE_BITS

MAX_HEADER_SIZE: int = 100_000_000


_PREFIX_LEN = 8
_METADATA_KEY = "__metadata__"
_TENSOR_FIELDS = ("dtype", "shape", "data_offsets")
# The Rust reader holds sizes and offsets in usize; refusing beyond u64 keeps us in agreement.
_U64_MAX = 2**64 - 1
_I64_MIN = -(2**63)
# serde_json's recursion limit: arrays and objects nest at most 127 deep, the header's own
# object counting as one.
_MAX_DEPTH = 127
# What the manifest models (docs/format.md sections 5 and 10); beyond it a file is stored plain.
_MAX_DIMS = 64
_MAX_DIM = 2**63 - 1
# C0, DEL and C1 controls: invisible in listings and able to forge lines of output.
_CONTROL_CHARS = re.compile("[\x00-\x1f\x7f-\x9f]")
_SURROGATES = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


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
    # Set when safetensors reads the file but ckstore stores it as plain bytes: the reason why.
    plain_reason: str | None = None

    @property
    def data_offset(self) -> int:
        return len(self.header_bytes)

    @property
    def file_size(self) -> int:
        return self.data_offset + max((t.end for t in self.tensors), default=0)


class _Object(list[tuple[str, Any]]):
    """A JSON object as its (key, value) pairs in order, repeats kept: safetensors treats a
    repeated key as an error, as "last one wins" or not at all depending on where it is."""

    def __repr__(self) -> str:  # for error messages: show it as the JSON object it was
        return "{" + ", ".join(f"{key!r}: {value!r}" for key, value in self) + "}"


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
    # A Python str may hold lone surrogates (\ud800); they cannot be written as UTF-8.
    if _SURROGATES.search(value):
        _fail(f"{what} {value!r} is not valid Unicode")


def _check_name(name: Any) -> None:
    """Refuse a name ckstore will not write (emit_header); parse_header stores such files plain."""
    if not isinstance(name, str):
        _fail(f"tensor name {name!r} is not a string")
    _check_text(name, "tensor name")
    reason = _name_problem(name)
    if reason is not None:
        _fail(reason)


def _name_problem(name: str) -> str | None:
    if not name:
        return "empty tensor name in header"
    if _CONTROL_CHARS.search(name):
        return f"tensor name {name!r} contains a control character"
    return None


def _shape_problem(name: str, shape: tuple[int, ...]) -> str | None:
    if len(shape) > _MAX_DIMS:
        return f"tensor {name!r}: shape has {len(shape)} dimensions, more than {_MAX_DIMS}"
    if any(d > _MAX_DIM for d in shape):
        return f"tensor {name!r}: shape {list(shape)} has a dimension of 2**63 or more"
    return None


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
    if not isinstance(shape, (list, tuple)) or isinstance(shape, _Object) or not all(map(_is_u64, shape)):
        _fail(f"tensor {name!r}: shape must be a list of non-negative integers, got {shape!r:.200}")
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
    if isinstance(dtype, _Object):
        # serde also reads an enum variant from a one-key object: {"F32": null} is "F32".
        if len(dtype) != 1 or dtype[0][1] is not None:
            _fail(f'tensor {name!r}: dtype {dtype!r:.200} is neither a string nor {{"<dtype>": null}}')
        dtype = dtype[0][0]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        _fail(f"tensor {name!r}: unknown dtype {dtype!r:.200}")
    return dtype


def _tensor_fields(name: str, entry: Any) -> list[Any]:
    """dtype, shape and data_offsets of a tensor entry, as serde reads a struct."""
    if isinstance(entry, _Object):
        found: dict[str, Any] = {}
        for key, value in entry:
            if key in _TENSOR_FIELDS:
                if key in found:
                    _fail(f"tensor {name!r}: duplicate key {key!r}")
                found[key] = value
            # Any other key is ignored, as safetensors does; the stored header bytes keep it.
        for key in _TENSOR_FIELDS:
            if key not in found:
                _fail(f"tensor {name!r}: missing key {key!r}")
        return [found[key] for key in _TENSOR_FIELDS]
    if isinstance(entry, list):  # serde also reads a struct from the array of its fields
        if len(entry) != len(_TENSOR_FIELDS):
            _fail(f"tensor {name!r}: entry is an array of {len(entry)} items, not [dtype, shape, data_offsets]")
        return entry
    _fail(f"tensor {name!r}: entry is not an object")


def _read_tensor(name: str, entry: Any) -> TensorInfo:
    """The tensor as the JSON layer reads it; sizes and offsets are checked later (_validate),
    and only for the entry that wins when a name repeats, as in safetensors."""
    dtype, shape, offsets = _tensor_fields(name, entry)
    dtype = _check_dtype(name, dtype)
    dims = _check_shape(name, shape)
    if not (type(offsets) is list and len(offsets) == 2 and all(map(_is_u64, offsets))):
        _fail(f"tensor {name!r}: data_offsets must be two non-negative integers, got {offsets!r:.200}")
    return TensorInfo(name, dtype, dims, offsets[0], offsets[1])


def _validate(tensor: TensorInfo) -> None:
    if tensor.begin > tensor.end:
        _fail(f"tensor {tensor.name!r}: data_offsets [{tensor.begin}, {tensor.end}] end before they begin")
    size = _data_size(tensor.name, tensor.dtype, tensor.shape)
    if tensor.nbytes != size:
        _fail(
            f"tensor {tensor.name!r}: data_offsets [{tensor.begin}, {tensor.end}] span {tensor.nbytes}"
            f" bytes but {tensor.dtype} {list(tensor.shape)} needs {size}"
        )


def _read_metadata(value: Any) -> tuple[dict[str, str] | None, str | None]:
    """The metadata map (None when absent or null) and, if a key repeats, the plain-file reason."""
    if value is None:
        return None, None
    if not isinstance(value, _Object):
        _fail("__metadata__ is not an object")
    metadata: dict[str, str] = {}
    repeated = None
    for key, item in value:
        if not isinstance(item, str):
            _fail(f"__metadata__ entry {key!r} is not a string-to-string pair")
        if key in metadata and repeated is None:
            repeated = f"__metadata__ key {key!r} appears twice"
        metadata[key] = item  # the last one wins, as in safetensors
    return metadata, repeated


def _refuse_constant(token: str) -> NoReturn:
    _fail(f"header JSON contains the non-standard constant {token}")


def _out_of_range(text: str) -> NoReturn:
    _fail(f"header JSON holds the number {text:.40} which is out of range")


def _json_int(text: str) -> int | float:
    # serde_json reads -0 as the float -0.0, and an integer beyond i64/u64 as a float, which
    # is an error when it overflows f64; a float is then no valid size or offset.
    if text == "-0":
        return -0.0
    try:
        value = int(text)
    except ValueError:  # longer than int's digit limit: far beyond f64 as well
        _out_of_range(text)
    if _I64_MIN <= value <= _U64_MAX:
        return value
    try:
        return float(value)
    except OverflowError:
        _out_of_range(text)


def _json_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        _out_of_range(text)
    return value


def _check_tree(document: Any, check_strings: bool) -> None:
    """serde_json's nesting limit and its refusal of lone surrogates, anywhere in the document
    (ignored fields included: serde parses them in full)."""
    stack = [(document, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, list):  # arrays and _Object
            if depth > _MAX_DEPTH:
                _fail(f"header JSON is nested more than {_MAX_DEPTH} levels deep")
            for item in value:
                if isinstance(value, _Object):
                    key, item = item
                    if check_strings:
                        _check_text(key, "header JSON string")
                stack.append((item, depth + 1))
        elif check_strings and isinstance(value, str):
            _check_text(value, "header JSON string")


def _load_json(raw: bytes) -> _Object:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        _fail(f"header is not valid UTF-8 (byte {exc.start} of the JSON)")
    try:
        # Whitespace (space, tab, CR, LF) before and after the value is accepted here exactly as
        # by serde_json; the writer pads with spaces.
        value = json.loads(
            text,
            object_pairs_hook=_Object,
            parse_constant=_refuse_constant,
            parse_int=_json_int,
            parse_float=_json_float,
        )
    except json.JSONDecodeError as exc:
        _fail(f"header is not valid JSON: {exc.msg} at character {exc.pos}")
    except RecursionError:
        _fail("header JSON is nested too deeply")
    # The walk costs seconds on a header of 50,000 tensors, so only when needed: lone surrogates
    # can only come from \\u escapes, and only ignored fields can nest deep and still be valid
    # (too deep a known field fails its type check).
    check_strings = _SURROGATE_ESCAPE.search(text) is not None
    if (
        check_strings
        or not isinstance(value, _Object)
        or any(isinstance(entry, _Object) and len(entry) > len(_TENSOR_FIELDS) for _, entry in value)
    ):
        _check_tree(value, check_strings)
    if not isinstance(value, _Object):
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
    seen_metadata = False
    reasons: list[str] = []
    entries: dict[str, TensorInfo] = {}
    for key, entry in document:
        if key == _METADATA_KEY:
            if seen_metadata:
                _fail(f"duplicate key {_METADATA_KEY!r} in header")
            seen_metadata = True
            metadata, repeated = _read_metadata(entry)
            reasons += [repeated] if repeated else []
        else:
            tensor = _read_tensor(key, entry)
            if entries.pop(key, None) is not None:
                reasons.append(f"tensor name {key!r} appears twice in the header")
            entries[key] = tensor  # the last one wins, as in safetensors

    for tensor in entries.values():
        _validate(tensor)
        reasons += filter(None, [_name_problem(tensor.name), _shape_problem(tensor.name, tensor.shape)])
    # sorted() is stable, so zero-size tensors sharing an offset keep their JSON key order.
    tensors = tuple(sorted(entries.values(), key=lambda t: (t.begin, t.end)))
    _check_tiling(tensors, file_size - data_offset)
    return SafetensorsLayout(header_bytes, metadata, tensors, reasons[0] if reasons else None)


def _check_tiling(tensors: Sequence[TensorInfo], data_size: int) -> None:
    """Sorted by offset, the tensors cover the data section exactly: no hole, overlap or tail."""
    position = 0
    previous: TensorInfo | None = None
    for tensor in tensors:
        if tensor.begin > position:
            _fail(f"hole in the data between offset {position} and {tensor.begin}")
        if tensor.begin < position:
            assert previous is not None  # position > 0 only after a tensor
            _fail(
                f"tensor {tensor.name!r}: data_offsets [{tensor.begin}, {tensor.end}] overlap tensor {previous.name!r}"
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
        problem = _shape_problem(name, dims)
        if problem is not None:
            _fail(problem)
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
