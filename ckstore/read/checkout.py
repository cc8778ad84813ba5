"""Writing a commit's files back out (the read path of checkout).

Each output file is written to a temporary file beside its target, then renamed into place, so
no file under its final name is ever partially written by a checkout that fails or is killed.
The files are not made durable unless asked (``durable``: each fsynced before the renames, then
their folders), as git's checkout, cp, tar and restic's restore leave them: the repository holds
the durable copy, and a checkout can be made again (docs/design.md, "Checkout"). A checkout
killed outright (SIGKILL, power loss) can leave its hidden temporary ``.NAME.PID.HEX.ckstore-tmp``; the next
checkout writing into that folder removes the temporaries of processes that no longer run.
Before anything is written every target is checked: a different existing file is refused unless
``force``; an identical one (same size, and every chunk region hashing to its chunk's name) is
left alone. A model's files in the other layout (``model.safetensors`` against
``model-0000X-of-0000N.safetensors`` and their index) are refused the same way, and removed with
``force``, so the folder holds the commit's model alone. Chunks are fetched, decoded, verified and written at their offsets on a bounded
thread pool.
"""

from __future__ import annotations

import fnmatch
import os
import re
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ckstore.backend.fsio import (
    EarlyFlush,
    PositionalWriter,
    available_memory,
    fsync_path,
    mutating_step,
    pid_alive,
    write_out,
    write_out_and_drop,
)
from ckstore.errors import InvalidPathError, OutputExistsError, StorageError, TensorNotFoundError
from ckstore.format.ids import chunk_id
from ckstore.format.manifest import ChunkRef, Commit, FileEntry, TensorEntry, check_relative_path
from ckstore.format.safetensors import emit_header
from ckstore.repository.filedata import file_context, header_metadata
from ckstore.repository.store import ObjectStore
from ckstore.runtime.pipeline import ordered_map
from ckstore.runtime.progress import ProgressFactory, watching

if TYPE_CHECKING:
    import numpy as np

Progress = Callable[[int], None]
TEMP_SUFFIX = ".ckstore-tmp"
_TEMP_NAME = re.compile(r"\..+\.(\d+)\.[0-9a-f]{12}" + re.escape(TEMP_SUFFIX))


@dataclass
class CheckoutResult:
    written: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    bytes_written: int = 0
    removed: list[str] = field(default_factory=list)  # another layout's files of the same model (--force)
    merged_adapter: str | None = None  # export: the LoRA adapter merged into the written model


# A piece of an output file: a stored chunk, literal bytes (a re-emitted header), or a function
# computing bytes when the piece is written (merged LoRA weights), so memory holds one at a time.
Piece = ChunkRef | bytes | Callable[[], bytes]


@dataclass(frozen=True)
class Output:
    """What to write at one path: a sequence of byte pieces (chunks or a re-emitted header)."""

    path: str
    pieces: tuple[tuple[Piece, str], ...]  # (piece, context for errors)
    size: int


def full_output(f: FileEntry) -> Output:
    pieces: list[tuple[Piece, str]] = [(c, file_context(f.path, None)) for c in f.header + f.chunks]
    for t in f.tensors:
        pieces.extend((c, file_context(f.path, t.name)) for c in t.chunks)
    return Output(f.path, tuple(pieces), f.size)


def _filtered_output(store: ObjectStore, f: FileEntry, patterns: Sequence[str]) -> Output | None:
    keep = select_tensors(f.tensors, patterns)
    if not keep:
        return None
    if len(keep) == len(f.tensors):
        return full_output(f)
    header, _ = emit_header([(t.name, t.dtype, t.shape) for t in keep], header_metadata(store, f))
    pieces: list[tuple[Piece, str]] = [(header, "")]
    for t in keep:
        pieces.extend((c, file_context(f.path, t.name)) for c in t.chunks)
    return Output(f.path, tuple(pieces), len(header) + sum(t.nbytes for t in keep))


def plan_outputs(store: ObjectStore, commit: Commit, only: Sequence[str] | None) -> list[Output]:
    if only:
        check_patterns([t for f in commit.files if f.kind == "safetensors" for t in f.tensors], only)
    outputs = []
    for f in commit.files:
        if only and f.kind == "safetensors":
            out = _filtered_output(store, f, only)
            if out is not None:
                outputs.append(out)
        else:
            outputs.append(full_output(f))
    return outputs


def _target(out_dir: Path, rel: str) -> Path:
    check_relative_path(rel)
    target = out_dir / rel
    # A symlinked folder inside out_dir must not carry the write elsewhere.
    resolved_parent = target.parent.resolve()
    if resolved_parent != out_dir.resolve() and out_dir.resolve() not in resolved_parent.parents:
        raise InvalidPathError(f"output path {rel!r} leads outside {out_dir}")
    return target


