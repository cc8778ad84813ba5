"""The one bridge between stored tensors and torch: dtype names and decoding bytes to tensors.

Imported only by torch-facing modules (training state, partial reads, LoRA merging), lazily, so
the core and the CLI never import torch.
"""

from __future__ import annotations

from typing import Any

import torch

from ckstore.errors import IntegrityError
from ckstore.format.dtypes import TORCH_DTYPES

# safetensors dtype codes of the torch dtypes that have one (newer dtypes exist only in recent
# torch releases: a row whose dtype this torch lacks is left out).
ST_CODES: dict[torch.dtype, str] = {
    getattr(torch, name): code for name, (_, code) in TORCH_DTYPES.items() if code is not None and hasattr(torch, name)
}
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
    return t.reshape(-1).view(torch.uint8).numpy().data


def from_bytes(raw: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...] | list[int]) -> torch.Tensor:
    """A uint8 tensor's bytes reinterpreted as ``dtype`` of ``shape`` (no copy when non-empty)."""
    return raw.view(dtype).reshape(shape) if raw.numel() else torch.empty(shape, dtype=dtype)
