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
from datetime import datetime
from typing import TYPE_CHECKING

from .codec import encode_chunk
from .errors import CkstoreError
from .ids import ObjectId
from .ingest import Position, element_width
from .manifest import Commit
from .pipeline import ordered_map

if TYPE_CHECKING:
    from .repo import Repo

REPACK_LOCK_TIMEOUT = 600.0


@dataclass
class RepackReport:
    objects: int = 0  # chunk objects considered
    rewritten: int = 0
    deltas: int = 0  # objects stored as deltas after the repack
    bytes_before: int = 0
    bytes_after: int = 0
    upgraded: bool = False  # the repository was upgraded from format version 1


@dataclass(frozen=True)
class _Plan:
    size: int
    width: int
    base: ObjectId | None
    depth: int


def _positions(commit: Commit) -> dict[tuple[Position | tuple[str, str], int], tuple[ObjectId, int, int]]:
    """Every chunk of a commit by (position, index): (id, size, element width)."""
    out: dict[tuple[Position | tuple[str, str], int], tuple[ObjectId, int, int]] = {}
    for f in commit.files:
        for i, c in enumerate(f.header):
            out[((f.path, "\0header"), i)] = (c.id, c.size, 1)
        for t in f.tensors:
            width = element_width(t.dtype)
            for i, c in enumerate(t.chunks):
                out[((f.path, t.name), i)] = (c.id, c.size, width)
        for i, c in enumerate(f.chunks):
            out[((f.path, None), i)] = (c.id, c.size, 1)
    return out


def plan(repo: Repo, commits: Iterable[ObjectId], max_depth: int) -> dict[ObjectId, _Plan]:
    """Base and depth for every chunk of ``commits``: newest first, each against its child."""
    keep = set(commits)
    has_child = {p for c in keep for p in repo.read_commit(c).parents}
    heads = sorted(keep - has_child)
    child: dict[ObjectId, ObjectId | None] = {h: None for h in heads}
    heap = [(-datetime.fromisoformat(repo.read_commit(h).time).timestamp(), h) for h in heads]
    heapq.heapify(heap)
    result: dict[ObjectId, _Plan] = {}
    done: set[ObjectId] = set()
    while heap:
        _, oid = heapq.heappop(heap)
        if oid in done:
            continue
        done.add(oid)
        commit = repo.read_commit(oid)
        newer = _positions(repo.read_commit(child[oid])) if child[oid] else {}  # type: ignore[arg-type]
        for where, (cid, size, width) in _positions(commit).items():
            if cid in result:
                continue
            base = newer.get(where)
            entry = _Plan(size, width, None, 0)
            if base and base[0] != cid and base[1] == size and base[0] in result:
                depth = result[base[0]].depth + 1
                if depth <= max_depth:
                    entry = _Plan(size, width, base[0], depth)
            result[cid] = entry
        for parent in commit.parents:
            if parent in keep and parent not in done:
                child.setdefault(parent, oid)
                heapq.heappush(heap, (-datetime.fromisoformat(repo.read_commit(parent).time).timestamp(), parent))
    return result


def repack(repo: Repo) -> RepackReport:
    with repo.backend.repo_lock(exclusive=True, timeout=REPACK_LOCK_TIMEOUT):
        return repack_locked(repo, repo.reachable_commits())


def repack_locked(repo: Repo, commits: Iterable[ObjectId]) -> RepackReport:
    """Repack the chunks of ``commits``; the caller holds the exclusive repository lock."""
    report = RepackReport()
    if repo.config.version < 2:
        from .config import DEFAULT_MAX_DELTA_DEPTH

        repo.set_config(replace(repo.config, version=2, max_delta_depth=DEFAULT_MAX_DELTA_DEPTH))
        report.upgraded = True
    settings = repo.store.settings
    planned = plan(repo, commits, settings.max_delta_depth)
    store = repo.store

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
            return len(current), len(current), False, store.base_of(oid) is not None
        # Prove the new encoding before it replaces a good one: decode it and re-hash.
        store.check_encoded(oid, data, p.size)
        store.replace_chunk(oid, data)
        return len(current), len(data), True, store.base_of(oid) is not None

    for depth in range(settings.max_delta_depth + 1):
        level = sorted((oid, p) for oid, p in planned.items() if p.depth == depth and store.has(oid))
        for before, after, changed, is_delta in ordered_map(rewrite, level):
            report.objects += 1
            report.bytes_before += before
            report.bytes_after += after
            report.rewritten += changed
            report.deltas += is_delta
    return report
