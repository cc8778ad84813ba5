"""Repack: re-encode every kept chunk with the current settings, newest commits whole.

Commits write forward deltas (a chunk against the same chunk in its parent), which is cheap at
commit time but makes the newest commit the deepest in its chain. Repack reverses that, as git
packs do: the chunks of each branch tip and tag are stored whole, and each older commit's chunk
becomes a delta against the same chunk one commit newer (paired as compaction pairs them, by
position else by tensor name: per-epoch file names still pair), at most ``max_delta_depth`` steps
from a whole object. The encoder still picks the smallest encoding, so a "delta" that does not pay
is stored whole, and an object keeps its current encoding (a predicted delta, a delta compaction
made) when that is no larger and safe to keep: repack never grows the store.

Safety: the plan assigns every object its base before any object is written, and bases always
come from commits processed earlier (newer), so the planned graph is acyclic with bounded depth.
Objects are rewritten in order of planned depth (whole ones first), each one atomically replaced
by an encoding that was decoded and hash-checked before the swap, or kept only when every base
it names is already final; so at every instant each object decodes to its name's bytes, a chain
from a final object reaches only final objects (no cycle), and an interrupted repack leaves chains at most ``2 * depth + 1`` long (store.py allows
far more). Runs under the exclusive repository lock, like gc.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterable
from contextlib import closing
from dataclasses import dataclass, replace

from ckstore.codecs.objects import delta_bases, encode_chunk, parse_header
from ckstore.compaction.at_rest import record_at_rest
from ckstore.errors import CkstoreError
from ckstore.format.ids import ObjectId
from ckstore.format.manifest import FileEntry
from ckstore.format.positions import ChunkIndex, chunk_at, slots
from ckstore.format.settings import DEFAULT_MAX_DELTA_DEPTH, version_for
from ckstore.maintenance import sizes
from ckstore.repository.context import RepoContext
from ckstore.repository.graph import CommitGraph
from ckstore.repository.reader import check_reencoded
from ckstore.repository.refs import HEADS
from ckstore.runtime.pipeline import ordered_map
from ckstore.runtime.progress import ProgressFactory, watching


@dataclass
class RepackReport:
    objects: int = 0  # chunk objects considered
    rewritten: int = 0  # of those, re-encoded (the rest were already as planned)
    deltas: int = 0  # of those, stored as deltas after the repack (rewritten or not)
    bytes_before: int = 0  # "stored" bytes of the objects considered, before and after
    bytes_after: int = 0
    stored_bytes_before: int = 0  # "stored" bytes of the whole repository, as stats reports them
    stored_bytes_after: int = 0
    upgraded: bool = False  # the repository was upgraded from format version 1


@dataclass(frozen=True)
class _Plan:
    size: int
    width: int
    base: ObjectId | None
    depth: int


def plan(graph: CommitGraph, commits: Iterable[ObjectId], max_depth: int) -> dict[ObjectId, _Plan]:
    """Base and depth for every chunk of ``commits``: newest first, each against its child."""
    keep = set(commits)
    has_child = {p for c in keep for p in graph.read_commit(c).parents}
    heads = sorted(keep - has_child)
    child: dict[ObjectId, ObjectId | None] = {h: None for h in heads}
    heap = [(-graph.read_commit(h).timestamp, h) for h in heads]
    heapq.heapify(heap)
    result: dict[ObjectId, _Plan] = {}
    done: set[ObjectId] = set()
    while heap:
        _, oid = heapq.heappop(heap)
        if oid in done:
            continue
        done.add(oid)
        commit = graph.read_commit(oid)
        # Paired as compaction pairs (positions.ChunkIndex): by position, else by tensor name, so
        # per-epoch file names still pair each tensor with itself one commit newer.
        newer_id = child[oid]
        newer = ChunkIndex(graph.read_commit(newer_id).files, _tensor_names(commit.files)) if newer_id else None
        for where, slot in slots(commit.files).items():
            if slot.id in result:
                continue
            base = chunk_at(newer, where[0], where[1], slot.size) if newer is not None else None
            entry = _Plan(slot.size, slot.width, None, 0)
            if base and base != slot.id and base in result:
                depth = result[base].depth + 1
                if depth <= max_depth:
                    entry = _Plan(slot.size, slot.width, base, depth)
            result[slot.id] = entry
        for parent in commit.parents:
            if parent in keep and parent not in done:
                child.setdefault(parent, oid)
                heapq.heappush(heap, (-graph.read_commit(parent).timestamp, parent))
    return result


def _tensor_names(files: Iterable[FileEntry]) -> dict[str, list[str]]:
    return {f.path: [t.name for t in f.tensors] for f in files if f.kind == "safetensors"}


def repack(ctx: RepoContext, progress: ProgressFactory | None = None) -> RepackReport:
    with ctx.backend.exclusive_lock():
        started = time.time()
        ctx.backend.unpack()  # repack re-encodes loose objects in place (backend/local_packs.py)
        kept = ctx.graph.reachable_commits()
        kept_set = set(kept)
        report = repack_locked(ctx, kept, progress)
        # Every kept commit is in its planned encoding now: the branch tips are at rest.
        record_at_rest(ctx.backend, [oid for oid in ctx.refs.list(HEADS).values() if oid in kept_set])
        sizes.record_measured(ctx, started)  # status right after shows the new figures at once
        return report


def repack_locked(
    ctx: RepoContext, commits: Iterable[ObjectId], progress: ProgressFactory | None = None
) -> RepackReport:
    """Repack the chunks of ``commits``; the caller holds the exclusive repository lock."""
    report = RepackReport(stored_bytes_before=sum(ctx.store.stored_sizes().values()))
    if ctx.config.version < 2:
        ctx.set_config(replace(ctx.config, version=2, max_delta_depth=DEFAULT_MAX_DELTA_DEPTH))
        report.upgraded = True
    settings = ctx.store.settings
    planned = plan(ctx.graph, commits, settings.max_delta_depth)
    store = ctx.store

    # Final chain depth of every object already in its final form (whole: 0). An object keeps its
    # current encoding only when every base it names is final and the chain stays within
    # ``max_delta_depth``; a new delta's base is always final (planned at a lower depth). So
    # final objects only ever lead to final objects: no cycle, whatever was kept.
    # An overlay's objects that its base repository holds are final as they are: repack never
    # writes them here (that would copy the base in) and never changes them there.
    final: dict[str, int] = {}

    def final_depth(oid: str) -> int | None:
        if oid not in final and not store.has_local(oid) and store.has_durable(oid):
            try:
                final[oid] = store.chain_depth(oid)
            except CkstoreError:
                return None
        return final.get(oid)

    def kept_depth(bases: tuple[str, ...]) -> int | None:
        if not bases:
            return 0
        depths = [final_depth(b) for b in bases]
        if any(d is None for d in depths):
            return None
        depth = 1 + max(d for d in depths if d is not None)
        return depth if depth <= settings.max_delta_depth else None

    def rewrite(item: tuple[ObjectId, _Plan]) -> tuple[int, int, bool, int]:
        """(stored bytes before, after, rewritten, final depth) of one object."""
        oid, p = item
        current = store.read_raw(oid)
        keep = kept_depth(delta_bases(current))
        raw = store.get_chunk(oid, p.size)
        base_raw = None
        base_depth = final_depth(p.base) if p.base is not None else None
        if p.base is not None and base_depth is not None and base_depth < settings.max_delta_depth:
            try:
                base_raw = store.get_chunk(p.base, p.size)
            except CkstoreError:
                base_raw = None  # a damaged base: store this one whole instead
        data = encode_chunk(
            raw, settings.zstd_level, p.width, p.base if base_raw else None, base_raw, allowed=settings.allowed_off_loop
        )
        # Never store more than before: the current encoding (a predicted delta, a delta against
        # another commit's chunk) stays when it is no larger and safe to keep.
        if keep is not None and len(current) <= len(data):
            return len(current), len(current), False, keep
        depth = 1 + base_depth if base_depth is not None and delta_bases(data) else 0
        # Prove the new encoding before it replaces a good one: it decodes to the verified bytes.
        check_reencoded(oid, data, raw, {p.base: base_raw} if p.base is not None and base_raw is not None else None)
        # Upgraded (durably) before the first object the repository's version lacks is written.
        ctx.upgrade(version_for(parse_header(data).encoding))
        store.replace_chunk(oid, data)
        return len(current), len(data), True, depth

    levels = [
        sorted((oid, p) for oid, p in planned.items() if p.depth == depth and store.has_local(oid))
        for depth in range(settings.max_delta_depth + 1)
    ]
    with watching(progress, sum(p.size for level in levels for _, p in level), "repack") as advance:
        for level in levels:
            # Objects whose current bases are all final are decided first; then the rest, whose
            # bases may have become final in the first pass (a predicted delta naming the
            # parent's first moment, which sits at the same planned depth).
            ready = [item for item in level if kept_depth(store.bases_of(item[0])) is not None]
            ready_ids = {oid for oid, _ in ready}
            later = [item for item in level if item[0] not in ready_ids]
            for batch in (ready, later):
                with closing(ordered_map(rewrite, batch)) as rewritten:  # waits for its workers on an error
                    for (oid, p), (before, after, changed, depth) in zip(batch, rewritten):
                        final[oid] = depth
                        report.objects += 1
                        report.bytes_before += before
                        report.bytes_after += after
                        report.rewritten += changed
                        report.deltas += depth > 0
                        advance(p.size)
    report.stored_bytes_after = sum(store.stored_sizes().values())
    return report
