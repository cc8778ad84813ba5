"""Compaction: after a commit is durable, its parent's chunks become deltas against its own.

A commit on the training loop's critical path only hashes, compresses fast and writes
(``ObjectStore.put_chunk(fast=True)``). The expensive part of storing a rolling checkpoint —
decoding the parent's chunks, encoding them as deltas against the new ones, checking every delta
decodes back — runs afterwards, off that path (on a background thread, or for the CLI in a
detached process: background.py, detached.py), the way git turns loose objects into packs
later. For each chunk position of the branch tip (paired with its parent's chunk by
``positions.ChunkIndex``: by position, else by tensor name):

1. the parent's chunk, when whole and different, is replaced by a delta against the tip's chunk
   if that is smaller (a reverse delta: the newest commit stays whole and cheap to read) and the
   chain below it leaves room for one more link (``max_delta_depth``); for a DCP parameter's
   weight or ``exp_avg_sq`` piece (optstate.py), by a predicted delta from the tip's weight and
   moments (and the parent's ``exp_avg``) when that is smaller still (codecs/predict.py);
2. a chunk stored provisionally by a fast commit is replaced by its best whole encoding (byte
   grouping): the parent's when no delta replaced it; the tip's when the parent has it too, or
   when the parent's chunk at its position took no delta (an AdamW first moment, mostly: the
   next run would find the same). The tip's other new chunks stay as the commit stored them:
   the next commit's compaction turns most of them into deltas, so encoding them whole first
   was half of every run's CPU for nothing. Only the newest commit holds fast-encoded chunks
   (more stored bytes until the next commit, or ``repack``), and each chunk is re-encoded once.

Every replacement is decoded and re-hashed before it is staged, and all of a run's replacements
are applied together after one durability barrier (``ObjectStore.batch``); an interrupted run
leaves each object in its old or its new encoding, both of which decode to the same bytes, so
every commit stays readable and the next run redoes what is left. A base is a whole object
when the run starts, and every new link leads to a whole object within two steps when it ends
(``_Roles``: only a predicted delta may name a base that the run turns into a plain delta), and
one compaction runs at a time per repository (``Backend.compaction_lock``), so deltas can never
form a cycle: docs/format.md sections 4 and 8, docs/design.md "Chains".

Each run also covers the pair below (the parent against the grandparent): work that a killed
process left undone is picked up by the next commit's compaction. The pair below settles only
the parent's chunks that the tip's pair does not reach (a tensor the tip dropped).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ckstore.codecs.objects import (
    EXHAUSTIVE_MAX,
    Encoding,
    Kind,
    ObjectHeader,
    delta_bases,
    encode_chunk,
    encode_delta,
    encode_predicted,
    decode_view,
    parse_header,
    predicted_parts,
)
from ckstore.format.settings import PREDICTED_VERSION, version_for
from ckstore.format.tensor_stats import difference_sums, item_size
from ckstore.repository.change_record import Sums, TensorKey, comparable, write_changes
from ckstore.repository.context import RepoContext
from ckstore.errors import CkstoreError, IntegrityError
from ckstore.format.ids import ObjectId
from ckstore.format.manifest import Commit
from ckstore.format.optstate import FIRST, SECOND, WEIGHT, float32_members
from ckstore.write.compacted_pairs import is_finished, record_finished
from ckstore.write.settled_raw import record_settled_raw, settled_raw
from ckstore.write.pipeline import ordered_map
from ckstore.format.positions import HEADER, ChunkIndex, Position, Slot, chunk_at, slots
from ckstore.repository.refs import HEADS
from ckstore.repository.store import ObjectStore
from ckstore.repository.writing import writing

# codecs/predict.py needs numpy: imported where used, so commands that compact nothing start without it.
if TYPE_CHECKING:
    import numpy as np

    from ckstore.codecs.predict import Predictor

# How long a compaction waits for another process's to finish before leaving the work to the
# next one (nothing is lost by skipping: the objects are only less compressed until then).
COMPACTION_LOCK_TIMEOUT = 60.0
# Compaction runs beside training, which needs the cores for data loading and its own steps: at
# most half of them, each thread at this much lower priority (Linux nice values are per thread).
COMPACTION_WORKERS = max(1, min(4, (os.cpu_count() or 1) // 2))
COMPACTION_NICENESS = 10
# A position where a delta was refused (the parent's chunk and its own parent's both settled
# whole) is not decoded and tried again, except one chunk in this many (by name), so that deltas
# that begin to pay there later in training are still found.
REFUSED_RETRY_ONE_IN = 8
# What a fast commit stores (``ObjectStore.put_chunk(fast=True)``); any other whole encoding was
# chosen by compaction or repack. Raw is also some chunks' best encoding: a run records those it
# found (settled_raw.py), and later runs count them as settled.
_FAST = frozenset({Encoding.RAW, Encoding.ZSTD})


def _yield_to_training() -> None:
    """Pool initializer: lower this thread's priority (Linux only; elsewhere the call would
    renice the whole process, or fail)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + COMPACTION_NICENESS))
    except OSError:
        pass  # a sandbox that forbids it: compaction still runs, only at normal priority