def _blocking_file(out_dir: Path, rel: str) -> Path | None:
    """An existing non-folder where the output needs a folder: ``out_dir`` itself or a parent of
    ``rel`` in it. --force does not remove it: it is not a version of any file being written."""
    parents = rel.split("/")[:-1]
    for depth in range(len(parents) + 1):
        folder = out_dir.joinpath(*parents[:depth])
        if not (folder.exists() or folder.is_symlink()):
            return None
        if not folder.is_dir():
            return folder
    return None


def _same_file(target: Path, output: Output) -> bool:
    """True when the existing file holds exactly the bytes ``output`` would write: chunk regions
    hash to their chunk's name and literal pieces compare equal, so nothing is decoded. Computed
    pieces (merged LoRA weights) are computed, one at a time, and compared: a second checkout with
    ``merge_lora`` into the same folder finds its own output unchanged instead of a conflict."""
    if not target.is_file() or target.stat().st_size != output.size:
        return False
    with open(target, "rb") as f:
        for piece, _ in output.pieces:
            if isinstance(piece, ChunkRef):
                if chunk_id(f.read(piece.size)) != piece.id:
                    return False
                continue
            expected = piece() if callable(piece) else piece
            if f.read(len(expected)) != expected:
                return False
    return True


def _get(store: ObjectStore, item: tuple[Piece, str]) -> bytes | memoryview:
    piece, context = item
    if isinstance(piece, bytes):
        return piece
    if isinstance(piece, ChunkRef):
        return store.chunk_view(piece.id, piece.size, context)
    return piece()


def _get_reusing(
    store: ObjectStore,
    item: tuple[Piece, str],
    buffers: _Buffers,
) -> tuple[bytes | memoryview, np.ndarray | None]:
    """``_get``, a chunk decoded into one of ``buffers`` (returned too: given back once written)."""
    piece, context = item
    if not isinstance(piece, ChunkRef):
        return _get(store, item), None
    buf = buffers.take(piece.size)
    return store.chunk_view(piece.id, piece.size, context, buf), buf


class _Buffers:
    """Arrays chunks are decoded into, each reused once its chunk is written: a fresh array costs
    a page fault per 4 KiB written, measured as a tenth of the CPU of a checkout. At most as many
    as chunks in flight (the pipeline bounds those) plus ``KEEP_BYTES`` kept between them."""

    KEEP_BYTES = 64 << 20

    def __init__(self) -> None:
        self.free: list[np.ndarray] = []
        self.lock = threading.Lock()

    def take(self, n: int) -> np.ndarray:
        import numpy as np

        with self.lock:
            for i, buf in enumerate(self.free):
                if buf.size == n:
                    return self.free.pop(i)
        return np.empty(n, np.uint8)

    def give(self, buf: np.ndarray | None) -> None:
        """Take back an array ``take`` gave, once nothing reads it."""
        if buf is None or buf.size > self.KEEP_BYTES:
            return
        with self.lock:
            self.free.append(buf)
            while sum(b.size for b in self.free) > self.KEEP_BYTES:
                self.free.pop(0)


# A checkout whose files exceed this share of the memory the kernel can cache writes them through
# to the disk and out of the page cache as it goes (not durable: no device flush). Left cached,
# its unsynced pages evicted the repository's pages it had not read yet, which were older: a
# 10 GB checkout read 3.7-5.9 GB of its pack from disk (docs/benchmarks.md, the 10 GB runs).
# It drops what it read of the repository too: read twice (compaction, checkout), those pages
# held the cache, and the next epoch's checkpoint was evicted before its commit read it.
WRITE_THROUGH_SHARE = 0.25
# A smaller checkout whose files exceed this share is written out as it goes and kept cached: at
# 3 GB (a fifth of what the kernel could cache) its dirty pages passed the kernel's background
# threshold (10%, vm.dirty_background_ratio), the writers were throttled, and the checkout took
# 4.2-7.1 s where the same checkout with --fsync, flushed as it goes, took 2.5-3.4 s.
WRITE_OUT_SHARE = 0.05


