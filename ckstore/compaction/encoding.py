"""Compaction's work at one chunk position: the parent's chunk re-encoded as a reverse delta or
a predicted delta against the child's, provisional chunks in their best whole encoding, and the
check of every new encoding before it is staged (compact.py runs the positions of a pair,
pairing.py pairs them).

Every new encoding is decoded (a predicted delta with the prediction computed to encode it:
``_check_predicted``) and compared with the chunk's bytes, which were re-hashed against its name
when read; it is then staged (``ObjectStore.stage_replace``), applied when the pair's batch ends.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field, replace
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
    parse_header,
    predicted_decodes_to,
)
from ckstore.compaction.pairing import Job, Prediction, Roles, Upgrade
from ckstore.errors import CkstoreError, IntegrityError
from ckstore.format.ids import ObjectId
from ckstore.format.positions import Slot
from ckstore.format.settings import version_for
from ckstore.format.tensor_stats import difference_sums, item_size
from ckstore.repository.change_record import Sums
from ckstore.repository.reader import check_reencoded
from ckstore.repository.store import ObjectStore

# codecs/predict.py needs numpy: imported where used, so commands that compact nothing start without it.
if TYPE_CHECKING:
    import numpy as np

# A position where a delta was refused (the parent's chunk and its own parent's both settled
# whole) is not decoded and tried again, except one chunk in this many (by name), so that deltas
# that begin to pay there later in training are still found.
REFUSED_RETRY_ONE_IN = 8
# Verified chunk bytes a pair keeps from its last reads (HeaderCache.chunk_bytes): a parameter's
# pieces are compacted at adjacent positions, two at a time (the pool's workers).
RECENT_CHUNKS = 12
# What a fast commit stores (``ObjectStore.put_chunk(fast=True)``); any other whole encoding was
# chosen by compaction or repack. Raw is also some chunks' best encoding: a run records those it
# found (settled_raw.py), and later runs count them as settled.
_FAST = frozenset({Encoding.RAW, Encoding.ZSTD})
# A pair stops weighing the plain delta at a predictor's positions once it lost there this many
# times and never won (it lost at all 408 predicted positions of a DCP benchmark step, each
# weighed on a sample: 0.6-1.0 thread-s a step); one position in REFUSED_RETRY_ONE_IN (by name)
# still weighs it, so a plain delta that starts to win is found.
PLAIN_LOST_ENOUGH = 8
# Positions whose chunk is shorter than this, or than 1/16 of the chunk size, are not re-encoded:
# only their change is recorded. On fp32 MiniLM epochs (1 MiB chunks) 193 of 511 positions
# (biases, norms, tensors' tails) hold 0.16% of the bytes; deltas of them saved 0.1 MB of 663 and
# cost 0.12 CPU s of 1.2 (a loose file each, a pack rewritten).
SMALL_POSITION = 64 << 10


def small_position(chunk_size: int) -> int:
    """Chunks shorter than this are only recorded, not re-encoded (see SMALL_POSITION)."""
    return min(SMALL_POSITION, chunk_size // 16)


@dataclass
class PairMemory:
    """What one pair's positions learn from each other (they share one optimizer step)."""

    # Per predictor: the coefficients that fitted its last chunk and how much of that chunk's
    # sample they predicted exactly (predict.fit_scored's hint).
    fits: dict[object, tuple[tuple[float, ...], float]] = field(default_factory=dict)
    # Per predictor: positions where the plain delta lost to the predicted one; -1 once it won.
    plain_lost: dict[object, int] = field(default_factory=dict)

    def weigh_plain(self, predictor: object, oid: str) -> bool:
        """Whether to weigh the plain delta against a predicted delta of ``predictor`` for ``oid``."""
        lost = self.plain_lost.get(predictor, 0)
        return lost < PLAIN_LOST_ENOUGH or _retry_refused(oid)

    def plain_weighed(self, predictor: object, won: bool) -> None:
        lost = self.plain_lost.get(predictor, 0)  # a lost update between the pool's threads only delays the stop
        self.plain_lost[predictor] = -1 if won or lost < 0 else lost + 1


