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
waits for this process's, and interpreter exit waits on its own (write/background.py).
"""

from __future__ import annotations

from ckstore.format.manifest import FileEntry
from ckstore.format.optstate import FIRST, member
from ckstore.repository.store import ObjectStore
from ckstore.write.background import wait_all
from ckstore.write.ingest import MemoryFile, ingest


def is_first_moment(piece: str) -> bool:
    """Whether a piece is an AdamW first moment (``optim.state.<fqn>.exp_avg@<offsets>``)."""
    found = member(piece)
    return found is not None and found.role == FIRST


def store_pieces(staged: ObjectStore, source: MemoryFile, chunk_size: int,
                 first_moments: ObjectStore | None = None) -> tuple[FileEntry, int]:
    """Store one rank's file, new chunks the fast way; its manifest entry and the bytes added.

    ``first_moments``: a second batch for the first moments' chunks, in a pack of their own.
    It was made when a step's own compaction settled its first moments whole (one pack of all
    three then had its weights and second moments copied out loose: ~2 CPU s a step of the DCP
    benchmark); the next step's compaction now replaces all three (deltas, the first moments
    whole where no delta pays), and the split only costs one more pack (merged once 8 gather).
    """
    def store_for(tensor: str) -> ObjectStore:
        return first_moments if first_moments is not None and is_first_moment(tensor) else staged

    files, added = ingest(staged, [source], chunk_size, fast=True, store_for=store_for)
    return files[0], added


def wait_compaction() -> None:
    """Wait until this process's compactions after DCP saves have finished (a benchmark or a test
    that measures stored bytes calls it; on the coordinator rank only is there anything to wait
    for)."""
    wait_all()
