"""The manifest's record of a distributed checkpoint (torch.distributed.checkpoint): pure, no I/O.

A DCP save is one commit whose files are one safetensors file per writing rank, holding that
rank's pieces of the global tensors (and its non-tensor items as ``U8`` byte tensors). The
``dcp`` record (manifest version 2, docs/format.md section 16) says what the pieces are: for each
global tensor its fully qualified name, dtype, global shape and, per piece, its offsets and sizes
in the global tensor, the rank that wrote it and where it is stored (file path, tensor name). It
is everything DCP's ``Metadata`` holds, in typed JSON, so a load never unpickles a metadata file.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckstore.errors import IntegrityError
from ckstore.format.dtypes import TORCH_DTYPES
from ckstore.format.values import JSONValue, decode_value

# Non-tensor items: "value" is ckstore's typed JSON (values.py), decoded by ckstore itself;
# "opaque" is the bytes DCP's planner produced (torch.save pickle for the default planner),
# handed back to the planner's own load_bytes and never decoded by ckstore.
OBJECT_ENCODINGS = ("value", "opaque")
LAYOUTS = ("strided",)
MEMORY_FORMATS = ("contiguous_format", "channels_last", "preserve_format")


@dataclass(frozen=True)
class DcpPiece:
    """One stored piece of a global tensor: the hypercube at ``offsets`` of extent ``sizes``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    rank: int
    file: str
    tensor: str  # tensor name inside ``file``

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True)
class DcpTensor:
    fqn: str
    dtype: str  # torch dtype name
    shape: tuple[int, ...]
    requires_grad: bool
    layout: str
    memory_format: str
    pieces: tuple[DcpPiece, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * TORCH_DTYPES[self.dtype][0] // 8


@dataclass(frozen=True)
class DcpObject:
    """A non-tensor item, stored as a ``U8`` tensor of its encoded bytes."""

    fqn: str
    rank: int
    file: str
    tensor: str
    encoding: str  # one of OBJECT_ENCODINGS


@dataclass(frozen=True)
class DcpRecord:
    world_size: int
    tensors: tuple[DcpTensor, ...]  # sorted by fqn
    objects: tuple[DcpObject, ...]  # sorted by fqn
    extra: JSONValue  # typed value: {"planner_data": …, "storage_meta": …, "version": …}

    def decoded_extra(self) -> dict[str, Any]:
        value = decode_value(self.extra)
        if not isinstance(value, dict):
            raise IntegrityError("manifest: dcp extra is not a mapping")
        return value


def piece_name(fqn: str, offsets: Sequence[int]) -> str:
    """The tensor name a piece is stored under: its fqn and global offsets, so the same piece of
    the next save pairs with it whichever rank writes it (delta bases go by name)."""
    return f"{fqn}@{','.join(str(o) for o in offsets)}"


def stored_dtype(dtype: str, sizes: Sequence[int]) -> tuple[str, tuple[int, ...]]:
    """Safetensors dtype and shape a piece is stored with (raw ``U8`` bytes when safetensors
    has no code for the dtype)."""
    bits, code = TORCH_DTYPES[dtype]
    if code is not None:
        return code, tuple(sizes)
    return "U8", (math.prod(sizes) * bits // 8,)


def record_json(record: DcpRecord) -> dict[str, Any]:
    return {
        "world_size": record.world_size,
        "tensors": [
            {
                "fqn": t.fqn,
                "dtype": t.dtype,
                "shape": list(t.shape),
                "requires_grad": t.requires_grad,
                "layout": t.layout,
                "memory_format": t.memory_format,
                "pieces": [
                    {
                        "offsets": list(p.offsets),
                        "sizes": list(p.sizes),
                        "rank": p.rank,
                        "file": p.file,
                        "tensor": p.tensor,
                    }
                    for p in t.pieces
                ],
            }
            for t in record.tensors
        ],
        "objects": [
            {"fqn": o.fqn, "rank": o.rank, "file": o.file, "tensor": o.tensor, "encoding": o.encoding}
            for o in record.objects
        ],
        "extra": record.extra,
    }


# ---- parsing -------------------------------------------------------------------------------

StoredTensors = Mapping[tuple[str, str], tuple[str, tuple[int, ...]]]  # (file, name) -> (dtype, shape)


def _fields(doc: Any, names: Sequence[str], where: str) -> dict[str, Any]:
    if not isinstance(doc, dict) or tuple(doc) != tuple(names):
        raise IntegrityError(f"manifest: {where}: fields are missing, unexpected or out of order")
    return doc


def _int(value: Any, where: str, low: int = 0, high: int = 1 << 63) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value < high:
        raise IntegrityError(f"manifest: {where}: invalid integer {value!r:.40}")
    return value


def _str(value: Any, where: str, choices: Sequence[str] | None = None) -> str:
    if not isinstance(value, str) or (choices is not None and value not in choices):
        raise IntegrityError(f"manifest: {where}: invalid value {value!r:.60}")
    return value


def _dims(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > 64:
        raise IntegrityError(f"manifest: {where}: invalid shape")
    return tuple(_int(d, where) for d in value)


def _stored(stored: StoredTensors, file: str, tensor: str, where: str) -> tuple[str, tuple[int, ...]]:
    found = stored.get((file, tensor))
    if found is None:
        raise IntegrityError(f"manifest: {where}: names tensor {tensor!r} of {file!r}, which the files lack")
    return found


def _parse_piece(doc: Any, t: DcpTensor, world: int, stored: StoredTensors) -> DcpPiece:
    where = f"dcp tensor {t.fqn!r}"
    d = _fields(doc, ("offsets", "sizes", "rank", "file", "tensor"), where)
    offsets, sizes = _dims(d["offsets"], where), _dims(d["sizes"], where)
    if len(offsets) != len(t.shape) or len(sizes) != len(t.shape):
        raise IntegrityError(f"manifest: {where}: a piece's rank differs from the tensor's")
    if any(o + s > n for o, s, n in zip(offsets, sizes, t.shape)):
        raise IntegrityError(f"manifest: {where}: a piece lies outside the global shape")
    piece = DcpPiece(offsets, sizes, _int(d["rank"], where, 0, world), _str(d["file"], where), _str(d["tensor"], where))
    if _stored(stored, piece.file, piece.tensor, where) != stored_dtype(t.dtype, sizes):
        raise IntegrityError(f"manifest: {where}: stored tensor {piece.tensor!r} has the wrong dtype or shape")
    return piece


def _parse_tensor(doc: Any, world: int, stored: StoredTensors) -> DcpTensor:
    d = _fields(doc, ("fqn", "dtype", "shape", "requires_grad", "layout", "memory_format", "pieces"), "dcp tensor")
    fqn = _str(d["fqn"], "dcp tensor")
    where = f"dcp tensor {fqn!r}"
    if not isinstance(d["requires_grad"], bool) or not isinstance(d["pieces"], list):
        raise IntegrityError(f"manifest: {where}: malformed")
    shell = DcpTensor(
        fqn,
        _str(d["dtype"], where, tuple(TORCH_DTYPES)),
        _dims(d["shape"], where),
        d["requires_grad"],
        _str(d["layout"], where, LAYOUTS),
        _str(d["memory_format"], where, MEMORY_FORMATS),
        (),
    )
    pieces = tuple(_parse_piece(p, shell, world, stored) for p in d["pieces"])
    # Pieces lie inside the shape (_parse_piece): disjoint ones whose volumes sum to the tensor's
    # cover every element exactly once. A sum alone let a hole pass (read back as zeros).
    if sum(p.numel for p in pieces) != math.prod(shell.shape) or _overlap(pieces):
        raise IntegrityError(f"manifest: {where}: its pieces do not cover the tensor exactly once")
    return DcpTensor(
        shell.fqn, shell.dtype, shell.shape, shell.requires_grad, shell.layout, shell.memory_format, pieces
    )


def _overlap(pieces: Sequence[DcpPiece]) -> bool:
    """Whether two non-empty pieces share an element: a sweep along the dimension with the most
    distinct offsets (the one the tensor is sharded along), comparing only pieces whose extents
    there intersect, so a row- or column-sharded tensor costs about one comparison per piece."""
    boxes = [(p.offsets, tuple(o + s for o, s in zip(p.offsets, p.sizes))) for p in pieces if p.numel]
    if len(boxes) < 2:
        return False
    ndim = len(boxes[0][0])
    axis = max(range(ndim), key=lambda i: len({lo[i] for lo, _ in boxes})) if ndim else 0
    active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for lo, hi in sorted(boxes, key=lambda b: b[0][axis] if ndim else 0):
        active = [b for b in active if not ndim or b[1][axis] > lo[axis]]
        if any(all(a_lo < h and low < a_hi for low, h, a_lo, a_hi in zip(lo, hi, b_lo, b_hi)) for b_lo, b_hi in active):
            return True
        active.append((lo, hi))
    return False


def _parse_object(doc: Any, world: int, stored: StoredTensors) -> DcpObject:
    d = _fields(doc, ("fqn", "rank", "file", "tensor", "encoding"), "dcp object")
    where = f"dcp object {d['fqn']!r:.60}"
    obj = DcpObject(
        _str(d["fqn"], where),
        _int(d["rank"], where, 0, world),
        _str(d["file"], where),
        _str(d["tensor"], where),
        _str(d["encoding"], where, OBJECT_ENCODINGS),
    )
    dtype, shape = _stored(stored, obj.file, obj.tensor, where)
    if dtype != "U8" or len(shape) != 1:
        raise IntegrityError(f"manifest: {where}: not stored as a U8 byte tensor")
    return obj


def parse_record(doc: Any, stored: StoredTensors) -> DcpRecord:
    """Validate a ``dcp`` record against the commit's stored tensors (``stored``)."""
    d = _fields(doc, ("world_size", "tensors", "objects", "extra"), "dcp record")
    world = _int(d["world_size"], "dcp world_size", 1, 1 << 31)
    if not isinstance(d["tensors"], list) or not isinstance(d["objects"], list):
        raise IntegrityError("manifest: dcp record: tensors and objects must be lists")
    tensors = tuple(_parse_tensor(t, world, stored) for t in d["tensors"])
    objects = tuple(_parse_object(o, world, stored) for o in d["objects"])
    names = [t.fqn for t in tensors] + [o.fqn for o in objects]
    if len(set(names)) != len(names):
        raise IntegrityError("manifest: dcp record: duplicate fqn")
    record = DcpRecord(world, tensors, objects, d["extra"])
    record.decoded_extra()
    return record
