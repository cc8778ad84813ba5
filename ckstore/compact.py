"""Compaction: after a commit is durable, its parent's chunks become deltas against its own.

A commit on the training loop's critical path only hashes, compresses fast and writes
(``ObjectStore.put_chunk(fast=True)``). The expensive part of storing a rolling checkpoint —
decoding the parent's chunks, encoding them as deltas against the new ones, checking every delta
decodes back — runs afterwards, off that path (``Repo`` runs it on a background thread,
background.py), the way git turns loose objects into packs later. For each chunk position of the
branch tip (paired with its parent's chunk by ``positions.ChunkIndex``: by position, else by tensor
name):

1. the parent's chunk, when whole and different, is replaced by a delta against the tip's chunk
   if that is smaller (a reverse delta: the newest commit stays whole and cheap to read) and the
   chain below it leaves room for one more link (``max_delta_depth``);
2. a chunk stored provisionally by a fast commit (tip's or parent's, when no delta replaced it)
   is replaced by its best whole encoding (byte grouping).

Every replacement is decoded and re-hashed before it is staged, and all of a run's replacements
are applied together after one durability barrier (``ObjectStore.batch``); an interrupted run
leaves each object in its old or its new encoding, both of which decode to the same bytes, so
every commit stays readable and the next run redoes what is left. A base is only ever a whole
object, when the run starts and until it ends (``_Roles``), and one compaction runs at a time
per repository (``Backend.compaction_lock``), so deltas can never form a cycle: docs/format.md
section 8.

Each run also covers the pair below (the parent against the grandparent): work that a killed
process left undone is picked up by the next commit's compaction.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .codec import (
    Encoding,
    Kind,
    decode,
    delta_bases,
    encode_chunk,
    encode_delta,
    parse_header,
)
from .context import RepoContext
from .errors import CkstoreError, IntegrityError
from .ids import ObjectId, chunk_id
from .manifest import Commit
from .pipeline import ordered_map
from .positions import HEADER, ChunkIndex, Slot, chunk_at, slots
from .refs import HEADS
from .store import MAX_CHUNK_SIZE, ObjectStore

# How long a compaction waits for another process's to finish before leaving the work to the
# next one (nothing is lost by skipping: the objects are only less compressed until then).
COMPACTION_LOCK_TIMEOUT = 60.0


@dataclass
class CompactReport:
    deltas: int = 0  # parent chunks now stored as deltas against the tip's
    recompressed: int = 0  # provisional chunks now in their best whole encoding
    saved: int = 0  # stored bytes freed


@dataclass(frozen=True)
class _Job:
    slot: Slot  # the child's chunk
    parent: ObjectId | None  # the parent's chunk at the same position, if a delta candidate
    older: tuple[ObjectId | None, ...]  # the same position further back, newest first
    history_ends: bool  # ``older`` reaches the branch's first commit


class _Roles:
    """What a run has decided about each object, so that within one run a delta's base is never
    itself re-encoded as a delta (its staged replacement is invisible to reads until the run
    ends): that is what keeps chains acyclic and as long as their headers say."""

    def __init__(self, keep_whole: Iterable[str] = ()) -> None:
        self._role: dict[str, str] = dict.fromkeys(keep_whole, "base")
        self._recompressed: set[str] = set()
        self._lock = threading.Lock()

    def pair(self, delta: str, base: str) -> bool:
        """Claim ``delta`` to be re-encoded against ``base``, unless either was claimed otherwise."""
        with self._lock:
            if delta in self._role or self._role.get(base) == "delta":
                return False
            self._role[delta] = "delta"
            self._role[base] = "base"
            return True

    def recompress(self, oid: str) -> bool:
        with self._lock:
            if oid in self._recompressed or self._role.get(oid) == "delta":
                return False
            self._recompressed.add(oid)
            return True


def compact_branch(ctx: RepoContext, branch: str) -> CompactReport:
    """Compact the tip of ``branch`` against its parent, and the parent against its parent."""
    report = CompactReport()
    depth = ctx.config.encoding.max_delta_depth
    with ctx.backend.compaction_lock(COMPACTION_LOCK_TIMEOUT), ctx.backend.shared_lock():
        tip = ctx.refs.read(HEADS + branch)
        window = depth + 3
        commits = ctx.graph.first_parents(tip, window)
        if not commits:
            return report
        # The pair below first, each pair in its own batch: the tip's pair then reads the
        # chains as the first one left them. A chunk the tip or the child uses never becomes a
        # delta (the tip reads whole; a chunk can sit at several positions or come back).
        for i in reversed(range(min(2, len(commits)))):
            newer = {c.id for commit in commits[:i + 1] for c in commit.all_chunks()}
            with ctx.store.batch() as staged:
                _compact_pair(staged, commits[i], commits[i + 1:], depth, _Roles(newer), report,
                              history_ends=len(commits) < window)
    return report


def _compact_pair(
    store: ObjectStore, child: Commit, older: Sequence[Commit], depth: int, roles: _Roles, report: CompactReport,
    history_ends: bool,
) -> None:
    # An overlay's chunks are forward deltas against its base's: nothing of it is re-encoded.
    if child.base is not None:
        return
    new_files = {f.path: [t.name for t in f.tensors] for f in child.files if f.kind == "safetensors"}
    indexes = [ChunkIndex(c.files, new_files) for c in older[:depth + 1]] if depth else []
    jobs = []
    for (position, index), slot in slots(child.files).items():
        found: list[ObjectId | None] = [chunk_at(ix, position, index, slot.size) for ix in indexes]
        parent = found[0] if found and position[1] != HEADER else None
        jobs.append(_Job(slot, parent if parent != slot.id else None, tuple(found[1:]), history_ends))
    for delta, recompressed, saved in ordered_map(lambda job: _compact_chunk(store, job, depth, roles), jobs):
        report.deltas += delta
        report.recompressed += recompressed
        report.saved += saved


def _compact_chunk(store: ObjectStore, job: _Job, depth: int, roles: _Roles) -> tuple[int, int, int]:
    """Re-encode one position's parent chunk and the child's own; (deltas, recompressed, saved)."""
    slot = job.slot
    try:
        child_prefix = store.header_local(slot.id)
        if child_prefix is None:
            return 0, 0, 0  # a base repository's object (overlay): never ours to change
        child_header = parse_header(child_prefix)
        child_whole = not delta_bases(child_prefix)
        if not child_whole:
            # A chunk that came back (a tensor reverted to an older value) and had become a
            # delta: the newer commit reads it whole again, which also cuts the chains through it.
            if not roles.recompress(slot.id):
                return 0, 0, 0
            raw = store.get_chunk(slot.id, slot.size)
            return 0, 1, _recompress(store, slot.id, raw, slot.width, even_if_larger=True)
        parent = job.parent if child_whole and job.parent is not None and roles.pair(job.parent, slot.id) else None
        provisional = store.is_provisional(child_header.encoding, slot.width) and roles.recompress(slot.id)
        if not provisional and parent is None:
            return 0, 0, 0
        raw = store.get_chunk(slot.id, slot.size)  # decoded and verified: the base of any delta
        deltas = recompressed = saved = 0
        if parent is not None:
            made, freed = _reverse_delta(store, parent, job, raw, depth)
            deltas, recompressed, saved = deltas + (made == "delta"), recompressed + (made == "whole"), saved + freed
        if provisional:
            freed = _recompress(store, slot.id, raw, slot.width)
            recompressed, saved = recompressed + (freed > 0), saved + freed
        return deltas, recompressed, saved
    except CkstoreError:
        return 0, 0, 0  # a damaged or missing chunk only costs compression; fsck reports it


def _reverse_delta(store: ObjectStore, oid: ObjectId, job: _Job, base_raw: bytes, depth: int) -> tuple[str, int]:
    """Replace the parent's chunk ``oid`` by a delta against the child's (or, when it was stored
    provisionally and no delta pays, by its best whole encoding); (what was made, bytes freed)."""
    current = store.read_local(oid)
    if current is None:
        return "", 0
    header = parse_header(current)
    if header.kind != Kind.CHUNK or header.encoding in (Encoding.DELTA, Encoding.PREDICTED) or header.raw_len != job.slot.size:
        return "", 0
    settings = store.settings
    raw = decode(current, Kind.CHUNK, MAX_CHUNK_SIZE, expected_len=job.slot.size)  # whole: no base
    provisional = store.is_provisional(header.encoding, job.slot.width)
    best = encode_chunk(raw, settings.zstd_level, job.slot.width, allowed=settings.allowed) if provisional else current
    if depth and Encoding.DELTA in settings.allowed and _chain_below(store, oid, job, depth) + 1 <= depth:
        data = encode_delta(raw, settings.zstd_level, job.slot.width, job.slot.id, base_raw, len(best))
        if data is not None:
            _check_delta(oid, data, job.slot.size, job.slot.id, base_raw)
            store.stage_replace(oid, data)
            return "delta", len(current) - len(data)
    if len(best) < len(current):
        store.check_encoded(oid, best, job.slot.size)
        store.stage_replace(oid, best)
        return "whole", len(current) - len(best)
    return "", 0


def _chain_below(store: ObjectStore, oid: ObjectId, job: _Job, depth: int) -> int:
    """How many deltas already hang below ``oid`` (older commits' chunks at its position whose
    chain leads to it), followed by their headers. A chunk that stayed the same in older commits
    may have deltas below it further back than the commits in view: then it counts as a full
    chain (it stays whole), unless the view reaches the branch's first commit."""
    below, cur, skipped = 0, oid, False
    for older_id in job.older:
        if older_id == cur:
            skipped = True  # unchanged in that commit: look further back
            continue
        if older_id is None or cur not in store.bases_of(older_id):
            return below
        below, cur = below + 1, older_id
    return depth if skipped and not job.history_ends else below


