"""How a rank's pieces are stored, and when the branch's chunks are re-encoded.

A save stores every new chunk the fast way (hash, plain zstd at the fast level, write:
``ingest(fast=True)``), so ``dcp.save`` costs about what writing the bytes costs. After the
coordinator has recorded the commit, the repository's compaction (compact.py, the same as after
any commit) re-encodes the branch tip's parent as reverse deltas against the new chunks, or in
its best whole encoding where none pays, on a background thread of the coordinator's process
(``commit.record_commit`` starts it, as for every commit: write/background.py).
Pieces are paired with the parent's by file and piece name, else by piece name
(``positions.ChunkIndex``), so a piece that moved to another rank file still gets its delta.

Only the coordinator compacts: compaction covers the whole commit (every rank's file), and one
runs at a time per repository anyway (``Backend.compaction_lock``). A save does not wait for the
previous save's compaction (it holds the shared lock like any writer); ``wait_compaction``
(remote_compaction.py) waits for this process's, and interpreter exit waits on its own
(write/background.py).
"""

from __future__ import annotations

from ckstore.format.manifest import FileEntry
from ckstore.repository.store import ObjectStore
from ckstore.write.ingest import MemoryFile, ingest


def store_pieces(staged: ObjectStore, source: MemoryFile, chunk_size: int) -> tuple[FileEntry, int]:
    """Store one rank's file, new chunks the fast way; its manifest entry and the bytes added.
    All of them land in one pack (a large step's in a few): the step's own compaction replaces
    none of them, the next step's replaces most (weights and second moments by predicted deltas,
    first moments by deltas or their best whole encoding) and rewrites the pack then."""
    files, added = ingest(staged, [source], chunk_size, fast=True)
    return files[0], added