class HeaderCache(ObjectStore):
    """A pair's batch view of the store that reads each object's header once: a position's
    chunks are asked for theirs up to four times (is it whole, did the last run make a delta
    here, how long is the chain above), half of a run's reads. Within a batch an object's header
    cannot change: replacements are applied when the batch ends, and the compaction lock keeps
    every other writer of existing objects out (new objects never change either)."""

    def __init__(
        self,
        staged: ObjectStore,
        settled_raw: set[str] | None = None,
        found_raw: set[str] | None = None,
        forget_parents: bool = False,
    ) -> None:
        super().__init__(staged.backend, settings=staged.settings)
        # The parents' chunks leave the page cache once read (``forget_parent``): a pair whose
        # predictions read them again as bases keeps them.
        self.forget_parents = forget_parents
        self.sources = staged.sources
        self._headers: dict[str, bytes | None] = {}
        self._bases: dict[str, tuple[ObjectId, ...]] = {}  # parsed from _headers: chain heights ask ~9 times a position
        self.settled_raw = settled_raw if settled_raw is not None else set()  # settled_raw.py: read when the run starts
        self.found_raw = found_raw if found_raw is not None else set()  # this run's, recorded when it ends
        self._recent: OrderedDict[str, bytes] = OrderedDict()
        self._recent_lock = threading.Lock()

    def chunk_bytes(self, oid: str, size: int, keep: bool = True) -> bytes:
        """``get_chunk``, from the chunks this pair read last when it is one of them: a DCP
        parameter's weight chunk is predicted from the new ``exp_avg`` and ``exp_avg_sq`` chunks,
        its ``exp_avg_sq`` chunk from that one and both ``exp_avg`` chunks, at adjacent positions
        (plan_pair's order). The bytes were verified against their names when read. ``keep``:
        remember them (a prediction's bases only: holding other chunks only keeps memory from
        being reused, measured as more system time on bf16 epochs)."""
        with self._recent_lock:
            found = self._recent.get(oid)
            if found is not None and len(found) == size:
                self._recent.move_to_end(oid)
                return found
        raw = self.get_chunk(oid, size)
        if keep:
            self.remember(oid, raw)
        return raw

    def forget_parent(self, oid: str) -> None:
        """The parent's chunk ``oid`` is read, and nothing reads it again: at 10 GB, the
        superseded pack read into the page cache evicted the tip's, which the next checkout
        then read back from disk (docs/benchmarks.md, the 10 GB runs)."""
        if self.forget_parents:
            self.forget_cached(oid)

    def remember(self, oid: str, raw: bytes) -> None:
        """Keep ``raw``, the verified bytes of chunk ``oid``, among the last ``RECENT_CHUNKS`` read."""
        with self._recent_lock:
            self._recent[oid] = raw
            self._recent.move_to_end(oid)
            while len(self._recent) > RECENT_CHUNKS:
                self._recent.popitem(last=False)

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
        found = self._bases.get(oid)
        if found is not None:
            return found
        prefix = self.header_local(oid)
        if prefix is None:
            return super().bases_of(oid)  # a base repository's object, or a missing one (raises)
        try:
            found = tuple(ObjectId(b) for b in delta_bases(prefix))
        except IntegrityError as exc:
            raise IntegrityError(f"object {oid} is corrupt: {exc}") from None
        self._bases[oid] = found  # as _headers: unchanged within the batch
        return found