def _recompress(store: ObjectStore, oid: ObjectId, raw: bytes, width: int, even_if_larger: bool = False) -> int:
    """Replace an object by its best whole encoding when smaller (``even_if_larger``: a delta
    made whole); bytes freed."""
    current = store.read_local(oid)
    if current is None or bool(delta_bases(current)) != even_if_larger:
        return 0
    settings = store.settings
    best = encode_chunk(raw, settings.zstd_level, width, allowed=settings.allowed)
    if len(best) >= len(current) and not even_if_larger:
        return 0
    store.check_encoded(oid, best, len(raw))
    store.stage_replace(oid, best)
    return len(current) - len(best)


def _check_delta(oid: str, data: bytes, size: int, base_id: str, base_raw: bytes) -> None:
    """Decode a new delta with its base from memory and re-hash it (the base's bytes were
    verified against its name when read)."""
    def fetch_base(wanted: str, length: int) -> bytes:
        if wanted != base_id or length != len(base_raw):
            raise IntegrityError(f"re-encoded object {oid} names an unexpected base {wanted}")
        return base_raw

    raw = decode(data, Kind.CHUNK, MAX_CHUNK_SIZE, expected_len=size, fetch_base=fetch_base)
    if chunk_id(raw) != oid:
        raise IntegrityError(f"object {oid} (re-encoded) does not decode to its bytes")
