"""Turning files on disk into stored chunks and manifest file entries (the commit write path).

Files are read sequentially in the calling thread, one chunk at a time; hashing, compression and
object writes run on a bounded thread pool (see pipeline.py), so memory stays at a few chunks
whatever the checkpoint size. A safetensors file is validated in full from its header before any
of its data is stored; its tensors are chunked from each tensor's own start, so an unchanged
tensor yields the same chunks wherever it sits in the file.
"""

from __future__ import annotations

import os
import struct
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from ckstore.errors import (
    CkstoreWarning,
    InvalidInputError,
    InvalidPathError,
    PickleCheckpointError,
    SafetensorsFormatError,
    StorageError,
)
from ckstore.format.ids import chunk_id
from ckstore.format.manifest import ChunkRef, FileEntry, TensorEntry, check_relative_path
from ckstore.format.positions import HEADER, ChunkIndex, Position, chunk_at, element_width
from ckstore.format.safetensors import SafetensorsLayout, header_length, parse_header
from ckstore.format.tensor_stats import (
    NUMERIC_DTYPES,
    ChunkStats,
    StatsAccumulator,
    TensorStats,
    chunk_stats,
    item_size,
)
from ckstore.repository.store import ObjectStore, PutResult
from ckstore.runtime.pipeline import grouped, ordered_map
from ckstore.write.spans import OpenSource, Span, read_span, recycle

Progress = Callable[[int], None]
SAFETENSORS_SUFFIX = ".safetensors"


# Every pickle opcode (pickletools.opcodes): a protocol 2+ pickle is PROTO <n> then one of these.
_PICKLE_OPCODES = frozenset(b"()0123BCFGIJKLMNPQRSTUVX]abcdeghijlopqrstu}" + bytes(range(0x80, 0x99)))
_ZIP_LOCAL = struct.Struct("<4s22xHH")  # signature, then file name and extra field lengths


def pickle_format(path: Path) -> str | None:
    """ "zip" for a torch.save archive, "pickle" for a protocol 2+ pickle (also torch's legacy
    format), None otherwise. Only the first bytes are read; nothing is unpickled."""
    try:
        with open(path, "rb") as f:
            head = f.read(_ZIP_LOCAL.size + 256)
    except OSError:
        return None
    if len(head) >= 3 and head[0] == 0x80 and 2 <= head[1] <= 5 and head[2] in _PICKLE_OPCODES:
        return "pickle"
    if len(head) >= _ZIP_LOCAL.size:
        signature, name_len, _ = _ZIP_LOCAL.unpack_from(head)
        name = head[_ZIP_LOCAL.size : _ZIP_LOCAL.size + name_len]
        # torch.save writes its pickle first, as "<archive>/data.pkl".
        if signature == b"PK\x03\x04" and (name == b"data.pkl" or name.endswith(b"/data.pkl")):
            return "zip"
    return None


def _refuse_pickle(source: Path) -> None:
    if pickle_format(source) is not None:
        raise PickleCheckpointError(
            f"{source} is a PyTorch pickle checkpoint, which commit would store as one opaque blob without per-tensor"
            " dedup: import it (ckstore import, Repo.import_checkpoint) to store its tensors, or commit it raw",
            str(source),
        )


@dataclass(frozen=True)
class SourceFile:
    path: str  # relative POSIX path recorded in the manifest
    source: Path
    size: int


def _is_inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


