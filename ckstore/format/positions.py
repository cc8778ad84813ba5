"""Where a chunk sits in a commit: the one rule that pairs a chunk with its predecessor (pure).

A position is ``(file path, part)``: ``part`` is a tensor name for a tensor's chunks, ``HEADER``
for the header chunks of a safetensors file, and None for the bytes of a plain file. Chunk ``i``
of a position in one commit and chunk ``i`` of the same position in another commit are the
"same chunk" over time: commit uses that pairing to store a delta against the parent's chunk,
repack to re-plan chains, diff and overlays to tell what changed.

Training scripts name checkpoint files per epoch or step (``epoch_3.safetensors``,
``epoch=3-step=600.ckpt``), and sharded checkpoints move tensors between shards, so for delta
bases ``ChunkIndex`` falls back from the position to the tensor's name (docs/format.md section 8
states the rule).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from ckstore.format.dtypes import DTYPE_BITS
from ckstore.format.ids import ObjectId
from ckstore.format.manifest import ChunkRef, FileEntry

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


def _natural_key(path: str) -> list[object]:
    """``epoch_10`` after ``epoch_9``: digit runs compare as numbers."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]


class ChunkIndex(Mapping[Position, Sequence[ChunkRef]]):
    """An earlier commit's chunks for pairing with a new commit's: by position, else by name.

    A tensor whose position (file path, name) the earlier commit lacks is paired with the earlier
    commit's tensor of the same name. When several earlier files hold that name, the one chosen
    is, in order: a file the new commit does not have (the file was renamed: ``epoch_1`` became
    ``epoch_2``), then the file sharing the most tensor names with the new file, then the last
    path in natural order (the newest epoch or step). Pairing only chooses a delta base: a delta
    is stored only when it decodes to the new bytes, so a poor pairing costs compression, never
    correctness.
    """

    def __init__(self, files: Iterable[FileEntry], new_files: Mapping[str, Collection[str]] | None = None) -> None:
        files = list(files)
        self._by_position = position_chunks(files)
        self._files = {f.path: f for f in files if f.kind == "safetensors"}
        self._holders: dict[str, list[str]] = {}
        for f in self._files.values():
            for t in f.tensors:
                self._holders.setdefault(t.name, []).append(f.path)
        self._new_files = new_files or {}
        self._chosen: dict[tuple[str, str], str | None] = {}
        self._overlaps: dict[tuple[str, str], int] = {}

    def __getitem__(self, position: Position) -> Sequence[ChunkRef]:
        found = self._by_position.get(position)
        if found is not None:
            return found
        path, name = position
        if name is None or name == HEADER or name not in self._holders:
            raise KeyError(position)
        key = (path, name)
        if key not in self._chosen:
            self._chosen[key] = self._choose(path, self._holders[name])
        holder = self._chosen[key]
        if holder is None:
            raise KeyError(position)
        return self._by_position[(holder, name)]

    def _choose(self, path: str, holders: list[str]) -> str | None:
        if len(holders) < 2:
            return holders[0] if holders else None

        def rank(holder: str) -> tuple[bool, int, list[object]]:
            return (holder not in self._new_files, self._overlap(path, holder), _natural_key(holder))

        return max(holders, key=rank)

    def _overlap(self, path: str, holder: str) -> int:
        """How many tensor names the new file ``path`` shares with the earlier file ``holder``:
        counted once per pair of files, not once per tensor (a commit of n tensors paired by
        name would otherwise count n times over n names)."""
        key = (path, holder)
        if key not in self._overlaps:
            names = set(self._new_files.get(path, ()))
            self._overlaps[key] = sum(t.name in names for t in self._files[holder].tensors)
        return self._overlaps[key]

    def __iter__(self) -> Iterator[Position]:
        return iter(self._by_position)

    def __len__(self) -> int:
        return len(self._by_position)