@dataclass
class CompactReport:
    deltas: int = 0  # parent chunks now stored as deltas against the tip's (predicted ones included)
    predicted: int = 0  # of those, predicted deltas (codec encoding 4)
    recompressed: int = 0  # provisional chunks now in their best whole encoding
    saved: int = 0  # stored bytes freed


@dataclass(frozen=True)
class _Prediction:
    """A parent chunk to try as a predicted delta: ``bases`` in the predictor's order; ``whole``
    are the child's chunks (whole through the run), ``moment`` the parent's first moment (whole
    when the run starts, at most a plain delta against the child's when it ends) or None."""
    predictor: Predictor
    bases: tuple[ObjectId, ...]
    whole: tuple[ObjectId, ...]
    moment: ObjectId | None


@dataclass(frozen=True)
class _Job:
    slot: Slot  # the child's chunk
    parent: ObjectId | None  # the parent's chunk at the same position, if a delta candidate
    # For each older commit in view (newest first), the chunks at this position and, for a
    # parameter's piece, at its siblings' (weight, moments): what may depend on the parent's chunk.
    older: tuple[tuple[ObjectId | None, ...], ...]
    history_ends: bool  # ``older`` reaches the branch's first commit
    grandparent: ObjectId | None = None  # ``older``'s first commit's chunk at this very position
    prediction: _Prediction | None = None
    tip: bool = True  # the child is the branch tip (not the pair below it)
    # The tensor's dtype when the parent has it at the same path and name (its change is recorded).
    dtype: str | None = None
    settle: bool = False  # re-encode the child's chunk in its best whole encoding if stored fast


class _Roles:
    """What a run has decided about each object, so that within one run new bases only ever lead
    to whole objects (staged replacements are invisible to reads until the run ends): that is
    what keeps chains acyclic and as long as their headers say.

    Roles: "base" stays whole through the run; "delta" may become a plain delta against a "base";
    "moment" (a predicted delta's base from the parent) may become a plain delta but is nobody's
    plain-delta base; "predicted" may become a predicted delta whose bases are "base", "delta" or
    "moment" objects, and is nobody's base. So every new link goes predicted -> {moment, delta,
    base} or {moment, delta} -> base, and a chain of new links ends in a whole object within two.
    """

    def __init__(self, keep_whole: Iterable[str] = ()) -> None:
        self._role: dict[str, str] = dict.fromkeys(keep_whole, "base")
        self._recompressed: set[str] = set()
        self._lock = threading.Lock()

    def pair(self, delta: str, base: str) -> bool:
        """Claim ``delta`` to be re-encoded against ``base``, unless either was claimed otherwise."""
        with self._lock:
            if self._role.get(delta, "moment") != "moment" or self._role.get(base, "base") != "base":
                return False
            self._role[delta] = "delta"
            self._role[base] = "base"
            return True

    def predict(self, target: str, whole: Sequence[str], moment: str | None) -> bool:
        """Claim ``target`` to be re-encoded from ``whole`` and ``moment`` (see the class)."""
        with self._lock:
            if target in self._role or any(self._role.get(b, "base") != "base" for b in whole):
                return False
            if moment is not None and self._role.get(moment) == "predicted":
                return False
            self._role[target] = "predicted"
            self._role.update(dict.fromkeys(whole, "base"))
            if moment is not None:
                self._role.setdefault(moment, "moment")
            return True

    def recompress(self, oid: str) -> bool:
        with self._lock:
            if oid in self._recompressed or self._role.get(oid) in ("delta", "predicted"):
                return False
            self._recompressed.add(oid)
            return True