def collect_sources(paths: Sequence[str | os.PathLike[str]], exclude: Path, raw: bool = False) -> list[SourceFile]:
    """Files to commit: each file argument under its own name, each directory's files under
    their path relative to it (recursively; the repository itself is skipped).

    Unless ``raw``, a pickle checkpoint named as an argument is refused (import is the way to
    store one), and pickles inside a directory are stored as they are with a CkstoreWarning: a
    Trainer's checkpoint folder holds optimizer.pt, rng_state.pth… and must check out unchanged.
    """
    found: dict[str, SourceFile] = {}
    pickles: list[str] = []
    escaping: list[str] = []  # symlinks in a folder whose target lies outside it

    def add(rel: str, source: Path) -> None:
        rel = check_relative_path(rel)
        if rel in found:
            raise InvalidInputError(f"two inputs would both be stored as {rel!r}")
        try:
            size = source.stat().st_size
        except OSError as exc:
            raise InvalidInputError(f"cannot read {source}: {exc.strerror}") from None
        found[rel] = SourceFile(rel, source, size)

    if not paths:
        raise InvalidInputError("nothing to commit: give at least one file or directory")
    for given in paths:
        root = Path(given)
        if root.is_dir():
            if _is_inside(root, exclude):
                raise InvalidInputError(f"{root} is inside the repository")
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames[:] = sorted(d for d in dirnames if not _is_inside(Path(dirpath, d), exclude))
                for name in sorted(filenames):
                    full = Path(dirpath, name)
                    if full.is_file():
                        add(full.relative_to(root).as_posix(), full)
                        if full.is_symlink() and not _is_inside(full, root):
                            escaping.append(f"{full.relative_to(root).as_posix()} -> {full.resolve()}")
                        if not raw and not name.endswith(SAFETENSORS_SUFFIX) and pickle_format(full):
                            pickles.append(full.relative_to(root).as_posix())
        elif root.is_file():
            if not raw and not root.name.endswith(SAFETENSORS_SUFFIX):
                _refuse_pickle(root)
            add(root.name, root)
        else:
            raise InvalidInputError(f"no such file or directory: {root}")
    if not found:
        raise InvalidInputError("nothing to commit: the given directories hold no files")
    for rel in found:  # "a" and "a/b" cannot both be files in a checkout
        parent = rel.rsplit("/", 1)[0] if "/" in rel else None
        while parent:
            if parent in found:
                raise InvalidPathError(f"{parent!r} is both a file and a directory")
            parent = parent.rsplit("/", 1)[0] if "/" in parent else None
    if pickles:
        warnings.warn(
            CkstoreWarning(
                f"storing {len(pickles)} pickle file(s) as opaque blobs, without per-tensor dedup ({', '.join(pickles[:3])}"
                f"{', …' if len(pickles) > 3 else ''}); import converts a pickle checkpoint to tensors (ckstore import)"
            ),
            stacklevel=3,
        )
    if escaping:
        # The link's target is stored as a file of the commit (and pushed with it): say so.
        warnings.warn(
            CkstoreWarning(
                f"storing the target of {len(escaping)} symlink(s) that lead outside the folder, as plain files"
                f" ({', '.join(escaping[:3])}{', …' if len(escaping) > 3 else ''})"
            ),
            stacklevel=3,
        )
    return sorted(found.values(), key=lambda s: s.path)


def read_layout(f: BinaryIO, name: str, size: int) -> SafetensorsLayout:
    """Read and validate a safetensors header from an open file."""
    try:
        prefix = f.read(8)
        length = header_length(prefix)
        if 8 + length > size:
            raise SafetensorsFormatError(f"header length {length} runs past the end of the {size}-byte file")
        header = prefix + f.read(length)
        return parse_header(header, size)
    except SafetensorsFormatError as exc:
        raise SafetensorsFormatError(f"{name} is not a valid safetensors file: {exc}") from None


@dataclass(frozen=True)
class MemoryFile:
    """A file built in memory (training state): its segments are already bytes-like.

    ``segments`` are the header and then each tensor's bytes for a safetensors file (``layout``
    given), or a single segment for a blob. Chunks are cut from these buffers without copying.
    """

    path: str
    layout: SafetensorsLayout | None
    segments: tuple[memoryview, ...]

    @property
    def size(self) -> int:
        return sum(len(s) for s in self.segments)


@dataclass
class _Plan:
    """One file's segments (header, each tensor, or the whole blob) in the order they are read."""

    source: SourceFile | MemoryFile
    layout: SafetensorsLayout | None
    segments: list[list[ChunkRef]]
    stats: list[StatsAccumulator | None] = field(default_factory=list)  # per segment; None: not recorded
    opened: OpenSource | None = None  # a source file while its chunks are read


def _jobs(plans: list[_Plan], chunk_size: int) -> Iterator[tuple[int, int, int, Span | memoryview]]:
    """Every chunk of every file, in order: a memory file's as views of its buffers, a source
    file's as spans its workers read (spans.py)."""
    for p_index, plan in enumerate(plans):
        if isinstance(plan.source, MemoryFile):
            for s_index, buffer in enumerate(plan.source.segments):
                for c_index, offset in enumerate(range(0, len(buffer), chunk_size)):
                    yield p_index, s_index, c_index, buffer[offset : offset + chunk_size]
            continue
        source = plan.opened = OpenSource(plan.source.source, plan.source.size)
        if plan.layout is None:
            spans = [(0, plan.source.size)]
        else:
            base = plan.layout.data_offset
            spans = [(0, base)] + [(base + t.begin, t.nbytes) for t in plan.layout.tensors]
        for s_index, (offset, length) in enumerate(spans):
            for c_index, start in enumerate(range(offset, offset + length, chunk_size)):
                yield p_index, s_index, c_index, source.span(start, min(chunk_size, offset + length - start))
        source.all_listed()


