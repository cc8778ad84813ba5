"""Repository checking: refs resolve, manifests parse, referenced objects exist (and decode).

Each problem is one line naming the damaged ref or object and, for a chunk, the commit, file and
tensor that need it. A damaged object is reported once, however many commits share it.

An overlay whose base repository does not open (it moved) cannot tell the base's objects from
lost ones: every object it does not find here is counted on the one line naming that base and
``relink``, not listed, and such a result is "not found" (exit 3), not "corrupt" (exit 4).
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from ckstore.errors import CkstoreError
from ckstore.format.ids import ObjectId
from ckstore.format.pruned import Pruned
from ckstore.repository.context import RepoContext
from ckstore.repository.graph import ROOT_PREFIXES, kept_parents
from ckstore.repository.overlay import link_problems, unreachable_bases
from ckstore.repository.store import MAX_CHAIN_DEPTH, ObjectStore
from ckstore.runtime.pipeline import ordered_map
from ckstore.runtime.progress import ProgressFactory, watching


def _read_headers(store: ObjectStore, oids: list[str]) -> dict[str, tuple[str, ...] | CkstoreError]:
    """Each object's delta bases, or why they cannot be read (store.bases_or_errors: packs read
    whole, loose objects ``HEADER_READERS`` at a time)."""
    return dict(store.bases_or_errors(oids))


def _check_bases(
    store: ObjectStore,
    chunks: list[str],
    present: AbstractSet[str],
    needed: dict[str, tuple[int, str]],
    unchecked: set[str] | None = None,
) -> list[str]:
    """Every delta's bases exist and its chains end in whole objects within the depth limit; with
    ``unchecked`` (a base repository is unreachable), a missing delta base is added to it instead."""
    problems: list[str] = []
    headers = _read_headers(store, chunks)
    depth_of: dict[str, int] = {}  # objects whose chains are known to be sound
    for start in chunks:
        # Depth-first over the bases; ``path`` is the chain from ``start`` to the object visited.
        path: list[str] = []
        stack: list[tuple[str, list[str]]] = []
        oid = start
        while True:
            if oid in depth_of:
                pass
            elif oid in path or len(path) > MAX_CHAIN_DEPTH:
                problems.append(
                    f"object {start} ({needed[start][1]}): delta chain is cyclic or longer than {MAX_CHAIN_DEPTH}"
                )
                break
            elif oid not in present and not store.has(oid):  # an overlay's base may be in a base repository
                if unchecked is not None:
                    unchecked.add(oid)
                else:
                    problems.append(
                        f"object {path[-1] if path else start} is a delta of missing object {oid} ({needed[start][1]})"
                    )
                break
            else:
                try:
                    known = headers[oid] if oid in headers else store.bases_of(oid)
                    if isinstance(known, CkstoreError):
                        raise known
                    bases = list(known)
                except CkstoreError as exc:
                    problems.append(str(exc))
                    break
                path.append(oid)
                stack.append((oid, bases))
            # Next: a base still to visit, or the deepest object whose bases are all known.
            while stack and not [b for b in stack[-1][1] if b not in depth_of]:
                done, bases = stack.pop()
                path.pop()
                depth_of[done] = 1 + max(depth_of[b] for b in bases) if bases else 0
            if not stack:
                break
            oid = next(b for b in stack[-1][1] if b not in depth_of)
    return problems


class Problems(list[str]):
    """fsck's problem lines; ``unreachable_bases`` of them name a base repository that does not
    open (the objects it holds are then not checked)."""

    unreachable_bases: int = 0

    @property
    def only_unreachable_bases(self) -> bool:
        return bool(self) and len(self) == self.unreachable_bases


@dataclass
class _Walk:
    """What fsck gathers as it goes: problems, and the objects a base it cannot reach may hold."""

    lost_bases: list[str]
    problems: list[str] = field(default_factory=list)
    unchecked: set[str] = field(default_factory=set)  # not here while a base is unreachable: maybe in it
    needed: dict[str, tuple[int, str]] = field(default_factory=dict)  # chunk id -> (raw size, where used)
    seen: set[str] = field(default_factory=set)  # commits read (and so verified)


def check(ctx: RepoContext, read_data: bool = False, progress: ProgressFactory | None = None) -> Problems:
    walk = _Walk(unreachable_bases(ctx))
    # Check what is on disk now: commits read earlier are cached, and a cached copy would hide
    # a commit object deleted or damaged since.
    ctx.graph.cache.clear()
    pruned, starts = _refs_and_logs(ctx, walk)
    _walk_commits(ctx, walk, pruned, starts)
    present = set(ctx.store.iter_ids())
    chain_problems = _check_presence(ctx, walk, present)
    if read_data:
        failed = _read_everything(ctx, walk, present, progress)
        # A damaged object is reported once: its read failure names its file and tensor.
        walk.problems.extend(p for p in chain_problems if p.split(" ", 2)[1] not in failed)
        walk.problems.extend(failed.values())
    else:
        walk.problems.extend(chain_problems)
    problems = walk.problems
    if walk.unchecked:
        note = (
            f"; {len(walk.unchecked)} object(s) this repository uses are not here and are checked once the base "
            "is reachable again"
        )
        problems = [p + note if p in walk.lost_bases else p for p in problems]
    result = Problems(problems)
    result.unreachable_bases = sum(1 for p in problems if p.startswith("base repository unreachable: "))
    return result


def _refs_and_logs(ctx: RepoContext, walk: _Walk) -> tuple[Pruned, list[tuple[ObjectId, str]]]:
    """The pruned record and the commits to walk from (with how each was reached): the reflogs'
    first, then the refs', so that damage both reach is named from a ref (the walk is a stack)."""
    problems = walk.problems
    try:
        pruned = ctx.graph.pruned()
    except CkstoreError as exc:
        problems.append(str(exc))
        pruned = {}
    try:
        ctx.refs.head_branch()
    except CkstoreError as exc:
        problems.append(str(exc))
    problems.extend(link_problems(ctx))  # each names the relink command that repairs it
    logged, reflog_problems = ctx.refs.logs.check()
    problems.extend(reflog_problems)
    tips: list[tuple[str, ObjectId]] = []
    for prefix in ROOT_PREFIXES:
        for key, ref in ctx.refs.entries(prefix):
            try:
                if ref is None:
                    raise ctx.refs.stray_error(key)
                oid = ctx.refs.read(ref)
            except CkstoreError as exc:
                problems.append(str(exc))
                continue
            if oid is not None:
                tips.append((ref, oid))
    # Commits the reflog names are kept by gc and restorable, so they must be whole too.
    starts = [(oid, f"reflog of {ref}; 'ckstore gc' drops entries whose commits are gone") for ref, oid in logged]
    return pruned, starts + [(oid, f"ref {key}") for key, oid in tips]