def compact_branch(ctx: RepoContext, branch: str, lock_timeout: float = COMPACTION_LOCK_TIMEOUT,
                   on_locked: Callable[[], object] | None = None) -> CompactReport:
    """Compact the tip of ``branch`` against its parent, and the parent against its parent.
    ``on_locked`` is called once the compaction lock is held (a detached run leaves its place in
    line then: detached.py)."""
    report = CompactReport()
    depth = ctx.config.encoding.max_delta_depth
    with ctx.backend.compaction_lock(lock_timeout), writing(ctx):
        if on_locked is not None:
            on_locked()
        tip = ctx.refs.read(HEADS + branch)
        window = depth + 3
        commits = ctx.graph.first_parents(tip, window)
        if not commits:
            return report
        # The pair below first, each pair in its own batch: the tip's pair then reads the
        # chains as the first one left them. A chunk the tip or the child uses never becomes a
        # delta (the tip reads whole; a chunk can sit at several positions or come back).
        upgrade = _Upgrade(ctx)
        pairs = [_plan_pair(commits[i], commits[i + 1:], depth, history_ends=len(commits) < window,
                            upgrade=upgrade, tip=i == 0) for i in range(min(2, len(commits)))]
        # Which chunks settle into their best whole encoding (see the module docstring): at the
        # tip, those it shares with its parent; below it, the child's chunks that the tip's pair
        # does not reach (a tensor the tip dropped), so a provisional chunk is re-encoded once.
        parent_chunks = {c.id for c in commits[1].all_chunks()} if len(commits) > 1 else set()
        tip_reaches = {j.slot.id for j in pairs[0]} | {j.parent for j in pairs[0] if j.parent is not None}
        pairs[0] = [replace(j, settle=j.slot.id in parent_chunks) for j in pairs[0]]
        if len(pairs) > 1:
            pairs[1] = [replace(j, settle=j.slot.id not in tip_reaches) for j in pairs[1]]
        # A pair an earlier run finished is not visited again (compacted_pairs.py): the pair
        # below keeps only the chunks that it alone settles; the tip pair, compacted twice, none.
        ids = [tip] + [c.parents[0] for c in commits[:2] if c.parents]
        for i in range(len(pairs)):
            if i + 1 < len(ids) and is_finished(ctx.backend, ids[i], ids[i + 1]):
                pairs[i] = [j for j in pairs[i] if j.settle] if i else []
        pool = ThreadPoolExecutor(COMPACTION_WORKERS, thread_name_prefix="ckstore-compact", initializer=_yield_to_training)
        sums: dict[tuple[str, str], Sums] = {}  # (child's chunk, parent's): the tip pair's decoded ones
        known_raw, found_raw = settled_raw(ctx.backend, ctx.store.settings), set[str]()
        with pool:
            for i in reversed(range(len(pairs))):
                newer = {c.id for commit in commits[:i + 1] for c in commit.all_chunks()}
                with ctx.store.batch() as staged:
                    _run_pair(_HeaderCache(staged, known_raw, found_raw), pairs[i], depth, _Roles(newer), report, upgrade, pool, sums)
        record_settled_raw(ctx.backend, ctx.store.settings, found_raw)  # as record_finished: after the batches
        if len(commits) > 1:
            record_finished(ctx.backend, tip, commits[0].parents[0])  # its replacements are durable
            # The relative change against the parent, from the chunks decoded above (format.md 5.2).
            write_changes(ctx.backend, tip, commits[0], commits[0].parents[0], commits[1],
                          _tensor_sums(commits[0], commits[1], sums))
        # The commit's pack (if it wrote one) is settled here, off the training loop's path: its
        # large objects spread into loose files, its small ones kept packed (backend/local_settle.py).
        ctx.backend.unpack()
    return report