def _chunk_kind(plan: _Plan, s_index: int) -> tuple[int, Position]:
    """Element width and position of the chunks of one segment of a file."""
    if plan.layout is None:
        return 1, (plan.source.path, None)
    if s_index == 0:
        return 1, (plan.source.path, HEADER)
    tensor = plan.layout.tensors[s_index - 1]
    return element_width(tensor.dtype), (plan.source.path, tensor.name)


@dataclass(frozen=True)
class _ParentFigures:
    """A chunk that is the parent's chunk at its index, whose tensor entry has its figures: they
    are not computed again (a frozen tensor costs its hashing only)."""

    parent: TensorStats


def _tensor_stats(
    piece: bytes | memoryview, dtype: str, previous: TensorEntry | None, c_index: int, chunk_id: str
) -> ChunkStats | _ParentFigures | None:
    """One chunk's statistics, computed where its bytes already are (a pipeline worker)."""
    if len(piece) % item_size(dtype):
        return None  # a chunk size that splits elements: left to the on-demand path
    same = previous is not None and c_index < len(previous.chunks) and previous.chunks[c_index].id == chunk_id
    if same and previous is not None and previous.stats is not None:
        return _ParentFigures(previous.stats)
    return chunk_stats(piece, dtype, same_as_parent=same)


def _finish(store: ObjectStore, accumulator: StatsAccumulator, dtype: str) -> TensorStats:
    """A tensor's figures; the chunks left to the parent's figures are read back where only some
    of the tensor's were (the rest changed, so the parent's tensor figures do not apply)."""
    if accumulator.skipped and accumulator.counted:
        for chunk_id, length in accumulator.skipped:
            accumulator.add(chunk_stats(store.get_chunk(chunk_id, length), dtype, same_as_parent=True))
        accumulator.skipped.clear()
    return accumulator.result()


def _plan_source(source: SourceFile | MemoryFile, with_stats: bool) -> _Plan:
    """How one source is cut: its safetensors layout (None: plain bytes) and empty segments."""
    layout = None
    if isinstance(source, MemoryFile):
        layout = source.layout
        segments: list[list[ChunkRef]] = [[] for _ in source.segments]
    elif source.path.endswith(SAFETENSORS_SUFFIX):
        try:
            with open(source.source, "rb") as f:
                layout = read_layout(f, str(source.source), source.size)
        except OSError as exc:
            raise StorageError(f"cannot read {source.source}: {exc.strerror}") from None
        if layout.plain_reason is not None:
            layout = None  # safetensors reads it, the manifest cannot model it: plain bytes (format.md 13)
        segments = [[] for _ in range(1 + len(layout.tensors))] if layout else [[]]
    else:
        segments = [[]]
    plan = _Plan(source, layout, segments, [None] * len(segments))
    if with_stats and layout is not None:
        plan.stats[1:] = [StatsAccumulator() if t.dtype in NUMERIC_DTYPES else None for t in layout.tensors]
    return plan


def _record(
    plan: _Plan, s_index: int, length: int, result: PutResult, figures: ChunkStats | _ParentFigures | None
) -> None:
    """One stored chunk, in input order: its reference, and its figures into the tensor's."""
    plan.segments[s_index].append(ChunkRef(result.id, length))
    accumulator = plan.stats[s_index]
    if accumulator is not None:
        if figures is None:
            plan.stats[s_index] = None
        elif isinstance(figures, _ParentFigures):
            accumulator.skip(result.id, length, figures.parent)
        else:
            accumulator.add(figures)
    if plan.opened is not None:
        plan.opened.finished()


