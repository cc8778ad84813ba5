"""Partial reads: ``repo.open(ref)``, a lazy read-only mapping of tensor name -> tensor.

Modelled on safetensors' ``safe_open``: ``keys()``, ``get_tensor(name)`` and
``get_slice(name)[a:b]``. Every tensor's bytes are chunked from the tensor's own start (format.md
section 5), so the bytes of a row range ``[a, b)`` of the first dimension are one contiguous byte
range whose chunks are found by bisecting the chunk offsets; only those chunks are fetched, each
verified against its name like every read. ``bytes_read`` counts the decoded chunk bytes fetched
so far, which is how tests prove that a slice reads only what it needs.

Tensors come back as torch tensors when torch is importable (``framework="pt"``), else as numpy
arrays (``framework="np"``) for the dtypes numpy has. A training-state commit is read through
its ``state.safetensors``; tensors stored as raw bytes (dtypes safetensors cannot name) get their
real dtype and shape from ``state.json``. Nothing here writes, and no whole file is materialised.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ckstore.errors import InvalidInputError, TensorNotFoundError
from ckstore.format.dtypes import DTYPE_BITS, NUMPY_TYPES
from ckstore.format.manifest import ChunkRef, Commit, FileEntry, TensorEntry
from ckstore.format.manifest_entries import tensors_by_name
from ckstore.repository.filedata import state_document
from ckstore.repository.store import ObjectStore
from ckstore.runtime.pipeline import ordered_map

if TYPE_CHECKING:
    from ckstore.repository.graph import CommitGraph

FRAMEWORKS = ("pt", "np")


@dataclass(frozen=True)
class _Spec:
    """One readable tensor: where its chunks are and how to interpret them."""

    file: FileEntry
    entry: TensorEntry
    raw_dtype: str | None  # torch dtype name when stored as raw U8 bytes (training state)
    shape: tuple[int, ...]


def _torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _state_raw_specs(doc: object) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (torch dtype, shape) of the raw-byte tensors named in a state document."""
    found: dict[str, tuple[str, tuple[int, ...]]] = {}
    todo = [doc]
    while todo:
        node = todo.pop()
        if isinstance(node, list):
            todo.extend(node)
        elif isinstance(node, dict):
            payload = node.get("$tensor", node.get("$ndarray")) if len(node) == 1 else None
            if isinstance(payload, dict) and isinstance(payload.get("dtype"), str):
                shape = payload.get("shape")
                if isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape):
                    found[str(payload.get("name"))] = (payload["dtype"], tuple(shape))
            else:
                todo.extend(node.values())
    return found


class TensorSlice:
    """``get_slice`` result: shape and dtype without reading, data on indexing."""

    def __init__(self, owner: LazyTensors, spec: _Spec) -> None:
        self._owner = owner
        self._spec = spec

    def get_shape(self) -> list[int]:
        return list(self._spec.shape)

    def get_dtype(self) -> str:
        return self._spec.raw_dtype or self._spec.entry.dtype

    def __len__(self) -> int:
        if not self._spec.shape:
            raise TypeError("len() of a 0-d tensor")
        return self._spec.shape[0]

    def __getitem__(self, key: Any) -> Any:
        return self._owner._slice(self._spec, key)


