"""Where a chunk sits in a commit: the one rule that pairs a chunk with its predecessor (pure).

A position is ``(file path, part)``: ``part`` is a tensor name for a tensor's chunks, ``HEADER``
for the header chunks of a safetensors file, and None for the bytes of a plain file. Chunk ``i``
of a position in one commit and chunk ``i`` of the same position in another commit are the
"same chunk" over time: commit uses that pairing to store a delta against the parent's chunk,
repack to re-plan chains, diff and overlays to tell what changed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from .ids import ObjectId
from .manifest import ChunkRef, FileEntry
from .safetensors_format import DTYPE_BITS

# A tensor name cannot contain NUL (the safetensors parser refuses control characters in names),
# so this part never collides with a tensor's.
HEADER = "\0header"
Position = tuple[str, str | None]
PositionChunks = Mapping[Position, Sequence[ChunkRef]]
# Complex numbers are pairs of floats: group by the float, whose exponent byte repeats.
_WIDTH_OVERRIDES = {"C64": 4}


@dataclass(frozen=True)
class Slot:
    """One chunk at its position: what a delta against it needs to know."""

    id: ObjectId
    size: int
    width: int  # element width for byte grouping


def element_width(dtype: str) -> int:
    """Bytes per element for byte grouping (1 for sub-byte and byte-wide dtypes)."""
    return _WIDTH_OVERRIDES.get(dtype, max(1, DTYPE_BITS.get(dtype, 8) // 8))


def position_chunks(files: Iterable[FileEntry], header: bool = True) -> dict[Position, Sequence[ChunkRef]]:
    """Each position's chunk list (safetensors headers under ``HEADER`` unless ``header`` is False)."""
    out: dict[Position, Sequence[ChunkRef]] = {}
    for f in files:
        if f.kind == "safetensors":
            if header:
                out[(f.path, HEADER)] = f.header
            for t in f.tensors:
                out[(f.path, t.name)] = t.chunks
        else:
            out[(f.path, None)] = f.chunks
    return out


def slots(files: Iterable[FileEntry]) -> dict[tuple[Position, int], Slot]:
    """Every chunk by (position, index), with its size and element width."""
    out: dict[tuple[Position, int], Slot] = {}
    for f in files:
        for i, c in enumerate(f.header):
            out[((f.path, HEADER), i)] = Slot(c.id, c.size, 1)
        for t in f.tensors:
            width = element_width(t.dtype)
            for i, c in enumerate(t.chunks):
                out[((f.path, t.name), i)] = Slot(c.id, c.size, width)
        for i, c in enumerate(f.chunks):
            out[((f.path, None), i)] = Slot(c.id, c.size, 1)
    return out


def chunk_at(chunks: PositionChunks, position: Position, index: int, size: int) -> ObjectId | None:
    """The chunk at ``index`` of ``position`` when it has ``size`` bytes (a delta needs equal lengths)."""
    found = chunks.get(position, ())
    return found[index].id if index < len(found) and found[index].size == size else None