class _HeaderCache(ObjectStore):
    """A pair's batch view of the store that reads each object's header once: a position's
    chunks are asked for theirs up to four times (is it whole, did the last run make a delta
    here, how long is the chain above), half of a run's reads. Within a batch an object's header
    cannot change: replacements are applied when the batch ends, and the compaction lock keeps
    every other writer of existing objects out (new objects never change either)."""

    def __init__(self, staged: ObjectStore, settled_raw: set[str] | None = None, found_raw: set[str] | None = None) -> None:
        super().__init__(staged.backend, settings=staged.settings)
        self.alternates = staged.alternates
        self._headers: dict[str, bytes | None] = {}
        self.settled_raw = settled_raw if settled_raw is not None else set()  # settled_raw.py: read when the run starts
        self.found_raw = found_raw if found_raw is not None else set()  # this run's, recorded when it ends

    def provisional(self, oid: str, encoding: Encoding, width: int) -> bool:
        """``is_provisional``, except a raw chunk that an earlier full search left raw: it is
        settled (settled_raw.py)."""
        return self.is_provisional(encoding, width) and not (encoding == Encoding.RAW and oid in self.settled_raw)

    def searched(self, oid: str, best: bytes) -> None:
        """Note the outcome of a full search for ``oid``'s best whole encoding: raw is recorded."""
        if parse_header(best).encoding == Encoding.RAW:
            self.found_raw.add(oid)  # one set.add: atomic under the GIL, the pool's threads share it

    def header_local(self, oid: str) -> bytes | None:
        if oid not in self._headers:
            self._headers[oid] = super().header_local(oid)  # a race only reads it twice
        return self._headers[oid]

    def bases_of(self, oid: str) -> tuple[ObjectId, ...]:
        prefix = self.header_local(oid)
        if prefix is None:
            return super().bases_of(oid)  # a base repository's object, or a missing one (raises)
        try:
            return tuple(ObjectId(b) for b in delta_bases(prefix))
        except IntegrityError as exc:
            raise IntegrityError(f"object {oid} is corrupt: {exc}") from None


class _Upgrade:
    """Whether predicted (or context-sorted) deltas may be written, upgrading a version 2 or newer
    repository to the version that allows them (config.json, durable) before the first one is
    staged (docs/format.md, compatibility)."""

    def __init__(self, ctx: RepoContext) -> None:
        self.ctx = ctx

    def possible(self) -> bool:
        return self.ctx.config.version >= 2 and self.ctx.store.settings.max_delta_depth > 0

    def __call__(self, version: int = PREDICTED_VERSION) -> bool:
        return self.ctx.upgrade(version)


def _plan_pair(child: Commit, older: Sequence[Commit], depth: int, history_ends: bool, upgrade: _Upgrade,
               tip: bool) -> list[_Job]:
    """One job per chunk position of ``child``, paired with ``older[0]``'s chunk there."""
    # An overlay's chunks are forward deltas against its base's: nothing of it is re-encoded.
    if child.base is not None:
        return []
    new_files = {f.path: [t.name for t in f.tensors] for f in child.files if f.kind == "safetensors"}
    indexes = [ChunkIndex(c.files, new_files) for c in older[:depth + 1]] if depth else []
    child_slots = slots(child.files)
    found: dict[tuple[Position, int], list[ObjectId | None]] = {
        where: [chunk_at(ix, where[0], where[1], slot.size) for ix in indexes] for where, slot in child_slots.items()}
    siblings = _siblings(child, child_slots) if indexes and upgrade.possible() else {}
    recorded: dict[Position, str] = {k: new.dtype for k, (new, _) in comparable(child, older[0]).items()} if tip and older else {}
    jobs = []
    for where, slot in child_slots.items():
        parent = found[where][0] if found[where] and where[0][1] != HEADER else None
        group = siblings.get(where, {"": where})
        older_ids = tuple(tuple(found[p][k] for p in group.values()) for k in range(1, len(found[where])))
        grandparent = found[where][1] if len(found[where]) > 1 else None
        job = _Job(slot, parent if parent != slot.id else None, older_ids, history_ends, grandparent, tip=tip,
                   dtype=recorded.get(where[0]))
        if job.parent is not None and where in siblings:
            job = replace(job, prediction=_prediction(job.parent, group, child_slots, found))
        jobs.append(job)
    return jobs


def _run_pair(store: _HeaderCache, jobs: list[_Job], depth: int, roles: _Roles, report: CompactReport,
              upgrade: _Upgrade, pool: ThreadPoolExecutor, sums: dict[tuple[str, str], Sums]) -> None:
    # The coefficients that fitted the last chunk of this pair, per predictor, and how much of its
    # sample they predicted exactly: one optimizer step, so the next chunk usually takes them as
    # they are (predict.fit_scored's hint).
    fits: dict[object, tuple[tuple[float, ...], float]] = {}

    def run(job: _Job) -> tuple[int, int, int, int]:
        return _compact_chunk(store, job, depth, roles, upgrade, fits, sums)

    for delta, predicted, recompressed, saved in ordered_map(run, jobs, workers=COMPACTION_WORKERS, pool=pool):
        report.deltas += delta
        report.predicted += predicted
        report.recompressed += recompressed
        report.saved += saved