class LazyTensors(Mapping[str, Any]):
    """Tensors of one commit, read on access; see the module docstring."""

    def __init__(self, graph: CommitGraph, ref: str, path: str | None = None, framework: str | None = None) -> None:
        if framework is None:
            framework = "pt" if _torch_available() else "np"
        if framework not in FRAMEWORKS:
            raise InvalidInputError(f"framework must be 'pt' or 'np', not {framework!r}")
        if framework == "pt" and not _torch_available():
            raise InvalidInputError("framework 'pt' needs torch; use framework='np'")
        self.framework = framework
        self.commit_id = graph.resolve(ref)
        self._store: ObjectStore = graph.store
        self.bytes_read = 0
        commit = graph.read_commit(self.commit_id)
        self._specs = self._collect(commit, path)

    def _collect(self, commit: Commit, path: str | None) -> dict[str, _Spec]:
        raw: dict[str, tuple[str, tuple[int, ...]]] = {}
        files = [f for f in commit.files if f.kind == "safetensors"]
        if commit.state is not None and path is None:
            files = [f for f in files if f.path == commit.state.tensors]
            raw = _state_raw_specs(state_document(self._store, commit))
        if path is not None:
            files = [f for f in files if f.path == path]
            if not files:
                raise TensorNotFoundError(f"commit {self.commit_id[:12]} has no safetensors file {path!r}")
        specs: dict[str, _Spec] = {}
        for name, (f, t) in tensors_by_name(files, "pass path= to choose").items():
            dtype, shape = raw.get(name, (None, t.shape))
            specs[name] = _Spec(f, t, dtype, shape)
        return specs

    # ---- mapping -------------------------------------------------------------------------------

    def __getitem__(self, name: str) -> Any:
        if name not in self._specs:
            raise KeyError(name)
        return self.get_tensor(name)

    def __contains__(self, name: object) -> bool:
        return name in self._specs  # without reading, unlike Mapping's default

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def __enter__(self) -> LazyTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    # ---- safe_open-style access ----------------------------------------------------------------

    def _spec(self, name: str) -> _Spec:
        spec = self._specs.get(name)
        if spec is None:
            raise TensorNotFoundError(f"commit {self.commit_id[:12]} has no tensor {name!r}")
        return spec

    def get_tensor(self, name: str) -> Any:
        spec = self._spec(name)
        return self._rows(spec, 0, spec.shape[0]) if spec.shape else self._whole(spec)

    def get_slice(self, name: str) -> TensorSlice:
        return TensorSlice(self, self._spec(name))

    # ---- reading -------------------------------------------------------------------------------

    def _read(self, chunks: Sequence[ChunkRef], lo: int, hi: int, where: str) -> bytearray:
        """Bytes ``[lo, hi)`` of a chunk sequence, fetching only the chunks that overlap it."""
        if hi <= lo:
            return bytearray()
        starts = [0]
        for c in chunks:
            starts.append(starts[-1] + c.size)
        first = bisect.bisect_right(starts, lo) - 1
        last = bisect.bisect_left(starts, hi)  # exclusive: chunks starting before hi
        needed = chunks[first:last]
        context = f" ({where})"
        out = bytearray()
        for data in ordered_map(lambda c: self._store.chunk_view(c.id, c.size, context), needed):
            out += data
            self.bytes_read += len(data)
        offset = lo - starts[first]
        return out[offset : offset + hi - lo]

    def _row_bytes(self, spec: _Spec) -> int | None:
        """Bytes per first-dimension row, or None when rows are not whole bytes (sub-byte dtypes)."""
        inner = math.prod(spec.shape[1:])
        if spec.raw_dtype is not None:
            total = math.prod(spec.shape)
            return spec.entry.nbytes // total * inner if total else 0
        bits = inner * DTYPE_BITS[spec.entry.dtype]
        return bits // 8 if bits % 8 == 0 else None

    def _whole(self, spec: _Spec) -> Any:
        data = self._read(
            spec.entry.chunks, 0, spec.entry.nbytes, f"file {spec.file.path!r}, tensor {spec.entry.name!r}"
        )
        return self._convert(spec, data, spec.shape)

    def _rows(self, spec: _Spec, lo: int, hi: int) -> Any:
        row = self._row_bytes(spec)
        if row is None:
            return self._whole(spec)[lo:hi]
        where = f"file {spec.file.path!r}, tensor {spec.entry.name!r}"
        data = self._read(spec.entry.chunks, lo * row, hi * row, where)
        return self._convert(spec, data, (hi - lo, *spec.shape[1:]))

    def _slice(self, spec: _Spec, key: Any) -> Any:
        key = key if isinstance(key, tuple) else (key,)
        first = key[0] if key else Ellipsis
        if not spec.shape or isinstance(first, bool) or not isinstance(first, (int, slice)):
            # Ellipsis, None, index lists, 0-d tensors: read everything, index in memory.
            return (self.get_tensor(spec.entry.name))[key]
        n = spec.shape[0]
        if isinstance(first, int):
            index = first + n if first < 0 else first
            if not 0 <= index < n:
                raise IndexError(f"index {first} is out of range for dimension 0 of size {n}")
            return self._rows(spec, index, index + 1)[(0, *key[1:])]
        rows = range(*first.indices(n))
        if not rows:
            return self._rows(spec, 0, 0)[(slice(None), *key[1:])]
        lo, hi = min(rows[0], rows[-1]), max(rows[0], rows[-1]) + 1
        local: slice | list[int] = slice(0, hi - lo) if rows.step == 1 else [r - lo for r in rows]
        return self._rows(spec, lo, hi)[(local, *key[1:])]

    def _convert(self, spec: _Spec, data: bytearray, shape: tuple[int, ...]) -> Any:
        if self.framework == "pt":
            import torch

            from ckstore.format.torch_dtypes import FROM_ST_CODE, from_bytes, torch_dtype

            if spec.raw_dtype is not None:
                dtype = torch_dtype(spec.raw_dtype)
            elif spec.entry.dtype in FROM_ST_CODE:
                dtype = FROM_ST_CODE[spec.entry.dtype]
            else:
                raise InvalidInputError(f"tensor {spec.entry.name!r}: torch has no dtype for {spec.entry.dtype}")
            raw = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
            return from_bytes(raw, dtype, shape)
        code = NUMPY_TYPES.get(spec.entry.dtype) if spec.raw_dtype is None else None
        try:
            np_dtype = np.dtype(code if code else (spec.raw_dtype or ""))
        except TypeError:
            np_dtype = None
        if np_dtype is None or (spec.raw_dtype is None and code is None):
            raise InvalidInputError(
                f"tensor {spec.entry.name!r}: numpy has no dtype for {spec.raw_dtype or spec.entry.dtype}; install torch"
            )
        return np.frombuffer(data, dtype=np_dtype).reshape(shape)
