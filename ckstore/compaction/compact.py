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
   grouping): the parent's when no delta replaced it (where the last two runs found none, an
   AdamW first moment mostly, without trying again); the tip's only when the parent has it
   too. The tip's other chunks stay as the commit stored them, in the commit's pack: the
   next commit's compaction turns most of them into deltas and settles the rest, and encoding
   them whole each epoch only to replace them one epoch later doubled a run's CPU (fp32_frozen
   MiniLM epochs: 4.4x the save's CPU to 9.9x). They are settled once the branch is quiet
   (tip.py): when ``ckstore wait`` asks for it (``settle_branch``), or, after a detached
   compaction, those likely to stay whole once no newer commit has arrived for
   ``detached.QUIET_SECONDS`` and the rest once the run looks over; a newer commit preempts it.

Every replacement is decoded and re-hashed before it is staged, and all of a run's replacements
are applied together after one durability barrier (``ObjectStore.batch``); an interrupted run
leaves each object in its old or its new encoding, both of which decode to the same bytes, so
every commit stays readable and the next run redoes what is left. A base is a whole object
when the run starts, and every new link leads to a whole object within two steps when it ends
(``Roles``: only a predicted delta may name a base that the run turns into a plain delta), and
one compaction runs at a time per repository (``Backend.compaction_lock``), so deltas can never
form a cycle: docs/format.md sections 4 and 8, docs/design.md "Chains".

Each run also covers the pair below (the parent against the grandparent): work that a killed
process left undone is picked up by the next commit's compaction. The pair below settles only
the parent's chunks that the tip's pair does not reach (a tensor the tip dropped).

This module runs a compaction (the lock, the pairs and their batches, what a finished run
records); pairing.py pairs the positions, encoding.py re-encodes one.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial

from ckstore.compaction.at_rest import is_at_rest, record_at_rest
from ckstore.compaction.encoding import HeaderCache, PairMemory, compact_chunk, small_position
from ckstore.compaction.finished_pairs import is_finished, record_finished
from ckstore.compaction.pairing import Job, Roles, Upgrade, plan_pair
from ckstore.compaction.settled_raw import record_settled_raw, settled_raw
from ckstore.compaction.tip import TipWatch, settle_tip
from ckstore.format.ids import ObjectId
from ckstore.format.manifest import Commit
from ckstore.repository.change_record import Sums, TensorKey, comparable, write_changes
from ckstore.repository.context import RepoContext
from ckstore.repository.refs import HEADS
from ckstore.repository.writing import writing
from ckstore.runtime.pipeline import collection_paused, ordered_map
from ckstore.runtime.priority import BESIDE_TRAINING, lower