def _siblings(child: Commit, child_slots: dict[tuple[Position, int], Slot]) -> dict[tuple[Position, int], dict[str, tuple[Position, int]]]:
    """For each chunk of a parameter's float32 piece (optstate.py): its own and its siblings'
    places, by role, when the three pieces are cut into chunks of equal sizes."""
    out: dict[tuple[Position, int], dict[str, tuple[Position, int]]] = {}
    for roles in float32_members(child.files).values():
        index = 0
        while all(((p, index) in child_slots) for p in roles.values()):
            group = {role: (p, index) for role, p in roles.items()}
            if len({child_slots[w].size for w in group.values()}) == 1:
                out.update(dict.fromkeys(group.values(), group))
            index += 1
    return out


def _prediction(
    target: ObjectId, group: dict[str, tuple[Position, int]], child_slots: dict[tuple[Position, int], Slot],
    found: dict[tuple[Position, int], list[ObjectId | None]],
) -> _Prediction | None:
    """How to predict the parent's chunk ``target`` from its siblings (None: a first moment, or a
    sibling the parent lacks)."""
    from ckstore.codecs.predict import Predictor

    m, v = (child_slots[group[r]].id for r in (FIRST, SECOND))
    w = child_slots[group[WEIGHT]].id if WEIGHT in group else None
    if target in (w, m, v):
        return None
    if w is not None and found[group[WEIGHT]][0] == target:
        return _Prediction(Predictor.ADAM_WEIGHT, (w, m, v), (w, m, v), None)
    moment = found[group[FIRST]][0]
    if found[group[SECOND]][0] != target or moment is None or moment == target:
        return None
    return _Prediction(Predictor.ADAM_SECOND_MOMENT, (v, m, moment), (v, m), moment)


def _compact_chunk(store: _HeaderCache, job: _Job, depth: int, roles: _Roles, upgrade: _Upgrade,
                   fits: dict[object, tuple[tuple[float, ...], float]], sums: dict[tuple[str, str], Sums]) -> tuple[int, int, int, int]:
    """Re-encode one position's parent chunk and the child's own; (deltas, predicted, recompressed,
    saved)."""
    slot = job.slot
    try:
        child_prefix = store.header_local(slot.id)
        if child_prefix is None:
            return 0, 0, 0, 0  # a base repository's object (overlay): never ours to change
        child_header = parse_header(child_prefix)
        child_whole = not delta_bases(child_prefix)
        if not child_whole:
            # A chunk of the tip that came back (a tensor reverted to an older value) and had
            # become a delta: the tip reads it whole again, which also cuts the chains through it.
            # Below the tip a delta is what the last run made (against the tip's chunk): undoing
            # it would only have this run's tip pair redo it.
            if not job.tip or not roles.recompress(slot.id):
                return 0, 0, 0, 0
            raw = store.get_chunk(slot.id, slot.size)
            return 0, 0, 1, _recompress(store, slot.id, raw, slot.width, even_if_larger=True)
        parent_header = _whole_header(store, job.parent, slot.size) if job.parent is not None else None
        if parent_header is None:
            # Already a delta (an earlier run, another branch, the same state saved again) or
            # not this repository's: nothing to do for it, decided from its header alone.
            job = replace(job, parent=None, prediction=None)
        refused = parent_header is not None and job.prediction is None and _refused_before(store, job, parent_header.encoding)
        if refused:
            job = replace(job, parent=None)
        prediction = job.prediction if job.prediction is not None and _claim_prediction(store, job.parent, job.prediction, roles) else None
        parent = job.parent if prediction is not None or (job.parent is not None and roles.pair(job.parent, slot.id)) else None
        # A refused position's tip chunk settles now, as it would have after trying (below).
        settle = job.settle or (refused and job.tip)
        provisional = settle and store.provisional(slot.id, child_header.encoding, slot.width) and roles.recompress(slot.id)
        if not provisional and parent is None:
            return 0, 0, 0, 0
        raw = store.get_chunk(slot.id, slot.size)  # decoded and verified: the base of any delta
        deltas = predicted = recompressed = saved = 0
        if parent is not None:
            made, freed = _reverse_delta(store, parent, job, raw, depth, prediction, upgrade, fits, sums)
            deltas, saved = deltas + (made in ("delta", "predicted")), saved + freed
            recompressed += made.startswith("whole") and freed > 0
            predicted += made == "predicted"
            # No delta paid here (an AdamW first moment, mostly): the next run would most likely
            # find the same and settle the child's chunk then, so it is settled now, from the
            # bytes in hand, and the newest commit is not left fast where it would stay whole.
            if made == "whole, refused" and not provisional and job.tip:
                provisional = store.provisional(slot.id, child_header.encoding, slot.width) and roles.recompress(slot.id)
        if provisional:
            freed = _recompress(store, slot.id, raw, slot.width)
            recompressed, saved = recompressed + (freed > 0), saved + freed
        return deltas, predicted, recompressed, saved
    except CkstoreError:
        return 0, 0, 0, 0  # a damaged or missing chunk only costs compression; fsck reports it