def compact_chunk(
    store: HeaderCache,
    job: Job,
    depth: int,
    roles: Roles,
    upgrade: Upgrade,
    memory: PairMemory,
    sums: dict[tuple[str, str], Sums],
) -> tuple[int, int, int, int]:
    """Re-encode one position's parent chunk and the child's own; (deltas, predicted, recompressed,
    saved)."""
    slot = job.slot
    try:
        if job.record_only:
            _record_small(store, job, sums)
            return 0, 0, 0, 0
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
            return 0, 0, 1, recompress_whole(store, slot.id, raw, slot.width, even_if_larger=True)
        parent_header = _whole_header(store, job.parent, slot.size) if job.parent is not None else None
        if parent_header is None:
            # Already a delta (an earlier run, another branch, the same state saved again) or
            # not this repository's: nothing to do for it, decided from its header alone.
            job = replace(job, parent=None, prediction=None)
        if parent_header is not None and job.prediction is None and _refused_before(store, job):
            # Settled whole as a delta would have been refused (the parent's chunk is the
            # tip's no more; the tip's own stays as committed until it is the parent).
            assert job.parent is not None
            freed = _settle_parent(store, job.parent, parent_header, job.slot, roles)
            return 0, 0, int(freed > 0), freed
        prediction = (
            job.prediction
            if job.prediction is not None and _claim_prediction(store, job.parent, job.prediction, roles)
            else None
        )
        parent = (
            job.parent
            if prediction is not None or (job.parent is not None and roles.pair(job.parent, slot.id))
            else None
        )
        provisional = (
            job.settle and store.provisional(slot.id, child_header.encoding, slot.width) and roles.recompress(slot.id)
        )
        if not provisional and parent is None:
            return 0, 0, 0, 0
        # Decoded and verified: the base of any delta. A prediction's base read it already (the
        # weight's job reads this exp_avg_sq chunk), and nothing reads it after this position.
        raw = store.chunk_bytes(slot.id, slot.size, keep=False)
        deltas = predicted = recompressed = saved = 0
        if parent is not None:
            made, freed = _reverse_delta(store, parent, job, raw, depth, prediction, upgrade, memory, sums)
            deltas, saved = deltas + (made in ("delta", "predicted")), saved + freed
            recompressed += made.startswith("whole") and freed > 0
            predicted += made == "predicted"
        if provisional:
            freed = recompress_whole(store, slot.id, raw, slot.width)
            recompressed, saved = recompressed + (freed > 0), saved + freed
        return deltas, predicted, recompressed, saved
    except CkstoreError:
        return 0, 0, 0, 0  # a damaged or missing chunk only costs compression; fsck reports it


def _record_small(store: HeaderCache, job: Job, sums: dict[tuple[str, str], Sums]) -> None:
    """A small position's relative change (format.md 5.2), as ``_reverse_delta`` records it for
    the positions it re-encodes: both chunks are decoded, nothing is re-encoded."""
    if job.dtype is None or job.parent is None or not job.tip or job.slot.size % item_size(job.dtype):
        return
    new = store.get_chunk(job.slot.id, job.slot.size)
    sums[(job.slot.id, job.parent)] = difference_sums(store.get_chunk(job.parent, job.slot.size), new, job.dtype)


def _whole_header(store: ObjectStore, oid: ObjectId, size: int) -> ObjectHeader | None:
    """The header of ``oid`` when it is a whole chunk object of ``size`` bytes in this repository."""
    prefix = store.header_local(oid)
    if prefix is None or delta_bases(prefix):
        return None
    header = parse_header(prefix)
    return header if header.kind == Kind.CHUNK and header.raw_len == size else None


def _paid_before(store: ObjectStore, oid: ObjectId, job: Job) -> bool:
    """Whether the last run made a delta at this position: the chunk below ``oid`` there is a
    delta of it (the same kind of tensor, one step further: its delta most likely pays too)."""
    try:
        return job.grandparent is not None and oid in store.bases_of(job.grandparent)
    except CkstoreError:
        return False


def _retry_refused(oid: str) -> bool:
    """Whether a refused position's parent chunk is tried again this time (see REFUSED_RETRY_ONE_IN)."""
    return int(oid[:8], 16) % REFUSED_RETRY_ONE_IN == 0