# How long a compaction waits for another process's to finish before leaving the work to the
# next one (nothing is lost by skipping: the objects are only less compressed until then).
COMPACTION_LOCK_TIMEOUT = 60.0
# Compaction runs beside training, which needs the cores for data loading and its own steps: at
# most half of them, each worker thread lowering its own priority as it starts (the pool's
# initializer; Linux nice values are per thread, so the caller's thread keeps its own).
COMPACTION_WORKERS = max(1, min(4, (os.cpu_count() or 1) // 2))
_YIELD_TO_TRAINING = partial(lower, BESIDE_TRAINING, thread=True)


@dataclass
class CompactReport:
    deltas: int = 0  # parent chunks now stored as deltas against the tip's (predicted ones included)
    predicted: int = 0  # of those, predicted deltas (codec encoding 4)
    recompressed: int = 0  # provisional chunks now in their best whole encoding
    saved: int = 0  # stored bytes freed
    at_rest: bool = False  # the tip was settled too (no newer commit arrived meanwhile): at_rest.py


def compact_branch(
    ctx: RepoContext,
    branch: str,
    lock_timeout: float = COMPACTION_LOCK_TIMEOUT,
    on_locked: Callable[[], object] | None = None,
    settle: bool = False,
    defer_bases: bool = False,
) -> CompactReport:
    """Compact the tip of ``branch`` against its parent, and the parent against its parent.
    ``on_locked`` is called once the compaction lock is held (a detached run leaves its place in
    line then: detached.py). ``settle``: then settle the tip's own chunks too, unless a newer
    commit arrives meanwhile (tip.py; a pair an earlier run finished is not redone, so a run
    after one without it only settles); ``defer_bases``: all but those the parent's deltas are
    based on, which the next commit's compaction most likely makes deltas (the tip is then not
    at rest yet)."""
    report = CompactReport()
    # No automatic garbage collection while it runs (as a commit): its objects hold no cycles,
    # and collections were 2-3% of a run's CPU.
    with ctx.backend.compaction_lock(lock_timeout), writing(ctx), collection_paused():
        if on_locked is not None:
            on_locked()
        # The settings and version as they are now, not as this process read them (it may have
        # waited an hour); and the repository it opened, not one created since at the same path,
        # whose compaction lock this one would not exclude.
        ctx.refresh()
        depth = ctx.config.encoding.max_delta_depth
        tip = ctx.refs.read(HEADS + branch)
        window = depth + 3
        commits = ctx.graph.first_parents(tip, window)
        if tip is None or not commits:
            return report
        # The pair below first, each pair in its own batch: the tip's pair then reads the
        # chains as the first one left them. A chunk the tip or the child uses never becomes a
        # delta (the tip reads whole; a chunk can sit at several positions or come back).
        upgrade = Upgrade(ctx)
        pairs = [
            plan_pair(
                commits[i], commits[i + 1 :], depth, history_ends=len(commits) < window, upgrade=upgrade, tip=i == 0
            )
            for i in range(min(2, len(commits)))
        ]
        # Which chunks settle into their best whole encoding (see the module docstring): at the
        # tip, those it shares with its parent; below it, the child's chunks that the tip's pair
        # does not reach (a tensor the tip dropped), so a provisional chunk is re-encoded once.
        parent_chunks = {c.id for c in commits[1].all_chunks()} if len(commits) > 1 else set()
        tip_reaches = {j.slot.id for j in pairs[0]} | {j.parent for j in pairs[0] if j.parent is not None}
        small = small_position(ctx.config.chunk_size)
        pairs[0] = [replace(j, settle=j.slot.id in parent_chunks, record_only=j.slot.size < small) for j in pairs[0]]
        if len(pairs) > 1:
            pairs[1] = [
                replace(j, settle=j.slot.id not in tip_reaches, record_only=j.slot.size < small) for j in pairs[1]
            ]
        # A pair an earlier run finished is not visited again (finished_pairs.py): the pair
        # below keeps only the chunks that it alone settles; the tip pair, compacted twice, none.
        ids: list[ObjectId] = [tip] + [c.parents[0] for c in commits[:2] if c.parents]
        for i in range(len(pairs)):
            if i + 1 < len(ids) and is_finished(ctx.backend, ids[i], ids[i + 1]):
                pairs[i] = [j for j in pairs[i] if j.settle] if i else []
        pool = ThreadPoolExecutor(
            COMPACTION_WORKERS, thread_name_prefix="ckstore-compact", initializer=_YIELD_TO_TRAINING
        )
        sums: dict[tuple[str, str], Sums] = {}  # (child's chunk, parent's): the tip pair's decoded ones
        known_raw, found_raw = settled_raw(ctx.backend, ctx.store.settings), set[str]()
        with pool:
            for i in reversed(range(len(pairs))):
                newer = {c.id for commit in commits[: i + 1] for c in commit.all_chunks()}
                # A pair with predictions reads parents' chunks again as bases: those stay cached.
                forget = all(j.prediction is None for j in pairs[i])
                ctx.check_same_repository()  # before each batch: a run stops in a re-created repository
                with ctx.store.batch() as staged:
                    view = HeaderCache(staged, known_raw, found_raw, forget_parents=forget)
                    _run_pair(view, pairs[i], depth, Roles(newer), report, upgrade, pool, sums)
            # Last, and only while no newer commit has arrived: the tip's own chunks (tip.py).
            reached_all = False
            if settle:
                ctx.check_same_repository()
                settled, freed, reached_all = settle_tip(
                    ctx,
                    commits[0],
                    TipWatch(ctx, branch, tip),
                    pool,
                    COMPACTION_WORKERS,
                    known_raw,
                    found_raw,
                    parent=commits[1] if len(commits) > 1 else None,
                    defer_bases=defer_bases,
                )
                report.recompressed, report.saved = report.recompressed + settled, report.saved + freed
        record_settled_raw(ctx.backend, ctx.store.settings, found_raw)  # as record_finished: after the batches
        if len(commits) > 1:
            record_finished(ctx.backend, tip, commits[0].parents[0])  # its replacements are durable
            # The relative change against the parent, from the chunks decoded above (format.md 5.2).
            write_changes(
                ctx.backend,
                tip,
                commits[0],
                commits[0].parents[0],
                commits[1],
                _tensor_sums(commits[0], commits[1], sums),
            )
        if reached_all:
            record_at_rest(ctx.backend, [tip])
            report.at_rest = True
        # Packs that hold replaced objects are settled here, off the training loop's path: their
        # other large objects spread into loose files, small ones kept packed; a pack none of
        # whose objects was replaced stays (backend/local_settle.py). Not after settling the
        # tip's likely-whole chunks alone: the tip's pack would spread the delta bases it still
        # holds (two thirds of an fp32 MiniLM epoch copied, 0.45 of that run's 1.0 CPU s), which
        # the next compaction replaces anyway; their old copies stay in the pack until then.
        if not (settle and defer_bases and not reached_all):
            ctx.backend.unpack(keep_clean=True)
        _warm_tip(ctx, commits[0])
    return report


def compact_commits(
    ctx: RepoContext, commits: Sequence[Commit], prepare: Callable[[Sequence[Job]], object] | None = None
) -> CompactReport:
    """The tip pair of ``compact_branch`` alone, on commits given rather than a branch's:
    ``commits[1]``'s chunks (the parent) become deltas of ``commits[0]``'s where smaller, or their
    best whole encoding, and ``commits[0]``'s chunks that the parent shares are settled.
    ``commits``: the child, then its first parents (up to the delta depth + 2: chains are counted
    on them), read through ``ctx``'s store, whose sources may be a remote's lazily read objects
    (remote/compaction.py: the replacements are then sent there). A child restricted to some of
    its files re-encodes only their positions. Compaction changes only objects in ``ctx``'s own
    backend: ``prepare`` is given the jobs first, to bring there the chunks they name. Nothing is
    recorded (finished pairs, changes, at rest): the caller decides what the result means."""
    report = CompactReport()
    depth = ctx.config.encoding.max_delta_depth
    if len(commits) < 2 or not depth:
        return report
    with ctx.backend.compaction_lock(COMPACTION_LOCK_TIMEOUT), writing(ctx), collection_paused():
        upgrade = Upgrade(ctx)
        jobs = plan_pair(
            commits[0], commits[1:], depth, history_ends=len(commits) < depth + 3, upgrade=upgrade, tip=True
        )
        shared = {c.id for c in commits[1].all_chunks()}
        small = small_position(ctx.config.chunk_size)
        jobs = [replace(j, settle=j.slot.id in shared, record_only=j.slot.size < small) for j in jobs]
        if prepare is not None:
            prepare(jobs)
        known_raw, found_raw = settled_raw(ctx.backend, ctx.store.settings), set[str]()
        pool = ThreadPoolExecutor(
            COMPACTION_WORKERS, thread_name_prefix="ckstore-compact", initializer=_YIELD_TO_TRAINING
        )
        with pool, ctx.store.batch() as staged:
            view = HeaderCache(staged, known_raw, found_raw, forget_parents=all(j.prediction is None for j in jobs))
            newer = {c.id for c in commits[0].all_chunks()}
            _run_pair(view, jobs, depth, Roles(newer), report, upgrade, pool, {})
    return report


def settle_branch(ctx: RepoContext, branch: str) -> CompactReport | None:
    """Bring ``branch`` to rest now: compact it (its pairs, when no earlier run finished them) and
    settle its tip, unless its tip is recorded at rest already (None then)."""
    tip = ctx.refs.read(HEADS + branch)
    if tip is None or is_at_rest(ctx.backend, tip):
        return None
    return compact_branch(ctx, branch, settle=True)


# The newest commit is read back into the page cache after its compaction when its stored bytes
# are at most this fraction of the memory the kernel has available for caching.
WARM_TIP_SHARE = 0.75


def _warm_tip(ctx: RepoContext, tip: Commit) -> None:
    """Start reading the newest commit's chunks into the page cache, in the background, when they
    fit: its checkout (a resume, an evaluation) is what reads the repository next. Compaction
    keeps what it reads and writes of the parent out of the cache, but by the time it ends, at
    10 GB, part of the tip had been evicted (the save and the commit had passed 20 GB through
    the cache), and the checkout read it from disk: 4.5-5.9 GB (docs/benchmarks.md, the
    10 GB runs). Reading it here is off the training loop's path, at compaction's priority."""
    from ckstore.backend.fsio import available_memory
    from ckstore.format.ids import object_key

    available = available_memory()
    keys = {object_key(c.id) for c in tip.all_chunks()}
    stored = sum(ctx.backend.size(k) or 0 for k in keys)
    if available is None or stored > available * WARM_TIP_SHARE:
        return
    ctx.backend.read_ahead(keys)


def _run_pair(
    store: HeaderCache,
    jobs: list[Job],
    depth: int,
    roles: Roles,
    report: CompactReport,
    upgrade: Upgrade,
    pool: ThreadPoolExecutor,
    sums: dict[tuple[str, str], Sums],
) -> None:
    # One optimizer step: the next chunk usually takes the last one's coefficients as they are.
    memory = PairMemory()

    def run(job: Job) -> tuple[int, int, int, int]:
        return compact_chunk(store, job, depth, roles, upgrade, memory, sums)

    for delta, predicted, recompressed, saved in ordered_map(run, jobs, workers=COMPACTION_WORKERS, pool=pool):
        report.deltas += delta
        report.predicted += predicted
        report.recompressed += recompressed
        report.saved += saved


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
