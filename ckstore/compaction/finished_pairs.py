"""Which commit pairs a compaction finished, so that the next one does not redo them.

Each compaction covers the tip against its parent and, so that work a killed process left undone
is picked up, the parent against its own parent (compact.py). When the earlier run finished, that
pair below is already done: revisiting it read a few headers per chunk position, a tenth of every
run's CPU (docs/benchmarks.md). A run that finishes its tip pair records (tip, parent) here; the
next run skips a recorded pair (except the chunks only it settles). A cache (docs/format.md 3,
``cache/compacted``): a missing, stale or unreadable record only costs the work being done again,
so it is written without a barrier, and a killed run records nothing.
"""

from __future__ import annotations

from ckstore.backend.base import Backend
from ckstore.errors import CkstoreError
from ckstore.format.ids import is_object_id

KEY = "cache/compacted"
# The most recent pairs kept (a run only asks about the two newest of its branch; several
# branches compact in turn).
KEPT = 64


def finished_pairs(backend: Backend) -> list[str]:
    """The recorded pairs, oldest first, as ``"<commit id> <parent id>"``."""
    try:
        text = backend.get(KEY).decode("ascii")
    except (KeyError, CkstoreError, OSError, UnicodeDecodeError):
        return []
    return [line for line in text.splitlines() if _well_formed(line)]


def is_finished(backend: Backend, commit_id: str, parent_id: str) -> bool:
    return f"{commit_id} {parent_id}" in finished_pairs(backend)


def record_finished(backend: Backend, commit_id: str, parent_id: str) -> None:
    """Record that the pair's compaction finished (its replacements are durable). The caller holds
    the compaction lock, so no other writer races this read-modify-write."""
    line = f"{commit_id} {parent_id}"
    pairs = [p for p in finished_pairs(backend) if p != line][-(KEPT - 1) :] + [line]
    try:
        backend.replace(KEY, ("\n".join(pairs) + "\n").encode("ascii"))
    except (CkstoreError, OSError):
        pass  # a cache: the next run does the pair again


def _well_formed(line: str) -> bool:
    parts = line.split(" ")
    return len(parts) == 2 and all(is_object_id(p) for p in parts)