def _tensor_sums(child: Commit, parent: Commit, sums: dict[tuple[str, str], Sums]) -> dict[TensorKey, Sums]:
    """Per tensor at the same path and name in both commits, (‖new − old‖², ‖old‖²) added up in
    chunk order from ``sums`` (as magnitude.tensor_sums adds them), when every chunk pair is
    there: a chunk both share, or a pair this run did not decode, leaves the tensor to readers."""
    out: dict[TensorKey, Sums] = {}
    for key, (new, old) in comparable(child, parent).items():
        if len(new.chunks) != len(old.chunks):
            continue  # cut differently (another chunk size): readers pair them element by element
        diff_sq = base_sq = 0.0
        for c, p in zip(new.chunks, old.chunks):
            found = sums.get((c.id, p.id)) if c.size == p.size else None
            if found is None:
                break
            diff_sq += found[0]
            base_sq += found[1]
        else:
            out[key] = (diff_sq, base_sq)
    return out


def _whole_header(store: ObjectStore, oid: ObjectId, size: int) -> ObjectHeader | None:
    """The header of ``oid`` when it is a whole chunk object of ``size`` bytes in this repository."""
    prefix = store.header_local(oid)
    if prefix is None or delta_bases(prefix):
        return None
    header = parse_header(prefix)
    return header if header.kind == Kind.CHUNK and header.raw_len == size else None


def _paid_before(store: ObjectStore, oid: ObjectId, job: _Job) -> bool:
    """Whether the last run made a delta at this position: the chunk below ``oid`` there is a
    delta of it (the same kind of tensor, one step further: its delta most likely pays too)."""
    try:
        return job.grandparent is not None and oid in store.bases_of(job.grandparent)
    except CkstoreError:
        return False


def _retry_refused(oid: str) -> bool:
    """Whether a refused position's parent chunk is tried again this time (see REFUSED_RETRY_ONE_IN)."""
    return int(oid[:8], 16) % REFUSED_RETRY_ONE_IN == 0


def _refused_before(store: _HeaderCache, job: _Job, encoding: Encoding) -> bool:
    """Whether a delta of the parent's chunk was tried when it was the tip's, and refused: it
    settled whole then (only a refusal settles a tip's changed chunk, step 2 of the module
    docstring), and its own parent's chunk at this position is whole and settled as well. Then
    the same kind of tensor (an AdamW first moment, mostly) is most likely refused again: decoding
    it and sample-testing a delta was a fifth of every run's CPU (docs/benchmarks.md)."""
    older = job.grandparent
    if older is None or older == job.parent or _retry_refused(job.parent or ""):
        return False
    if not _settled(store, job.parent or "", encoding):
        return False
    header = _whole_header(store, older, job.slot.size)
    return header is not None and _settled(store, older, header.encoding)


def _settled(store: _HeaderCache, oid: str, encoding: Encoding) -> bool:
    """Whether a whole chunk's encoding was chosen by compaction or repack (not a fast commit's,
    or raw as a full search left it: settled_raw.py)."""
    return encoding not in _FAST or (encoding == Encoding.RAW and oid in store.settled_raw)


def _claim_prediction(store: ObjectStore, target: ObjectId | None, p: _Prediction, roles: _Roles) -> bool:
    """Claim ``target`` for a predicted delta when every base is this repository's and whole now."""
    if target is None:
        return False
    for base in p.bases:
        prefix = store.header_local(base)
        if prefix is None or delta_bases(prefix):
            return False
    return roles.predict(target, p.whole, p.moment)


