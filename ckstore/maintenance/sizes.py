"""The size figures, each defined once (docs/design.md, "Size figures", is the user's version).

- **logical**: bytes of a commit's files as checkout writes them (recorded in the manifest; exact).
- **stored**: bytes of object files in this repository (``history.stored_bytes``); objects that a
  base repository holds count there. ``stats`` sums it over every object.
- **added when committed**: how much the store grew when the commit was made (the manifest's
  ``added_bytes``): its new chunk objects as the commit stored them, before the compaction that
  follows it. A record of that moment: compaction, gc and repack do not change it.
- **new** (now): stored bytes of the objects a commit's files use and the other commit's files
  use nowhere (``history.new_objects``); ``diff A B`` reports it for B against A, ``log --sizes``
  for each commit against its first kept parent. Delta bases are not followed: a delta counts
  its own bytes.
- **held alone** (now): what deleting only this commit would free, i.e. the stored bytes of the
  objects (its manifest, its chunks, their delta bases) that no other commit gc keeps needs.
  Computed from gc's own ``kept_commits`` and ``live_objects``, so ``gc`` that drops exactly this
  commit frees exactly this (tests/cli/test_output.py checks it for every commit).
- **unreferenced** (now): stored bytes that no kept commit needs; plain ``gc`` frees exactly this,
  plus the **temporary** files interrupted writes left (a killed commit's half-written pack),
  which are not objects and count in neither stored nor unreferenced.

Held alone and unreferenced depend on what overlay repositories of this one need; while one of
them cannot be opened (it may have moved) gc refuses to run, and these two figures are None
(unknown) rather than an error: stats and log still answer.

So ``stored = needed by the kept commits + unreferenced``, and the newest commit of a branch
usually holds little alone: its parent's deltas need its chunks as their bases.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, replace

from ckstore.errors import DependentNotFoundError
from ckstore.format.ids import ObjectId
from ckstore.history.log import new_objects, stored_bytes
from ckstore.maintenance import sizes_cache
from ckstore.maintenance.kept import Kept, kept_commits, live_objects
from ckstore.maintenance.retention import RetentionPolicy
from ckstore.repository.context import RepoContext
from ckstore.repository.graph import kept_parents
from ckstore.repository.reader import delta_closure, delta_closure_many
from ckstore.repository.store import ObjectStore


@dataclass(frozen=True)
class Stats:
    logical_bytes: int  # summed over the reachable commits
    stored_bytes: int  # every object file of this repository
    commits: int  # reachable commits
    objects: int
    unreferenced_bytes: int | None = 0  # what plain gc would free now (None: unknown, see above)
    unreferenced_objects: int | None = 0
    temporary_files: int = 0  # left by interrupted writes (or a write running now): gc removes them
    temporary_bytes: int = 0

    @property
    def ratio(self) -> float:
        return self.stored_bytes / self.logical_bytes if self.logical_bytes else 0.0


@dataclass(frozen=True)
class CommitSizes:
    logical_bytes: int
    added_bytes: int  # recorded when committed
    new_bytes: int  # now, against the first kept parent (all of its objects for a root)
    held_alone_bytes: int | None  # now: what deleting only this commit frees (None: unknown)


def stats(ctx: RepoContext) -> Stats:
    """The figures now; kept for ``status`` (sizes_cache.py) when the repository had settled."""
    started = time.time()
    key = sizes_cache.state_key(ctx, started - sizes_cache.SETTLE_SECONDS)
    figures = _measure(ctx)
    sizes_cache.record(ctx, key, started, asdict(figures))
    return figures


def record_after_gc(
    ctx: RepoContext, kept: Kept, live: set[str], remaining: dict[ObjectId, int], started: float
) -> None:
    """Keep the figures a gc that started at ``started`` leaves (its caller holds the exclusive
    lock), from what it walked: the commits it kept, the objects they need (``live``) and the
    objects left with their sizes (``remaining``). So ``status`` right after gc is exact without
    measuring again (at 10^6 objects a measurement costs as much as the gc). What plain gc would
    free now is nothing when plain gc keeps the commits this run kept; a retention policy or
    ``--prune-now`` may keep fewer, and then it is measured from plain gc's kept set."""
    if sizes_cache.state_key(ctx) is None:
        return  # never cached (overlay dependents, in memory): nothing to keep
    after = _kept(ctx)
    if after is None:
        return
    if (after.commits, after.external) != (kept.commits, kept.external):
        live = live_objects(ctx, after)
    garbage = remaining.keys() - live
    logical = sum(ctx.graph.read_commit(c, files=False).logical_bytes for c in after.reachable)
    temporaries = ctx.backend.temporary_sizes()
    figures = Stats(
        logical,
        sum(remaining.values()),
        len(after.reachable),
        len(remaining),
        sum(remaining[oid] for oid in garbage),
        len(garbage),
        len(temporaries),
        sum(temporaries),
    )
    sizes_cache.record(ctx, sizes_cache.settled_key(ctx), started, asdict(figures))


