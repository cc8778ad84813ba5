"""Repack: re-encode every kept chunk with the current settings, newest commits whole.

Commits write forward deltas (a chunk against the same chunk in its parent), which is cheap at
commit time but makes the newest commit the deepest in its chain. Repack reverses that, as git
packs do: the chunks of each branch tip and tag are stored whole, and each older commit's chunk
becomes a delta against the same chunk one commit newer, at most ``max_delta_depth`` steps from
a whole object. The encoder still picks the smallest encoding, so a "delta" that does not pay is
stored whole.

Safety: the plan assigns every object its base before any object is written, and bases always
come from commits processed earlier (newer), so the planned graph is acyclic with bounded depth.
Objects are rewritten in order of planned depth (whole ones first), each one atomically replaced
by an encoding that was decoded and hash-checked before the swap; so at every instant each
object decodes to its name's bytes, a chain reaches only objects already in final form (no
cycle), and an interrupted repack leaves chains at most ``2 * depth + 1`` long (store.py allows
far more). Runs under the exclusive repository lock, like gc.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass, replace

from ckstore.format.codec import encode_chunk
from ckstore.format.settings import DEFAULT_MAX_DELTA_DEPTH
from ckstore.repository.context import RepoContext
from ckstore.errors import CkstoreError
from ckstore.repository.graph import CommitGraph
from ckstore.history.log import stored_bytes
from ckstore.format.ids import ObjectId
from ckstore.write.pipeline import ProgressFactory, ordered_map
from ckstore.format.positions import slots


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
        newer = slots(graph.read_commit(child[oid]).files) if child[oid] else {}  # type: ignore[arg-type]
        for where, slot in slots(commit.files).items():
            if slot.id in result:
                continue
            base = newer.get(where)
            entry = _Plan(slot.size, slot.width, None, 0)
            if base and base.id != slot.id and base.size == slot.size and base.id in result:
                depth = result[base.id].depth + 1
                if depth <= max_depth:
                    entry = _Plan(slot.size, slot.width, base.id, depth)
            result[slot.id] = entry
        for parent in commit.parents:
            if parent in keep and parent not in done:
                child.setdefault(parent, oid)
                heapq.heappush(heap, (-graph.read_commit(parent).timestamp, parent))
    return result


def repack(ctx: RepoContext, progress: ProgressFactory | None = None) -> RepackReport:
    with ctx.backend.exclusive_lock():
        ctx.backend.unpack()  # repack re-encodes loose objects in place (backend/local_packs.py)
        return repack_locked(ctx, ctx.graph.reachable_commits(), progress)


def repack_locked(ctx: RepoContext, commits: Iterable[ObjectId], progress: ProgressFactory | None = None) -> RepackReport:
    """Repack the chunks of ``commits``; the caller holds the exclusive repository lock."""
    report = RepackReport(stored_bytes_before=stored_bytes(ctx.store, ctx.store.iter_ids()))
    if ctx.config.version < 2:
        ctx.set_config(replace(ctx.config, version=2, max_delta_depth=DEFAULT_MAX_DELTA_DEPTH))
        report.upgraded = True
    settings = ctx.store.settings
    planned = plan(ctx.graph, commits, settings.max_delta_depth)
    store = ctx.store

    def rewrite(item: tuple[ObjectId, _Plan]) -> tuple[int, int, bool, bool]:
        oid, p = item
        current = store.read_raw(oid)
        raw = store.get_chunk(oid, p.size)
        base_raw = None
        if p.base is not None:
            try:
                base_raw = store.get_chunk(p.base, p.size)
            except CkstoreError:
                base_raw = None  # a damaged base: store this one whole instead
        data = encode_chunk(raw, settings.zstd_level, p.width, p.base if base_raw else None, base_raw,
                            allowed=settings.allowed)
        if data == current:
            return len(current), len(current), False, bool(store.bases_of(oid))
        # Prove the new encoding before it replaces a good one: decode it and re-hash.
        store.check_encoded(oid, data, p.size)
        store.replace_chunk(oid, data)
        return len(current), len(data), True, bool(store.bases_of(oid))

    levels = [sorted((oid, p) for oid, p in planned.items() if p.depth == depth and store.has(oid))
              for depth in range(settings.max_delta_depth + 1)]
    bar = progress(sum(p.size for level in levels for _, p in level), "repack") if progress else None
    try:
        for level in levels:
            for (_, p), (before, after, changed, is_delta) in zip(level, ordered_map(rewrite, level)):
                report.objects += 1
                report.bytes_before += before
                report.bytes_after += after
                report.rewritten += changed
                report.deltas += is_delta
                if bar:
                    bar.update(p.size)
    finally:
        if bar:
            bar.close()
    report.stored_bytes_after = stored_bytes(store, store.iter_ids())
    return report