def ingest(
    store: ObjectStore,
    sources: Sequence[SourceFile | MemoryFile],
    chunk_size: int,
    progress: Progress | None = None,
    parent: Sequence[FileEntry] | None = None,
    fast: bool = False,
    stats: Mapping[tuple[str, str], TensorEntry] | None = None,
) -> tuple[list[FileEntry], int]:
    """Store every chunk of ``sources``; return their manifest entries and the bytes added.

    ``stats`` given (the first parent's tensors by path and name), every numeric tensor's entry
    carries its statistics (format.md 5.1); its relative change is recorded when it is free (0.0
    for a tensor whose chunks are all its previous version's).

    ``parent`` (an overlay's base commit's files) offers the previous version of each chunk (the
    chunk at the same index of the same tensor, found by ``positions.ChunkIndex``: by position,
    else by tensor name) as the base of a forward delta. ``fast`` stores new multi-byte chunks
    provisionally (``ObjectStore.put_chunk``), for compaction (compact.py) to re-encode later.
    """
    plans = [_plan_source(source, stats is not None) for source in sources]
    # numpy (for the statistics) is imported by the first worker that needs it. It used to start
    # on a thread of its own, to overlap the first chunks: that thread held the GIL the workers
    # needed, and both waited for the import anyway (alternated CLI commits of a 271 MB epoch,
    # 8 runs each: 0.382 s median without it against 0.402 s; bf16 0.328 against 0.324 s).
    new_files = {p.source.path: [t.name for t in p.layout.tensors] for p in plans if p.layout is not None}
    base_index = ChunkIndex(parent, new_files) if parent is not None else None

    Result = tuple[int, int, int, PutResult, ChunkStats | _ParentFigures | None]

    def put(job: tuple[int, int, int, Span | memoryview]) -> Result:
        p_index, s_index, c_index, piece = job
        if isinstance(piece, Span):
            view = read_span(piece)
            try:
                result = store_piece(p_index, s_index, c_index, view)
            finally:
                recycle(view)
            piece.source.stored(piece)
            return result
        return store_piece(p_index, s_index, c_index, piece)

    def store_piece(p_index: int, s_index: int, c_index: int, piece: memoryview) -> Result:
        plan = plans[p_index]
        width, position = _chunk_kind(plan, s_index)
        if position[1] == HEADER:
            # Headers are not delta candidates at commit: unchanged ones dedup, changed ones are
            # small (repack may still pair them).
            return p_index, s_index, len(piece), store.put_chunk(piece, width), None
        # The chunk's name first, then its figures, then storing it: the figures read the bytes
        # while hashing has just brought them into the cache (storing copies them twice more).
        # bf16 in-process commit, figures' cost 0.11-0.14 -> 0.08-0.11 s a 136 MB epoch (idle).
        oid = chunk_id(piece)
        figures = None
        if stats is not None and plan.stats[s_index] is not None and plan.layout is not None:
            tensor = plan.layout.tensors[s_index - 1]
            previous = stats.get((plan.source.path, tensor.name))
            if previous is not None and (previous.dtype != tensor.dtype or previous.shape != tuple(tensor.shape)):
                previous = None
            figures = _tensor_stats(piece, tensor.dtype, previous, c_index, oid)
        if base_index is not None:
            result = store.put_chunk(piece, width, chunk_at(base_index, position, c_index, len(piece)), oid=oid)
        else:
            result = store.put_chunk(piece, width, fast=fast, oid=oid)
        return p_index, s_index, len(piece), result, figures

    added = 0
    # Small pieces travel to the workers together (pipeline.grouped), up to half a chunk's bytes.
    groups = grouped(_jobs(plans, chunk_size), lambda job: len(job[3]), chunk_size // 2)
    # ``closing``: on an exception (a Ctrl-C) the map waits for its running chunks before the
    # batch is discarded, or a worker still storing one would start a pack after the discard.
    try:
        with closing(ordered_map(lambda group: [put(job) for job in group], groups)) as mapped:
            for results in mapped:
                for p_index, s_index, length, result, figures in results:
                    _record(plans[p_index], s_index, length, result, figures)
                    added += result.stored
                    if progress:
                        progress(length)
    finally:
        for plan in plans:
            if plan.opened is not None:
                plan.opened.close()
    return [_entry(store, plan) for plan in plans], added


def _entry(store: ObjectStore, plan: _Plan) -> FileEntry:
    if plan.layout is None:
        return FileEntry(plan.source.path, "blob", plan.source.size, chunks=tuple(plan.segments[0]))
    tensors = tuple(
        TensorEntry(
            t.name, t.dtype, tuple(t.shape), tuple(chunks), _finish(store, figures, t.dtype) if figures else None
        )
        for t, chunks, figures in zip(plan.layout.tensors, plan.segments[1:], plan.stats[1:])
    )
    return FileEntry(plan.source.path, "safetensors", plan.source.size, header=tuple(plan.segments[0]), tensors=tensors)