def _reverse_delta(
    store: _HeaderCache, oid: ObjectId, job: _Job, base_raw: bytes, depth: int, prediction: _Prediction | None,
    upgrade: _Upgrade, fits: dict[object, tuple[tuple[float, ...], float]], sums: dict[tuple[str, str], Sums],
) -> tuple[str, int]:
    """Replace the parent's chunk ``oid`` by a delta against the child's, or a predicted delta (or,
    when it was stored provisionally and no delta pays, by its best whole encoding); (what was
    made, bytes freed)."""
    current = store.read_local(oid)
    if current is None:
        return "", 0
    header = parse_header(current)
    if header.kind != Kind.CHUNK or header.encoding in (Encoding.DELTA, Encoding.PREDICTED, Encoding.CONTEXT) or header.raw_len != job.slot.size:
        return "", 0
    settings = store.settings
    raw = bytes(store.reader().chunk(oid, job.slot.size, "", current))  # whole: no base read
    if job.dtype is not None and len(raw) % item_size(job.dtype) == 0:
        sums[(job.slot.id, oid)] = difference_sums(raw, base_raw, job.dtype)  # both bytes in hand
    # A delta must beat the chunk's best whole encoding. A fast-stored chunk longer than
    # EXHAUSTIVE_MAX gets that encoding only when no delta replaces it (most are replaced):
    # encode_delta weighs the delta against it on a sample first (fp32 MiniLM: every delta
    # taken that way was at most 0.90 of whole, every one refused at least 0.995). A shorter
    # chunk skips that test, and is cheap to encode whole.
    provisional = store.provisional(oid, header.encoding, job.slot.width)
    best = current
    if provisional and len(raw) <= EXHAUSTIVE_MAX:
        searched = encode_chunk(raw, settings.zstd_level, job.slot.width, allowed=settings.allowed)
        store.searched(oid, searched)
        best = min(current, searched, key=len)
    than = len(best)
    height = _height(store, oid, job, depth) if depth and Encoding.DELTA in settings.allowed else depth
    # A predicted delta's chain: 1 + its deepest base, the parent's first moment (a plain delta
    # of the child's at most, 1) or the child's chunks (whole, 0).
    predicted = None
    if prediction is not None and height + 1 + (prediction.moment is not None) <= depth:
        predicted = _predicted(store, oid, raw, prediction, job.slot.size, than, fits, {job.slot.id: base_raw})
    if height + 1 <= depth:
        # Kept only when smaller than the predicted delta (when there is one: then it is weighed
        # on a sample first, as it lost at all 408 predicted positions of a DCP benchmark step).
        data = encode_delta(raw, settings.zstd_level, job.slot.width, job.slot.id, base_raw,
                            len(predicted) if predicted is not None else than, settings.allowed_in_compaction,
                            sample_test=predicted is not None or not _paid_before(store, oid, job))
        if data is not None and upgrade(version_for(parse_header(data).encoding)):
            _check(oid, data, raw, {job.slot.id: base_raw})
            store.stage_replace(oid, data)
            return "delta", len(current) - len(data)
    if predicted is not None and upgrade():
        store.stage_replace(oid, predicted)
        return "predicted", len(current) - len(predicted)
    # "whole, refused": a delta was tried and did not pay (not a full chain keeping it whole).
    whole = "whole, refused" if height + 1 <= depth else "whole"
    if best is not current:
        _check(oid, best, raw)
        store.stage_replace(oid, best)
        return whole, len(current) - len(best)
    if provisional and len(raw) > EXHAUSTIVE_MAX:
        freed = _recompress(store, oid, raw, job.slot.width, current=current)
        return whole, freed
    return (whole if height + 1 <= depth else ""), 0


def _predicted(store: ObjectStore, oid: ObjectId, raw: bytes, p: _Prediction, size: int, than: int,
               fits: dict[object, tuple[tuple[float, ...], float]], known: dict[str, bytes]) -> bytes | None:
    """The predicted delta of ``raw`` when it stores in fewer than ``than`` bytes, checked by
    decoding; None otherwise. ``known``: bases decoded already (the child's chunk here)."""
    from ckstore.codecs.predict import fit_scored, predict

    bases = {b: known[b] if b in known else store.get_chunk(b, size) for b in dict.fromkeys(p.bases)}
    found = fit_scored(p.predictor, raw, [bases[b] for b in p.bases], fits.get(p.predictor))
    if found is None:
        return None
    fits[p.predictor] = found
    coefficients = found[0]
    level = store.settings.zstd_level
    inputs = [bases[b] for b in p.bases]
    guess = predict(p.predictor, coefficients, inputs)  # computed once: to encode, and to check
    data = encode_predicted(raw, level, p.bases, inputs, p.predictor, coefficients, than, guess=guess)
    if data is not None:
        _check_predicted(oid, data, raw, p, coefficients, guess)
    return data


