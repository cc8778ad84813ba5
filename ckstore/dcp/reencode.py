"""Where a rank's pieces are stored, and when the previous commit's chunks become deltas.

A save stores every new chunk whole (``store_pieces``): hashing and one byte-grouped zstd pass,
nothing else, so ``dcp.save`` costs about what writing the bytes costs. Once the rank's objects
are durable, the chunks the previous commits of the branch had at the same positions (by file
and piece name, else by piece name: ``positions.ChunkIndex``) are re-encoded as deltas against
the new ones (``ObjectStore.reverse_delta``: newest whole, older as deltas, chains bounded by
``max_delta_depth``) on a background thread of the saving process — the same encoding an
ordinary commit gets, off the path training waits on.

This module is the one place that decides it: when the shared commit path grows a deferred
compaction of its own, ``start_reencoding`` becomes a call to it.

Safety: the re-encoding runs in its own store batch under the repository's shared lock, so gc
and repack cannot run meanwhile; a replaced object is visible only after the new chunk it now
depends on is durable (``Backend.batch``); and only a new chunk that is whole (its header read
under that lock) becomes a base, as the synchronous path allows only chunks it stored itself,
so no chain can close into a cycle. It does not need the commit to exist: if the save fails, the
re-encoded parent chunks point at unreferenced but durable objects, which gc keeps as their bases
(format.md section 8). A failed re-encoding only costs compression and is reported on stderr;
the next save of the process waits for the previous re-encoding first, and so does interpreter
exit (a non-daemon thread).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence

from ..context import RepoContext
from ..ingest import MemoryFile, ingest
from ..manifest import FileEntry
from ..pipeline import ordered_map
from ..positions import ChunkIndex, chunk_at, element_width
from ..store import ObjectStore

_lock = threading.Lock()
_pending: list[threading.Thread] = []


def store_pieces(staged: ObjectStore, source: MemoryFile, chunk_size: int) -> tuple[FileEntry, int]:
    """Store one rank's file, every new chunk whole; its manifest entry and the bytes added."""
    files, added = ingest(staged, [source], chunk_size)
    return files[0], added


def reencode(ctx: RepoContext, entry: FileEntry, history: Sequence[Sequence[FileEntry]]) -> int:
    """Re-encode the chunks of ``history[0]`` (the branch tip before this save) at the positions
    of ``entry``'s chunks as deltas against them; ``history[1:]`` bounds the chains. Returns the
    change in stored bytes (negative: saved)."""
    if not history:
        return 0
    names = {entry.path: [t.name for t in entry.tensors]}
    indexes = [ChunkIndex(files, names) for files in history]
    jobs = []
    for t in entry.tensors:
        position, width = (entry.path, t.name), element_width(t.dtype)
        for i, c in enumerate(t.chunks):
            older = [chunk_at(index, position, i, c.size) for index in indexes]
            if older[0] is not None and older[0] != c.id:
                jobs.append((older[0], c.id, c.size, width, older[1:]))
    if not jobs:
        return 0
    with ctx.backend.shared_lock(), ctx.store.batch() as staged:

        def one(job: tuple[str, str, int, int, list[str | None]]) -> int:
            old, new, size, width, below = job
            if staged.base_of(new) is not None:
                return 0  # found stored as a delta (not by this save): a delta on it could close a cycle
            return staged.reverse_delta(old, size, width, new, staged.get_chunk(new, size), below)

        return sum(ordered_map(one, jobs))


def start_reencoding(ctx: RepoContext, entry: FileEntry, history: Sequence[Sequence[FileEntry]]) -> None:
    """Run ``reencode`` on a background thread (module docstring); returns at once."""
    if not history:
        return
    wait_reencoding()  # one at a time: the chains below each chunk are read as they are

    def run() -> None:
        try:
            reencode(ctx, entry, history)
        except Exception as exc:  # noqa: BLE001 - reported, and harmless: the chunks stay whole
            print(f"ckstore: re-encoding the previous checkpoint's chunks of {entry.path} as deltas failed "
                  f"(they stay whole): {exc}", file=sys.stderr)

    thread = threading.Thread(target=run, name="ckstore-dcp-reencode")
    with _lock:
        _pending.append(thread)
    thread.start()


def wait_reencoding() -> None:
    """Wait until this process's background re-encodings have finished (a benchmark or a test
    that measures stored bytes calls it; a save calls it before it starts another)."""
    while True:
        with _lock:
            if not _pending:
                return
            thread = _pending.pop(0)
        thread.join()
