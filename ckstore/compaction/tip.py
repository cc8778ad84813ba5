"""Settling the newest commit: once its compaction has made the parent's deltas, the tip's own
chunks leave the fast encoding a commit gave them for their best whole one, so that a run that
stops (the last epoch, then ``ckstore wait``) is stored at its best without a ``repack``.

A commit stores its chunks fast (plain zstd at a fast level, or raw: ``put_chunk(fast=True)``) to
return as soon as the epoch is durable; the fp32 MiniLM epochs stored that way are 18% larger than
their byte-grouped encoding, bf16 ones 28%. Until this step, only the next commit's compaction
settled them (or made them deltas), so the last commit of every run kept that cost for good.

The tip stays whole (a resume reads it): the best whole encoding is what encode_chunk picks
(byte planes, zstd at the repository's level), which reads back as fast as the fast one.

Which chunks go first: a tip chunk that some chunk of the parent is now a delta of sits where
deltas pay, so the next commit's compaction most likely makes it a delta too, and settling it
whole would be work thrown away one epoch later; every other chunk (where the parent's delta
was refused, a tensor the parent lacked) most likely stays whole, and the next compaction would
have to settle it anyway. So the likely-whole chunks are settled first, and ``defer_bases``
leaves the delta bases out: a detached compaction settles only those once the branch has been
quiet for ``QUIET_SECONDS``, and the rest only once the run looks over (detached.py).

The step yields to a newer commit: before each chunk it reads the branch's ref, and once the ref
has moved it stops, keeping what it has settled so far (each replacement is checked and staged as
compaction's are, and applied with the batch). The newer commit's compaction, waiting for the
compaction lock meanwhile, then makes most of those chunks deltas anyway. A tip whose chunks are
all settled, after a finished pair, is recorded at rest (at_rest.py), which ``ckstore status``
reports.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ckstore.codecs.objects import delta_bases, parse_header
from ckstore.compaction.encoding import HeaderCache, recompress_whole, small_position
from ckstore.errors import CkstoreError
from ckstore.format.ids import ObjectId
from ckstore.format.manifest import Commit
from ckstore.format.positions import Slot, slots
from ckstore.repository.context import RepoContext
from ckstore.repository.refs import HEADS
from ckstore.runtime.pipeline import ordered_map


class TipWatch:
    """Whether ``tip`` is still the branch's newest commit; once it is not, stays so (a ref read
    per question until then: a file of 65 bytes)."""

    def __init__(self, ctx: RepoContext, branch: str, tip: ObjectId) -> None:
        self._read: Callable[[], ObjectId | None] = lambda: ctx.refs.read(HEADS + branch)
        self._tip = tip
        self._moved = threading.Event()

    def still_tip(self) -> bool:
        if self._moved.is_set():
            return False
        try:
            if self._read() == self._tip:
                return True
        except CkstoreError:
            pass  # an unreadable ref: leave the rest to whoever fixes it
        self._moved.set()
        return False


def tip_slots(tip: Commit, chunk_size: int) -> list[Slot]:
    """The tip's chunks worth settling: multi-byte ones (a fast commit stores only those fast),
    each once, not the small positions compaction leaves as they are (encoding.SMALL_POSITION)."""
    small = small_position(chunk_size)
    found: dict[str, Slot] = {}
    for slot in slots(tip.files).values():
        if slot.width > 1 and slot.size >= small:
            found.setdefault(slot.id, slot)
    return list(found.values())


def _settle_one(store: HeaderCache, slot: Slot, watch: TipWatch) -> tuple[int, int]:
    """(re-encoded, bytes freed) for one tip chunk; nothing once the tip has moved."""
    if not watch.still_tip():
        return 0, 0
    try:
        prefix = store.header_local(slot.id)
        if prefix is None or delta_bases(prefix):
            return 0, 0  # a base repository's object, or a delta the tip pair left for a reason
        if not store.provisional(slot.id, parse_header(prefix).encoding, slot.width):
            return 0, 0
        freed = recompress_whole(store, slot.id, store.get_chunk(slot.id, slot.size), slot.width)
    except CkstoreError:
        return 0, 0  # a damaged chunk only costs compression; fsck reports it
    return int(freed > 0), freed


def delta_bases_among(store: HeaderCache, parent: Commit, chunk_size: int, ids: set[str]) -> set[str]:
    """Those of ``ids`` (the tip's chunks) that a chunk of ``parent`` is a delta of now; a header
    read per chunk of the parent that compaction re-encodes (the small ones it leaves), which
    then leaves the page cache, as compaction keeps the parent's chunks out of it."""
    small = small_position(chunk_size)
    found: set[str] = set()
    for oid in dict.fromkeys(c.id for c in parent.all_chunks() if c.size >= small):
        if oid in ids:
            continue  # the tip's own chunk: compaction never makes it a delta
        try:
            found.update(b for b in store.bases_of(oid) if b in ids)
        except CkstoreError:
            continue  # a damaged or missing chunk: it only changes the order
        store.forget_cached(oid)
    return found


def settle_tip(
    ctx: RepoContext,
    tip: Commit,
    watch: TipWatch,
    pool: ThreadPoolExecutor,
    workers: int,
    known_raw: set[str],
    found_raw: set[str],
    parent: Commit | None = None,
    defer_bases: bool = False,
) -> tuple[int, int, bool]:
    """Re-encode the tip's fast-stored chunks in their best whole encoding, until a newer commit
    arrives, those that ``parent``'s deltas are based on last (``defer_bases``: not at all);
    (chunks re-encoded, bytes freed, whether every chunk was reached)."""
    recompressed = saved = 0
    with ctx.store.batch() as staged:
        view = HeaderCache(staged, known_raw, found_raw)
        work = tip_slots(tip, ctx.config.chunk_size)
        bases = set[str]()
        if parent is not None:
            bases = delta_bases_among(view, parent, ctx.config.chunk_size, {s.id for s in work})
        first = [s for s in work if s.id not in bases]
        work = first if defer_bases else first + [s for s in work if s.id in bases]
        for done, freed in ordered_map(lambda s: _settle_one(view, s, watch), work, workers=workers, pool=pool):
            recompressed += done
            saved += freed
    return recompressed, saved, watch.still_tip() and not (defer_bases and bases)
