"""Which commits were left at rest: every chunk of the commit and of its parent in its best
encoding (the parent's as deltas against it where they pay, the commit's own whole).

A compaction that finished its tip pair and settled the tip's chunks (tip.py), or a repack
(which re-plans every kept commit), records the tip here; ``ckstore status`` says "at rest" when
the branch's tip is recorded and no compaction runs or waits. A cache (docs/format.md 3,
``cache/at-rest``): an object id names its bytes and encodings only ever get smaller, so a record
stays true; a missing or unreadable one only makes status say "not yet at rest" until the next
compaction or repack. Written without a barrier; holds the most recent ``KEPT`` ids.
"""

from __future__ import annotations

from collections.abc import Iterable

from ckstore.backend.base import Backend
from ckstore.errors import CkstoreError
from ckstore.format.ids import is_object_id

KEY = "cache/at-rest"
KEPT = 64  # a status asks about one tip; several branches compact in turn


def _recorded(backend: Backend) -> list[str]:
    try:
        text = backend.get(KEY).decode("ascii")
    except (KeyError, CkstoreError, OSError, UnicodeDecodeError):
        return []
    return [line for line in text.splitlines() if is_object_id(line)]


def is_at_rest(backend: Backend, commit_id: str) -> bool:
    return commit_id in _recorded(backend)


def record_at_rest(backend: Backend, commit_ids: Iterable[str]) -> None:
    """Record ``commit_ids`` as at rest. The caller holds the compaction lock or the exclusive
    repository lock, so no other writer races this read-modify-write."""
    new = list(dict.fromkeys(commit_ids))
    if not new:
        return
    fresh = set(new)
    ids = ([i for i in _recorded(backend) if i not in fresh] + new)[-KEPT:]
    try:
        backend.replace(KEY, ("\n".join(ids) + "\n").encode("ascii"))
    except (CkstoreError, OSError):
        pass  # a cache: status says "not yet at rest" until the next run records it
