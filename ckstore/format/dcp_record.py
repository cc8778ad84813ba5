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
        raise IntegrityError(
            f"manifest: {where}: its pieces do not cover the tensor exactly once in pieces that cuts along "
            "its axes separate"
        )
    return DcpTensor(
        shell.fqn, shell.dtype, shell.shape, shell.requires_grad, shell.layout, shell.memory_format, pieces
    )


Box = tuple[tuple[int, ...], tuple[int, ...]]  # (low corner, high corner), high exclusive


def _cut(group: list[Box], axis: int) -> list[list[Box]]:
    """``group`` cut along ``axis`` at every coordinate no box crosses (sorted, one sweep)."""
    parts: list[list[Box]] = []
    reach = -1
    for box in sorted(group, key=lambda b: b[0][axis]):
        if box[0][axis] >= reach:
            parts.append([])
        parts[-1].append(box)
        reach = max(reach, box[1][axis])
    return parts


def _overlap(pieces: Sequence[DcpPiece]) -> bool:
    """Whether the non-empty pieces cannot be shown pairwise disjoint by cutting: the group is cut
    along an axis at every coordinate no piece crosses (one sort and sweep), each part that
    still holds two pieces is cut again along the next axes, until every part holds one piece.
    Pieces on opposite sides of a cut share no element. Every layout DCP's planners make (a grid:
    row, column, block and FSDP x TP sharding) is cut apart, one axis per level; two pieces
    sharing an element never are. The work is bounded (format.md section 16): at most
    ``4 (d + 1)`` visits per piece for d dimensions, each a sort, so O(d n log n); a layout
    that needs more, or that no axis cuts, is refused as if it overlapped."""
    boxes = [(p.offsets, tuple(o + s for o, s in zip(p.offsets, p.sizes))) for p in pieces if p.numel]
    if len(boxes) < 2:
        return False
    ndim = len(boxes[0][0])
    if ndim == 0:
        return True  # two non-empty 0-d pieces hold the same element
    budget = 4 * (ndim + 1) * len(boxes)
    pending: list[tuple[list[Box], int]] = [(boxes, 0)]  # a group and the axis to cut it along first
    while pending:
        group, first = pending.pop()
        for step in range(ndim):
            axis = (first + step) % ndim
            budget -= len(group)
            if budget < 0:
                return True
            parts = _cut(group, axis)
            if len(parts) > 1:
                pending.extend((part, (axis + 1) % ndim) for part in parts if len(part) > 1)
                break
        else:
            return True  # no axis separates them: they overlap (or lie as no save lays them)
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