class _Staged:
    """One output being written to a hidden temporary beside its target."""

    def __init__(self, target: Path, durable: bool, through: bool = False, out: bool = False) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        self.target = target
        self.durable = durable
        self.through = through
        self.tmp = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}{TEMP_SUFFIX}")
        mutating_step()
        self.file = open(self.tmp, "xb")
        fd = self.file.fileno()
        self.writer = PositionalWriter(fd)
        # Keeps the final fsync short (fsio.py); without one, writeback is left to the kernel,
        # unless the file is written through or out (``WRITE_THROUGH_SHARE``, ``WRITE_OUT_SHARE``).
        flush = (
            (lambda: os.fdatasync(fd))
            if durable
            else (lambda: write_out_and_drop(fd))
            if through
            else (lambda: write_out(fd))
            if out
            else (lambda: None)
        )
        self.early = EarlyFlush(flush)

    def write(self, data: bytes | memoryview) -> None:
        self.file.write(data)

    def write_at(self, data: bytes | memoryview, offset: int) -> None:
        """Write ``data`` at ``offset`` (a worker, while others write elsewhere in the file)."""
        self.writer.write_at(data, offset)

    def sync(self) -> None:
        """Written out (durable when asked), then closed. An early flush's error is reported once
        per descriptor, so the fsync would not see it again: finish raises it."""
        try:
            self.file.flush()
            self.early.finish()
            if self.durable:
                mutating_step()
                os.fsync(self.file.fileno())
            elif self.through:
                write_out_and_drop(self.file.fileno())
        finally:
            self.file.close()

    def abandon(self) -> None:
        self.early.finish(quiet=True)
        self.file.close()
        self.tmp.unlink(missing_ok=True)


def _positions(output: Output) -> list[int] | None:
    """Where each piece of ``output`` starts, when every size is known before it is made (not for
    computed pieces: merged LoRA weights)."""
    starts, at = [], 0
    for piece, _ in output.pieces:
        if callable(piece):
            return None
        starts.append(at)
        at += piece.size if isinstance(piece, ChunkRef) else len(piece)
    return starts


def _write_all(store: ObjectStore, todo: list[tuple[Path, Output]], progress: Progress | None, durable: bool) -> None:
    """Write every output: all of them through one pipeline (no drain and refill between files).
    The workers that decode the chunks write them at their offsets (a file whose pieces include
    computed ones is written in order by this thread); each file is closed (``durable``: fsynced)
    on a background thread once its last piece is written, while the next ones are; each is
    renamed over its target once every file is written (durable), then (``durable``) the folders
    are fsynced. A failure leaves the targets as they were."""
    staged: list[_Staged] = []
    syncs: list[Future[None]] = []
    buffers = _Buffers()
    available = available_memory()
    size = total_size([o for _, o in todo])
    through = not durable and available is not None and size > available * WRITE_THROUGH_SHARE
    out = not durable and not through and available is not None and size > available * WRITE_OUT_SHARE

    def jobs() -> Iterable[tuple[int, int | None, tuple[Piece, str]]]:
        for i, (target, output) in enumerate(todo):  # outputs without pieces (empty files) are opened too
            staged.append(_Staged(target, durable, through, out))
            starts = _positions(output)
            for k, item in enumerate(output.pieces):
                yield i, None if starts is None else starts[k], item

    def write(job: tuple[int, int | None, tuple[Piece, str]]) -> tuple[int, bytes | memoryview | None, int]:
        i, offset, item = job
        data, buf = _get_reusing(store, item, buffers)
        if through and isinstance(item[0], ChunkRef):
            store.forget_cached(item[0].id)  # read once: the next epoch's checkpoint needs the room
        if offset is None:
            return i, data, len(data)  # written in order by the caller
        staged[i].write_at(data, offset)
        buffers.give(buf)
        return i, None, len(data)

    with ThreadPoolExecutor(1, thread_name_prefix="ckstore-fsync") as syncer:
        try:

            def close_before(i: int) -> None:  # every piece of the outputs before i is written
                while len(syncs) < i:
                    syncs.append(syncer.submit(staged[len(syncs)].sync))

            with closing(ordered_map(write, jobs())) as written:  # waits for its workers on an error
                for i, data, n in written:
                    close_before(i)
                    if data is not None:
                        staged[i].write(data)
                    staged[i].early.wrote(n)
                    if progress:
                        progress(n)
            close_before(len(staged))
            for future in syncs:
                future.result()
        except BaseException:
            for future in syncs:
                future.exception()  # settled before its file is removed
            for s in staged:
                s.abandon()
            raise
    try:
        for s in staged:
            mutating_step()
            os.replace(s.tmp, s.target)
    except BaseException:
        for s in staged:
            s.tmp.unlink(missing_ok=True)
        raise
    if durable:
        for folder in sorted({s.target.parent for s in staged}):
            mutating_step()
            fsync_path(folder)


