"""What gc keeps: the commits (``kept_commits``: branches and tags, or what a retention policy
selects there, unexpired reflog entries with their history, overlays' bases) and every object they
need (``live_objects``). gc deletes the rest; ``stats``, ``status`` and ``log --sizes`` compute
their "unreferenced" and "held alone" figures from the same two functions (sizes.py), so what they
say gc would free is what it frees.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ckstore.errors import CkstoreError, IntegrityError
from ckstore.format.ids import ObjectId
from ckstore.format.manifest import piece_chunk_ids
from ckstore.maintenance.retention import RetentionPolicy, Selection, select
from ckstore.repository.context import RepoContext
from ckstore.repository.overlay import external_needs
from ckstore.repository.reflog import HEAD_LOG, Entry, Expiry, surviving
from ckstore.repository.refs import HEADS


@dataclass(frozen=True)
class Kept:
    """The commits gc keeps, and why; what they need is ``live_objects``."""

    reachable: set[ObjectId]  # from branches and tags
    chosen: set[ObjectId]  # kept by the policy (without one: every reachable commit)
    pinned: set[ObjectId]  # needed by dependent (overlay) repositories, whatever the policy
    logged: set[ObjectId]  # named by unexpired reflog entries, with their history
    commits: set[ObjectId]  # chosen + reflog-only + pinned + the in-repository bases of kept overlays
    external: set[str]  # local objects that dependent repositories need
    logs: dict[str, list[Entry]] = field(default_factory=dict)  # every reflog, as read
    alive: dict[str, list[Entry]] = field(default_factory=dict)  # the entries that survive expiry
    selection: Selection | None = None  # what the policy decided (None without a policy)


def kept_commits(ctx: RepoContext, policy: RetentionPolicy, prune_now: bool = False) -> Kept:
    graph, store = ctx.graph, ctx.store
    reachable = graph.reachable_from(graph.tips())
    logs = ctx.refs.logs.read_all()
    alive = _surviving_reflogs(ctx, logs, prune_now)
    # An entry keeps both its values while they exist; its old one may be gone (pruned earlier).
    named, pruned = {i for entries in alive.values() for e in entries for i in e.ids}, graph.pruned()
    logged = graph.reachable_from({i for i in named if i not in pruned and store.has(i)})
    selection = select(graph, policy) if policy.active else None
    chosen = selection.kept if selection is not None else set(reachable)
    needed_commits, needed_objects = external_needs(ctx)
    pinned = {c for c in needed_commits if store.has_local(c)}
    # A retention policy thins branches, not what only the reflog holds.
    commits = graph.with_overlay_bases(chosen | (logged - reachable) | pinned)
    # An entry whose value this run deletes (a policy pruned it) goes with it; one whose old
    # value alone goes stays, as in git (the surviving tip keeps its reflog).
    alive = {ref: [e for e in entries if e.value in commits] for ref, entries in alive.items()}
    external = {c for c in needed_objects if store.has_local(c)}
    return Kept(reachable, chosen, pinned, logged, commits, external, logs, alive, selection)


def live_objects(ctx: RepoContext, kept: Kept) -> set[str]:
    """Every object the kept commits need: themselves, their chunks, and kept deltas' bases."""
    chunks = set(kept.external)
    pieces: set[str] = set()
    for oid in kept.commits:
        chunks.update(commit_chunk_ids(ctx, oid, pieces))
    return ctx.store.with_delta_bases(chunks) | kept.commits


def commit_chunk_ids(ctx: RepoContext, oid: str, skip: set[str] | None = None) -> list[str]:
    """The ids of every chunk commit ``oid`` needs. A version-4 file list (docs/format.md 5.3)
    is read for its ids alone (``piece_chunk_ids``: at 10^6 files, parsing each entry whole was
    half of gc), and a piece in ``skip`` (one read before: commits share most pieces) is not
    read again; each piece read is added to ``skip``."""
    graph = ctx.graph
    commit = graph.read_commit(oid, files=False)
    if not commit.file_list:
        return [c.id for c in commit.all_chunks()]  # in the manifest: parsed (and validated) whole
    read = graph.file_list_reader(oid)
    out: list[str] = []
    for piece in commit.file_list:
        out.append(piece.id)
        if skip is not None and piece.id in skip:
            continue
        try:
            out.extend(piece_chunk_ids(read(piece)))
        except IntegrityError as exc:
            raise IntegrityError(f"commit {oid}: {exc}") from None
        if skip is not None:
            skip.add(piece.id)
    return out


def _surviving_reflogs(ctx: RepoContext, logs: dict[str, list[Entry]], prune_now: bool) -> dict[str, list[Entry]]:
    """Each ref's reflog entries that survive expiry (reflog.surviving): reachability is judged
    from the ref's current value, as git does; a deleted ref reaches nothing."""
    config, graph, refs = ctx.config, ctx.graph, ctx.refs
    expiry = Expiry.from_days(config.reflog_expire_days, config.reflog_expire_unreachable_days, prune_now)
    pruned = graph.pruned()
    history: dict[ObjectId | None, set[ObjectId]] = {None: set()}
    present: dict[ObjectId, bool] = {}

    def exists(oid: ObjectId) -> bool:
        # Presence only: a commit that is there but unreadable stops gc when its history is
        # walked, as any kept commit would, rather than being dropped as stale.
        if oid not in present:
            present[oid] = oid not in pruned and ctx.store.has(oid)
        return present[oid]

    out = {}
    for ref, entries in logs.items():
        tip = _head_commit(ctx) if ref == HEAD_LOG else refs.read(ref)
        if tip not in history:
            history[tip] = graph.reachable_from([tip]) if tip is not None else set()
        out[ref] = surviving(entries, history[tip].__contains__, exists, expiry)
    return out


def _head_commit(ctx: RepoContext) -> ObjectId | None:
    try:
        return ctx.refs.read(HEADS + ctx.refs.head_branch())
    except CkstoreError:
        return None  # a damaged HEAD reaches nothing: its entries expire as unreachable ones