def _check_predicted(oid: str, data: bytes, raw: bytes, p: _Prediction, coefficients: tuple[float, ...],
                     guess: np.ndarray) -> None:
    """``_check`` for a predicted delta, with the prediction computed for encoding it: decoding
    ``data`` is its residual XOR ``predict`` of the predictor, coefficients and bases it names
    (objects.PredictedParts), and ``predict`` is a pure function of those (bit-reproducible by
    the format's rule, docs/format.md section 4). So when the parsed predictor, coefficients
    (bit for bit) and base ids are the ones ``guess`` was computed from, with the same verified
    base bytes, the decode would compute ``guess`` again: residual XOR ``guess`` is what it
    decodes to, compared with the chunk's bytes here. Every other step of the decode (header,
    names, coefficient range, the residual's planes) runs on the stored bytes as a reader's does."""
    import numpy as np

    try:
        parts = predicted_parts(data, len(raw))
    except IntegrityError as exc:
        raise IntegrityError(f"object {oid} (re-encoded) is corrupt: {exc}") from None
    if not parts.same_prediction(p.bases, p.predictor, coefficients):
        raise IntegrityError(f"object {oid} (re-encoded) names another prediction than it was encoded with")
    decoded = np.bitwise_xor(parts.residual.view("<u4"), guess)
    if not np.array_equal(decoded, np.frombuffer(raw, dtype="<u4")):
        raise IntegrityError(f"object {oid} (re-encoded) does not decode to its bytes")


def _height(store: ObjectStore, oid: ObjectId, job: _Job, depth: int) -> int:
    """How many delta links already hang above ``oid``: the longest chain of chunks of older
    commits in view (at this position or a sibling's) that leads to it, followed by their headers.
    A chain that reaches the oldest commit in view may go on further back (a chunk unchanged for
    some commits, or links beyond the view): then it counts as a full chain (``oid`` stays whole),
    unless the view reaches the branch's first commit."""
    above: dict[str, int] = {oid: 0}
    for k, ids in enumerate(job.older):
        present = [o for o in dict.fromkeys(ids) if o is not None]
        for _ in range(2):  # a sibling may depend on one of the same commit (v on m)
            for o in present:
                if o in above:
                    continue
                links = [above[b] + 1 for b in store.bases_of(o) if b in above]
                if links:
                    above[o] = max(links)
        if k == len(job.older) - 1 and not job.history_ends and any(o in above for o in present):
            return depth
    return max(above.values())


def _recompress(store: _HeaderCache, oid: ObjectId, raw: bytes, width: int, even_if_larger: bool = False,
                current: bytes | None = None) -> int:
    """Replace an object (``current``: its stored bytes, when read already) by its best whole
    encoding when smaller (``even_if_larger``: a delta made whole); bytes freed."""
    current = current if current is not None else store.read_local(oid)
    if current is None or bool(delta_bases(current)) != even_if_larger:
        return 0
    settings = store.settings
    best = encode_chunk(raw, settings.zstd_level, width, allowed=settings.allowed)
    store.searched(oid, best)
    if len(best) >= len(current) and not even_if_larger:
        return 0
    _check(oid, best, raw)
    store.stage_replace(oid, best)
    return len(current) - len(best)


def _check(oid: str, data: bytes, raw: bytes, bases: dict[str, bytes] | None = None) -> None:
    """Raise IntegrityError unless the new encoding ``data`` of ``oid`` decodes, its bases taken
    only from ``bases`` (verified bytes in memory), to ``raw``: the chunk's bytes, re-hashed
    against ``oid`` when they were read. Comparing with them proves what re-hashing the decoded
    bytes would, at about a third of blake3's CPU (0.09 against 0.34 ms per MiB)."""
    def fetch_base(wanted: str, length: int) -> bytes:
        if bases is None or wanted not in bases or length != len(bases[wanted]):
            raise IntegrityError(f"it names an unexpected base {wanted}")
        return bases[wanted]

    try:
        decoded = decode_view(data, Kind.CHUNK, len(raw), expected_len=len(raw), fetch_base=fetch_base)
    except IntegrityError as exc:
        raise IntegrityError(f"object {oid} (re-encoded) is corrupt: {exc}") from None
    if (decoded if isinstance(decoded, bytes) else decoded.tobytes()) != raw:
        raise IntegrityError(f"object {oid} (re-encoded) does not decode to its bytes")