def _refused_before(store: HeaderCache, job: Job) -> bool:
    """Whether a delta was refused at this position by the last two runs: the chunks there in
    the two commits below the parent are whole and settled (a chunk below the tip settles whole
    only when no delta pays, step 2 of the module docstring; a full chain's keyframe is followed
    by deltas, so two in a row are refusals). Then the same kind of tensor (an AdamW first
    moment, mostly) is most likely refused again: decoding it and sample-testing a delta was a
    fifth of every run's CPU (docs/benchmarks.md)."""
    older = (job.grandparent, job.great_grandparent)
    if job.grandparent is None or job.great_grandparent is None:
        return False
    if job.parent in older or older[0] == older[1] or _retry_refused(job.parent or ""):
        return False
    for oid in (job.grandparent, job.great_grandparent):
        header = _whole_header(store, oid, job.slot.size)
        if header is None or not _settled(store, oid, header.encoding):
            return False
    return True


def _settle_parent(store: HeaderCache, oid: ObjectId, header: ObjectHeader, slot: Slot, roles: Roles) -> int:
    """Re-encode the parent's chunk ``oid`` (``header``: whole) in its best whole encoding when it
    is stored fast; bytes freed."""
    if not store.provisional(oid, header.encoding, slot.width) or not roles.recompress(oid):
        return 0
    read = _read_parent(store, oid)
    if read is None:
        return 0
    current, _ = read
    raw = bytes(store.reader().chunk(oid, slot.size, "", current))  # whole: no base read
    return recompress_whole(store, oid, raw, slot.width, current=current, cached=False)


def _read_parent(store: HeaderCache, oid: ObjectId) -> tuple[bytes, ObjectHeader] | None:
    """A parent's chunk as stored, and its header (None when this repository lacks it); the
    chunk is left out of the page cache once read (``HeaderCache.forget_parent``)."""
    current = store.read_local(oid)
    if current is None:
        return None
    store.forget_parent(oid)
    return current, parse_header(current)


def _settled(store: HeaderCache, oid: str, encoding: Encoding) -> bool:
    """Whether a whole chunk's encoding was chosen by compaction or repack (not a fast commit's,
    or raw as a full search left it: settled_raw.py)."""
    return encoding not in _FAST or (encoding == Encoding.RAW and oid in store.settled_raw)


def _claim_prediction(store: ObjectStore, target: ObjectId | None, p: Prediction, roles: Roles) -> bool:
    """Claim ``target`` for a predicted delta when every base is this repository's and whole now."""
    if target is None:
        return False
    for base in p.bases:
        prefix = store.header_local(base)
        if prefix is None or delta_bases(prefix):
            return False
    return roles.predict(target, p.whole, p.moment)


def _reverse_delta(
    store: HeaderCache,
    oid: ObjectId,
    job: Job,
    base_raw: bytes,
    depth: int,
    prediction: Prediction | None,
    upgrade: Upgrade,
    memory: PairMemory,
    sums: dict[tuple[str, str], Sums],
) -> tuple[str, int]:
    """Replace the parent's chunk ``oid`` by a delta against the child's, or a predicted delta (or,
    when it was stored provisionally and no delta pays, by its best whole encoding); (what was
    made, bytes freed)."""
    read = _read_parent(store, oid)
    if read is None:
        return "", 0
    current, header = read
    if (
        header.kind != Kind.CHUNK
        or header.encoding in (Encoding.DELTA, Encoding.PREDICTED, Encoding.CONTEXT)
        or header.raw_len != job.slot.size
    ):
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
        predicted = _predicted(store, oid, raw, prediction, job.slot.size, than, memory.fits, {job.slot.id: base_raw})
    weigh = predicted is None or prediction is None or memory.weigh_plain(prediction.predictor, oid)
    if height + 1 <= depth and weigh:
        # Kept only when smaller than the predicted delta (when there is one: then it is weighed
        # on a sample first, as it lost at all 408 predicted positions of a DCP benchmark step).
        data = encode_delta(
            raw,
            settings.zstd_level,
            job.slot.width,
            job.slot.id,
            base_raw,
            len(predicted) if predicted is not None else than,
            settings.allowed_in_compaction,
            sample_test=predicted is not None or not _paid_before(store, oid, job),
        )
        if predicted is not None and prediction is not None:
            memory.plain_weighed(prediction.predictor, won=data is not None)
        if data is not None and upgrade(version_for(parse_header(data).encoding)):
            check_reencoded(oid, data, raw, {job.slot.id: base_raw})
            store.stage_replace(oid, data, cached=False)
            return "delta", len(current) - len(data)
    if predicted is not None and upgrade():
        store.stage_replace(oid, predicted, cached=False)
        return "predicted", len(current) - len(predicted)
    # "whole, refused": a delta was tried and did not pay (not a full chain keeping it whole).
    whole = "whole, refused" if height + 1 <= depth else "whole"
    if best is not current:
        check_reencoded(oid, best, raw)
        store.stage_replace(oid, best, cached=False)
        return whole, len(current) - len(best)
    if provisional and len(raw) > EXHAUSTIVE_MAX:
        freed = recompress_whole(store, oid, raw, job.slot.width, current=current, cached=False)
        return whole, freed
    return (whole if height + 1 <= depth else ""), 0