def record_measured(ctx: RepoContext, started: float) -> None:
    """Measure and keep the figures now, for a caller holding the exclusive lock that changed the
    store (repack: re-encoding changes stored bytes, and a delta made whole frees its base)."""
    figures = _measure(ctx)
    sizes_cache.record(ctx, sizes_cache.settled_key(ctx), started, asdict(figures))


def last_stats(ctx: RepoContext) -> tuple[Stats, float, float, bool] | None:
    """The last figures ``stats`` kept: (figures, when measured, seconds it took, whether
    nothing changed since), or None."""
    last = sizes_cache.read(ctx, Stats.__dataclass_fields__)
    if last is None:
        return None
    # sizes_cache.read keeps a record only when its fields are exactly Stats' (asked for above).
    figures = Stats(**last.figures)  # type: ignore[arg-type]
    return figures, last.measured, last.seconds, last.key == sizes_cache.state_key(ctx)


def _measure(ctx: RepoContext) -> Stats:
    store = ctx.store
    # Each object's size once (a stat per loose object, packed ones from their tables): the
    # unreferenced figure sums a subset of them.
    sizes = store.stored_sizes()
    kept = _kept(ctx)
    # gc's walk from the refs is the reachable set: not walked a second time.
    reachable = kept.reachable if kept is not None else ctx.graph.reachable_from(ctx.graph.tips())
    logical = sum(ctx.graph.read_commit(c, files=False).logical_bytes for c in reachable)
    temporaries = ctx.backend.temporary_sizes()
    # Replaced objects' old packed copies are on disk too, until their pack is rewritten.
    stored = sum(sizes.values()) + ctx.backend.superseded_bytes()
    figures = Stats(logical, stored, len(reachable), len(sizes), None, None, len(temporaries), sum(temporaries))
    if kept is None:
        return figures
    garbage = sizes.keys() - live_objects(ctx, kept)
    return replace(figures, unreferenced_bytes=sum(sizes[oid] for oid in garbage), unreferenced_objects=len(garbage))


def commit_sizes(ctx: RepoContext, oids: Iterable[ObjectId]) -> dict[ObjectId, CommitSizes]:
    """The per-commit figures of ``oids`` (one pass over the kept commits' objects)."""
    graph, store = ctx.graph, ctx.store
    kept = _kept(ctx)
    needs = _needs(ctx, kept) if kept is not None else {}
    holders: Counter[str] = Counter()
    for objects in needs.values():
        holders.update(objects)
    pruned = graph.pruned()
    out = {}
    for oid in oids:
        commit = graph.read_commit(oid)
        parent = next((p for p in kept_parents(commit.parents, pruned) if store.has(p)), None)
        new = stored_bytes(store, new_objects(graph.read_commit(parent) if parent else None, commit))
        held = _held_alone(ctx, kept, needs, holders, oid) if kept is not None else None
        out[oid] = CommitSizes(commit.logical_bytes, commit.added_bytes, new, held)
    return out


def _kept(ctx: RepoContext) -> Kept | None:
    """What plain gc keeps; None while a dependent repository cannot be opened."""
    try:
        return kept_commits(ctx, RetentionPolicy())
    except DependentNotFoundError:
        return None


def _held_alone(ctx: RepoContext, kept: Kept, needs: dict[str, set[str]], holders: Counter[str], oid: ObjectId) -> int:
    if oid not in kept.commits:
        return 0
    # Dropping a commit drops the in-repository overlay bases only it kept, unless they are
    # kept for their own sake: exactly what gc's kept_commits would decide without it.
    remaining = ctx.graph.with_overlay_bases(
        (kept.chosen - {oid}) | (kept.logged - kept.reachable - {oid}) | kept.pinned
    )
    dropped = kept.commits - remaining
    inside: Counter[str] = Counter()
    for commit in dropped:
        inside.update(needs[commit])
    return stored_bytes(ctx.store, (o for o, n in inside.items() if holders[o] == n))


def _needs(ctx: RepoContext, kept: Kept) -> dict[str, set[str]]:
    """Each kept commit's objects (itself, its chunks, their delta bases), and under the key ""
    what dependent repositories need: ``live_objects`` is the union of these sets."""
    graph = ctx.graph
    roots = {oid: {c.id for c in graph.read_commit(oid).all_chunks()} for oid in kept.commits}
    base = _delta_bases(ctx.store, set(kept.external).union(*roots.values()))
    out: dict[str, set[str]] = {oid: _with_bases(chunks, base) | {oid} for oid, chunks in roots.items()}
    out[""] = _with_bases(kept.external, base)
    return out


def _delta_bases(store: ObjectStore, chunks: set[str]) -> dict[str, tuple[str, ...]]:
    """Each object's delta bases (empty: whole or missing), for ``chunks`` and their bases: read
    once here, then closed over per commit by ``_with_bases``."""
    base: dict[str, tuple[str, ...]] = {}

    def read(oids: list[str]) -> Iterator[tuple[str, tuple[str, ...]]]:
        for oid, bases in store.bases_of_many(oids):
            base[oid] = bases
            yield oid, bases

    delta_closure_many(chunks, read)
    return base


def _with_bases(chunks: Iterable[str], base: dict[str, tuple[str, ...]]) -> set[str]:
    return delta_closure(chunks, lambda oid: base.get(oid, ()))
