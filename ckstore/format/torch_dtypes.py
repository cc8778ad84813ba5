"""The one bridge between stored tensors and torch: dtype names and decoding bytes to tensors.

Imported only by torch-facing modules (training state, partial reads, LoRA merging), lazily, so
the core and the CLI never import torch.
"""

from __future__ import annotations

from typing import Any

import torch

from ckstore.errors import IntegrityError

# safetensors dtype codes of the torch dtypes that have one.
ST_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.complex64: "C64",
}
for _name, _code in (
    ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
    ("float8_e5m2fnuz", "F8_E5M2FNUZ"), ("float8_e8m0fnu", "F8_E8M0"),
    ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"),
):
    if hasattr(torch, _name):  # newer dtypes: present only in recent torch releases
        ST_CODES[getattr(torch, _name)] = _code
FROM_ST_CODE: dict[str, torch.dtype] = {code: dtype for dtype, code in ST_CODES.items()}


def torch_dtype(name: Any) -> torch.dtype:
    """A torch dtype from its name as ``str(dtype)`` gives it without ``torch.`` ("float32")."""
    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise IntegrityError(f"unknown torch dtype {name!r} in state")
    return dtype


def dtype_of_code(code: str, tensor: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype code; IntegrityError when this torch lacks it."""
    if code not in FROM_ST_CODE:
        raise IntegrityError(f"tensor {tensor!r} has dtype {code}, which this torch lacks")
    return FROM_ST_CODE[code]


def bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def from_bytes(raw: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...] | list[int]) -> torch.Tensor:
    """A uint8 tensor's bytes reinterpreted as ``dtype`` of ``shape`` (no copy when non-empty)."""
    return raw.view(dtype).reshape(shape) if raw.numel() else torch.empty(shape, dtype=dtype)