def _predicted(
    store: HeaderCache,
    oid: ObjectId,
    raw: bytes,
    p: Prediction,
    size: int,
    than: int,
    fits: dict[object, tuple[tuple[float, ...], float]],
    known: dict[str, bytes],
) -> bytes | None:
    """The predicted delta of ``raw`` when it stores in fewer than ``than`` bytes, checked by
    decoding; None otherwise. ``known``: bases decoded already (the child's chunk here)."""
    from ckstore.codecs.predict import fit_scored, load_compiled, predict

    load_compiled()  # a long job: compiled predictions from the first chunk (numpy's where numba is missing)
    bases = {b: known[b] if b in known else store.chunk_bytes(b, size) for b in dict.fromkeys(p.bases)}
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


def _check_predicted(
    oid: str, data: bytes, raw: bytes, p: Prediction, coefficients: tuple[float, ...], guess: np.ndarray
) -> None:
    """``check_reencoded`` for a predicted delta, with the prediction computed for encoding it: decoding
    ``data`` is its residual XOR ``predict`` of the predictor, coefficients and bases it names
    (predicted.PredictedParts), and ``predict`` is a pure function of those (bit-reproducible by
    the format's rule, docs/format.md section 4). So when the parsed predictor, coefficients
    (bit for bit) and base ids are the ones ``guess`` was computed from, with the same verified
    base bytes, the decode would compute ``guess`` again: residual XOR ``guess`` is what it
    decodes to, compared with the chunk's bytes here. Every other step of the decode (header,
    names, coefficient range, the residual's planes) runs on the stored bytes as a reader's does
    (``predicted_decodes_to``: the planes joined, XORed and compared in one pass)."""
    try:
        inputs, decodes = predicted_decodes_to(data, raw, guess)
    except IntegrityError as exc:
        raise IntegrityError(f"object {oid} (re-encoded) is corrupt: {exc}") from None
    if not inputs.same_prediction(p.bases, p.predictor, coefficients):
        raise IntegrityError(f"object {oid} (re-encoded) names another prediction than it was encoded with")
    if not decodes:
        raise IntegrityError(f"object {oid} (re-encoded) does not decode to its bytes")


def _height(store: ObjectStore, oid: ObjectId, job: Job, depth: int) -> int:
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


def recompress_whole(
    store: HeaderCache,
    oid: ObjectId,
    raw: bytes,
    width: int,
    even_if_larger: bool = False,
    current: bytes | None = None,
    cached: bool = True,
) -> int:
    """Replace an object (``current``: its stored bytes, when read already) by its best whole
    encoding when smaller (``even_if_larger``: a delta made whole); bytes freed. ``cached``
    False: a parent's chunk, which no checkout of the tip reads."""
    current = current if current is not None else store.read_local(oid)
    if current is None or bool(delta_bases(current)) != even_if_larger:
        return 0
    settings = store.settings
    best = encode_chunk(raw, settings.zstd_level, width, allowed=settings.allowed)
    store.searched(oid, best)
    if len(best) >= len(current) and not even_if_larger:
        return 0
    check_reencoded(oid, best, raw)
    if cached:
        store.forget_cached(oid)  # the tip's old copy: its new one is what a checkout reads
    store.stage_replace(oid, best, cached=cached)
    return len(current) - len(best)