def _walk_commits(ctx: RepoContext, walk: _Walk, pruned: Pruned, todo: list[tuple[ObjectId, str]]) -> None:
    """Read every commit reachable from ``todo`` (verified as read) and note the chunks each uses."""
    graph, store, needed = ctx.graph, ctx.store, walk.needed
    while todo:
        oid, via = todo.pop()
        if oid in walk.seen:
            continue
        walk.seen.add(oid)
        try:
            commit = graph.read_commit(oid)
        except CkstoreError as exc:
            walk.problems.append(f"{exc} (reached from {via})")
            continue
        if commit.base is not None:
            if commit.base.repo is None:
                todo.append((commit.base.commit, f"overlay commit {oid[:12]}"))
            elif not store.has(commit.base.commit):
                if walk.lost_bases:
                    walk.unchecked.add(commit.base.commit)
                else:
                    walk.problems.append(
                        f"commit {oid}: base commit {commit.base.commit} in {commit.base.repo} is unreachable"
                    )
        for parent in kept_parents(commit.parents, pruned):  # walk on to the older commits gc kept
            if parent not in walk.seen:
                todo.append((parent, f"commit {oid[:12]}"))
        for chunk in commit.file_list:  # read (verified) with the commit already; kept as any chunk
            needed.setdefault(chunk.id, (chunk.size, f"commit {oid[:12]}, its file list"))
        for f in commit.files:
            for chunk in f.header + f.chunks:
                needed.setdefault(chunk.id, (chunk.size, f"commit {oid[:12]}, file {f.path!r}"))
            for t in f.tensors:
                for chunk in t.chunks:
                    needed.setdefault(chunk.id, (chunk.size, f"commit {oid[:12]}, file {f.path!r}, tensor {t.name!r}"))


def _check_presence(ctx: RepoContext, walk: _Walk, present: AbstractSet[str]) -> list[str]:
    """Note every needed object that is missing; return the problems of the delta chains."""
    store, needed = ctx.store, walk.needed
    walk.problems.extend(ctx.backend.storage_problems())  # a damaged pack: its objects read as missing below
    for obj, (_, where) in sorted(needed.items()):
        if obj not in present and not store.has(obj):
            if walk.lost_bases:
                walk.unchecked.add(obj)
            else:
                walk.problems.append(f"object {obj} is missing ({where})")
    return _check_bases(
        store,
        [obj for obj in sorted(needed) if obj in present],
        present,
        needed,
        walk.unchecked if walk.lost_bases else None,
    )


def _read_everything(
    ctx: RepoContext, walk: _Walk, present: AbstractSet[str], progress: ProgressFactory | None
) -> dict[str, str]:
    """Decode and re-hash every object here and every needed one a base repository holds; the
    failures by object."""
    store, needed = ctx.store, walk.needed

    def verify(oid: str) -> str | None:
        try:
            if oid in needed:
                size, where = needed[oid]
                store.get_chunk(oid, size, f" ({where})")
            elif oid not in walk.seen:  # commits were verified when read
                store.verify(oid)
        except CkstoreError as exc:
            return str(exc)
        return None

    elsewhere = {obj for obj in needed if obj not in present and store.has(obj)}  # in base repos
    order = sorted(present | elsewhere)
    sizes = [store.stored_size(obj) or 0 for obj in order]  # objects of base repositories count there
    failed = {}
    with watching(progress, sum(sizes), "fsck") as advance:
        for obj, size, problem in zip(order, sizes, ordered_map(verify, order)):
            if problem:
                failed[obj] = problem
            advance(size)
    return failed