def remove_dead_temporaries(folder: Path) -> int:
    """Delete the checkout temporaries in ``folder`` whose writer (the PID in the name) is gone."""
    removed = 0
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return 0
    for entry in entries:
        m = _TEMP_NAME.fullmatch(entry.name)
        if m and entry.is_file(follow_symlinks=False) and not pid_alive(int(m.group(1))):
            try:
                os.unlink(entry.path)
                removed += 1
            except OSError:
                pass  # gone meanwhile, or not ours to delete: harmless
    return removed


# A model's safetensors as one file, as numbered shards, and the shards' index: the three names
# of one layout. transformers loads ``S.safetensors`` first when both layouts lie in a folder.
_LAYOUT_NAME = re.compile(r"(?P<stem>[^/]+?)(?:\.safetensors|-\d{5}-of-\d{5}\.safetensors|\.safetensors\.index\.json)")


def layout_counterparts(out_dir: Path, outputs: Sequence[Output]) -> list[str]:
    """Files in ``out_dir`` of the same model as a top-level safetensors output but of another
    layout (a single ``model.safetensors`` beside new shards, old shards or their index beside a
    single file, shards of another count): left there, they would be loaded instead of, or
    mixed with, what the checkout writes."""
    written = {o.path for o in outputs}
    stems = {m.group("stem") for path in written if (m := _LAYOUT_NAME.fullmatch(path))}
    if not stems:
        return []
    try:
        names = sorted(e.name for e in os.scandir(out_dir) if e.is_file(follow_symlinks=False) or e.is_symlink())
    except OSError:
        return []
    return [n for n in names if n not in written and (m := _LAYOUT_NAME.fullmatch(n)) and m.group("stem") in stems]


def _remove_counterparts(out_dir: Path, names: Sequence[str], durable: bool) -> None:
    """Removed before the new layout is written: a checkout stopped part-way then leaves an
    incomplete model that fails to load, never an old one that loads silently."""
    for name in names:
        try:
            os.unlink(out_dir / name)
        except FileNotFoundError:
            pass
    if names and durable:
        fsync_path(out_dir)


def write_outputs(
    store: ObjectStore,
    outputs: list[Output],
    out_dir: Path,
    force: bool,
    progress: Progress | None = None,
    durable: bool = False,
) -> CheckoutResult:
    result = CheckoutResult()
    todo: list[tuple[Path, Output]] = []
    conflicts = []
    for output in outputs:
        blocker = _blocking_file(out_dir, output.path)
        if blocker is not None:
            raise OutputExistsError(f"{blocker} is not a directory, and the checkout writes {output.path} below it")
        target = _target(out_dir, output.path)
        if target.exists() or target.is_symlink():
            if target.is_dir():
                raise OutputExistsError(f"{target} is a directory")
            if _same_file(target, output):
                result.unchanged.append(output.path)
                continue
            if not force:
                conflicts.append(output.path)
                continue
        todo.append((target, output))
    stale = layout_counterparts(out_dir, outputs)
    if not force:
        conflicts.extend(stale)
    if conflicts:
        raise OutputExistsError(
            f"{len(conflicts)} file(s) in {out_dir} differ from the commit ({', '.join(conflicts[:3])}"
            f"{', …' if len(conflicts) > 3 else ''}); use --force to overwrite"
        )
    try:
        for folder in sorted({target.parent for target, _ in todo}):
            remove_dead_temporaries(folder)
        _remove_counterparts(out_dir, stale, durable)
        result.removed.extend(stale)
        _write_all(store, todo, progress, durable)
        for _, output in todo:
            result.written.append(output.path)
            result.bytes_written += output.size
    except OSError as exc:
        raise StorageError(f"cannot write {out_dir}: {exc.strerror or exc}") from None
    return result


def total_size(outputs: list[Output]) -> int:
    return sum(o.size for o in outputs)


def write_with_progress(
    store: ObjectStore,
    outputs: list[Output],
    out_dir: Path,
    force: bool,
    progress: ProgressFactory | None,
    desc: str = "checkout",
    durable: bool = False,
) -> CheckoutResult:
    """``write_outputs`` with a progress bar over the bytes to write (when a factory is given)."""
    with watching(progress, total_size(outputs), desc) as advance:
        return write_outputs(store, outputs, out_dir, force, advance, durable)


def select_tensors(tensors: Iterable[TensorEntry], patterns: Sequence[str]) -> list[TensorEntry]:
    return [t for t in tensors if any(fnmatch.fnmatchcase(t.name, p) for p in patterns)]


def check_patterns(tensors: Iterable[TensorEntry], patterns: Sequence[str]) -> None:
    """Every pattern must match a tensor: a mistyped one must not check out the rest silently."""
    names = [t.name for t in tensors]
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            raise TensorNotFoundError(f"no tensor of the commit matches {pattern!r}")
