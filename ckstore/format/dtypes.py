"""The one dtype table: safetensors codes, element bits, torch names and numpy types (no I/O).

Every other table is a view of this one: ``DTYPE_BITS`` (what safetensors can name, for the
strict parser and the manifest), ``TORCH_DTYPES`` (DCP records and training state name dtypes as
torch does) and ``NUMPY_TYPES`` (reads without torch, history's magnitudes). torch itself is
bridged in torch_dtypes.py, which builds its mapping from ``TORCH_DTYPES``.
"""

from __future__ import annotations

from typing import NamedTuple


class Dtype(NamedTuple):
    code: str | None  # safetensors dtype code; None: safetensors cannot name it (stored as raw U8 bytes)
    bits: int  # bits per element
    torch: str | None  # ``str(torch.dtype)`` without ``torch.``; None: torch has no such dtype
    numpy: str | None  # numpy type string, little-endian; None: numpy has no such type


# The safetensors rows mirror `Dtype::bitsize` of the safetensors Rust crate (0.8): exactly the
# dtypes it can read, no more.
TABLE: tuple[Dtype, ...] = (
    Dtype("BOOL", 8, "bool", "?"),
    Dtype("F4", 4, None, None),
    Dtype("F6_E2M3", 6, None, None),
    Dtype("F6_E3M2", 6, None, None),
    Dtype("U8", 8, "uint8", "u1"),
    Dtype("I8", 8, "int8", "i1"),
    Dtype("F8_E5M2", 8, "float8_e5m2", None),
    Dtype("F8_E4M3", 8, "float8_e4m3fn", None),
    Dtype("F8_E8M0", 8, "float8_e8m0fnu", None),
    Dtype("F8_E4M3FNUZ", 8, "float8_e4m3fnuz", None),
    Dtype("F8_E5M2FNUZ", 8, "float8_e5m2fnuz", None),
    Dtype("I16", 16, "int16", "<i2"),
    Dtype("U16", 16, "uint16", "<u2"),
    Dtype("F16", 16, "float16", "<f2"),
    Dtype("BF16", 16, "bfloat16", None),
    Dtype("I32", 32, "int32", "<i4"),
    Dtype("U32", 32, "uint32", "<u4"),
    Dtype("F32", 32, "float32", "<f4"),
    Dtype("C64", 64, "complex64", "<c8"),
    Dtype("F64", 64, "float64", "<f8"),
    Dtype("I64", 64, "int64", "<i8"),
    Dtype("U64", 64, "uint64", "<u8"),
    # torch dtypes safetensors has no code for
    Dtype(None, 128, "complex128", None),
    Dtype(None, 32, "complex32", None),
)

# safetensors code -> bits per element
DTYPE_BITS: dict[str, int] = {d.code: d.bits for d in TABLE if d.code is not None}
# torch dtype name -> (bits per element, safetensors code or None)
TORCH_DTYPES: dict[str, tuple[int, str | None]] = {d.torch: (d.bits, d.code) for d in TABLE if d.torch is not None}
# safetensors code -> numpy type string, for the codes numpy can represent
NUMPY_TYPES: dict[str, str] = {d.code: d.numpy for d in TABLE if d.code is not None and d.numpy is not None}
