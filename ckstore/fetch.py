"""``fetch``, ``pull`` and ``clone``: bring a remote's commits and the objects they need here.

Every object is verified on arrival, before any ref names it: a commit is decoded and re-hashed
in memory as soon as its bytes come; its chunks (and the delta bases they need) are staged with
in a ``Backend.batch`` and each is decoded and re-hashed there, so a corrupt or truncated remote
object raises an IntegrityError naming the object and its pack and nothing of that batch lands.
Commits land oldest first in groups of about LAND_GROUP bytes, each commit object written only
after its group's batch made every object it needs durable, so the local invariant holds at every moment (a commit present means its objects are
present) and an interrupted fetch resumes where it stopped: a commit already here is never
fetched again.

Remote-tracking refs ``refs/remotes/NAME/BRANCH`` (resolvable as ``NAME/BRANCH``) record each
remote branch as last seen; remote tags become local tags unless a local tag of that name exists.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from .codec import Kind, decode, delta_base
from .config import RepoConfig
from .context import RepoContext, init_context
from .errors import CkstoreError, ConflictError, IntegrityError, RefNotFoundError
from .ids import ObjectId, commit_id
from .manifest import Commit, decode_commit
from .refs import HEADS, TAGS
from .remote.layout import Located, RemoteRepo, pack_key
from .remotes import TRACKING, add, open_remote, tracking_ref
from .store import MAX_COMMIT_SIZE, ObjectStore, object_key

READ_WORKERS = 4
# Commits land in batches of about this many fetched bytes: each batch costs two durability
# barriers, and an interrupted fetch loses at most the batch in flight.
LAND_GROUP = 256 << 20


@dataclass
class FetchReport:
    remote: str
    updated: list[tuple[str, ObjectId | None, ObjectId]] = field(default_factory=list)  # local ref, old, new
    commits: int = 0
    objects: int = 0
    bytes: int = 0  # object bytes transferred


def read_objects(remote: RemoteRepo, where: dict[str, Located], oids: Iterable[str]) -> Iterator[tuple[str, str, bytes]]:
    """(object id, pack id, stored bytes) of each object, by ranged reads grouped per pack; a few
    packs are read at once, so memory stays a few packs' worth of wanted ranges."""
    by_pack: dict[str, list[Located]] = {}
    for oid in dict.fromkeys(oids):
        loc = where[oid]
        by_pack.setdefault(loc.pack_id, []).append(loc)

    def read(pack_id: str) -> list[tuple[str, bytes]]:
        return [(e.id, data) for e, data in remote.read_objects(pack_id, [loc.entry for loc in by_pack[pack_id]])]

    pending: list[tuple[str, Future[list[tuple[str, bytes]]]]] = []
    with ThreadPoolExecutor(READ_WORKERS) as pool:
        packs = iter(by_pack)
        for pack_id in packs:
            pending.append((pack_id, pool.submit(read, pack_id)))
            while len(pending) >= READ_WORKERS:
                done_id, fut = pending.pop(0)
                for oid, data in fut.result():
                    yield oid, done_id, data
        for done_id, fut in pending:
            for oid, data in fut.result():
                yield oid, done_id, data


def verify_commit(oid: str, data: bytes, where: str) -> Commit:
    try:
        raw = decode(data, Kind.COMMIT, MAX_COMMIT_SIZE)
        if commit_id(raw) != oid:
            raise IntegrityError("its bytes do not hash to its name")
        return decode_commit(raw)
    except IntegrityError as exc:
        raise IntegrityError(f"commit {oid} from {where} is corrupt: {exc}") from None


def fetch_history(ctx: RepoContext, remote: RemoteRepo, tips: Sequence[ObjectId], report: FetchReport) -> None:
    """Fetch every commit reachable from ``tips`` that is not here, with its objects."""
    store, graph = ctx.store, ctx.graph
    remote.catalogue()
    where = remote.locate(exclude=remote.read_condemned().claimed())
    theirs = remote.read_pruned()
    commits: dict[ObjectId, Commit] = {}
    stored: dict[ObjectId, bytes] = {}  # each commit's stored bytes, verified
    boundary: set[ObjectId] = set()  # parents the remote no longer has (its gc pruned them)
    frontier: list[ObjectId] = [t for t in dict.fromkeys(tips) if not store.has(t)]
    for tip in frontier:
        if tip not in where:
            raise IntegrityError(f"remote {remote.name}: a ref names commit {tip}, which no pack there holds")
    while frontier:
        # A pruned commit may still lie in a pack that holds live objects too: not fetched.
        present = [oid for oid in frontier if oid in where and oid not in theirs]
        boundary.update(oid for oid in frontier if oid not in present)
        for oid, pack_id, data in read_objects(remote, where, present):
            commit = verify_commit(oid, data, remote.describe(pack_key(pack_id)))
            commits[ObjectId(oid)] = commit
            stored[ObjectId(oid)] = data
            report.bytes += len(data)
        nxt = []
        for oid in frontier:  # a commit the remote gc pruned: history goes on with its parents
            for p in theirs.get(oid, ()):
                if p not in commits and p not in nxt and not store.has(p):
                    nxt.append(ObjectId(p))
        for oid in present:
            c = commits[ObjectId(oid)]
            for p in [*c.parents, *([c.base.commit] if c.base is not None else [])]:
                if p not in commits and p not in nxt and not store.has(p):
                    nxt.append(p)
        frontier = nxt
    if boundary:  # history continues through the remote gc's record of what it pruned
        pruned = graph.pruned()
        graph.write_pruned({**pruned, **{b: pruned.get(b, tuple(theirs.get(b, ()))) for b in boundary}})
    order = _oldest_first(commits)
    while order:
        # A group of commits lands in one batch (two durability barriers): all of it or none.
        landed, group = report.bytes, []
        with store.batch() as view:
            while order and report.bytes - landed < LAND_GROUP:
                oid = order.pop(0)
                _land_commit(ctx, view, remote, where, oid, commits[oid], report)
                group.append(oid)
        # The commits only once their objects are durable (a batch lands in no set order).
        for oid in group:
            store.backend.put_if_absent(object_key(oid), stored[oid])
            graph.remember(oid, commits[oid])
            report.commits += 1
            report.objects += 1


def _oldest_first(commits: dict[ObjectId, Commit]) -> list[ObjectId]:
    out: list[ObjectId] = []
    done: set[ObjectId] = set()
    for start in commits:
        stack = [(start, False)]
        while stack:
            oid, expanded = stack.pop()
            if oid in done or oid not in commits:
                continue
            if expanded:
                done.add(oid)
                out.append(oid)
                continue
            stack.append((oid, True))
            c = commits[oid]
            stack.extend((p, False) for p in [*c.parents, *([c.base.commit] if c.base is not None else [])] if p not in done)
    return out


def _land_commit(ctx: RepoContext, view: ObjectStore, remote: RemoteRepo, where: dict[str, Located], oid: ObjectId,
                 commit: Commit, report: FetchReport) -> None:
    """The objects of one commit into the batch ``view``: its missing chunks and their delta
    bases, each decoded and re-hashed there (the commit itself lands after the batch)."""
    origin: dict[str, str] = {}
    chunks = {c.id for c in commit.all_chunks()}
    todo = [c for c in chunks if not view.has(c)]
    todo += _missing_bases(view, chunks - set(todo))
    while todo:
        absent = [o for o in dict.fromkeys(todo) if o not in origin and not view.has(o)]
        for o in absent:
            if o not in where:
                raise IntegrityError(f"remote {remote.name}: object {o} (needed by commit {oid[:12]}) is in no pack there")
        todo = []
        for o, pack_id, data in read_objects(remote, where, absent):
            origin[o] = pack_id
            report.bytes += len(data)
            report.objects += 1
            view.backend.put_if_absent(object_key(o), data)
            try:
                base = delta_base(data)
            except IntegrityError as exc:
                raise IntegrityError(f"object {o} from {remote.describe(pack_key(pack_id))} is corrupt: {exc}") from None
            if base is not None and base not in origin:
                # A base already here may itself lack its base (see _missing_bases).
                todo.extend(_missing_bases(view, {base}) if view.has(base) else [base])
    def verify(item: tuple[str, str]) -> None:
        o, pack_id = item
        try:
            view.verify(o)
        except CkstoreError as exc:
            raise IntegrityError(f"{exc} (fetched from {remote.describe(pack_key(pack_id))})") from None

    # Decoding and hashing release the GIL: every core verifies.
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(verify, origin.items()))


def _missing_bases(view: ObjectStore, present: set[str]) -> list[str]:
    """Delta bases that objects already here lack: a crash while an earlier fetch's batch was
    landing can leave an object in place without its base (and without any commit naming it)."""
    missing: list[str] = []
    seen = set(present)
    todo = list(present)
    while todo:
        base = view.base_of(todo.pop())
        if base is None or base in seen:
            continue
        seen.add(base)
        if view.has(base):
            todo.append(base)
        else:
            missing.append(base)
    return missing


def fetch(ctx: RepoContext, remote_name: str | None = None) -> FetchReport:
    remote = open_remote(ctx, remote_name)
    report = FetchReport(remote.name)
    remote.require_format()
    refs = remote.list_refs()
    fetch_history(ctx, remote, list(refs.values()), report)
    for ref, oid in sorted(refs.items()):
        local = tracking_ref(remote.name, ref)
        if local is None:
            if not ref.startswith(TAGS) or ctx.refs.read(ref) is not None:
                continue  # a local tag of that name wins, as in git
            local = ref
        old = ctx.refs.read(local)
        if old != oid:
            ctx.refs.update(local, oid, reason=f"fetch {remote.name}")
            report.updated.append((local, old, oid))
    # Branches deleted on the remote: their tracking refs go (the reflog keeps what they held).
    prefix = f"{TRACKING}{remote.name}/"
    for branch in ctx.refs.list(prefix):
        if HEADS + branch not in refs:
            ctx.refs.delete(prefix + branch, reason=f"fetch {remote.name}: gone from the remote")
    return report


def pull(ctx: RepoContext, remote_name: str | None = None) -> tuple[FetchReport, ObjectId | None, ObjectId | None]:
    """Fetch, then fast-forward the current branch to its remote-tracking ref; (report, old, new)."""
    report = fetch(ctx, remote_name)
    branch = ctx.refs.head_branch()
    theirs = ctx.refs.read(f"{TRACKING}{report.remote}/{branch}")
    if theirs is None:
        raise RefNotFoundError(f"remote {report.remote} has no branch {branch!r}")
    ours = ctx.refs.read(HEADS + branch)
    if ours == theirs or (ours is not None and theirs in ctx.graph.reachable_from([ours])):
        return report, ours, ours  # up to date (or ahead)
    if ours is not None and ours not in ctx.graph.reachable_from([theirs]):
        raise ConflictError(
            f"branch {branch!r} and {report.remote}/{branch} have diverged; ckstore does not merge: "
            f"'ckstore reset {report.remote}/{branch}' takes theirs, 'ckstore push --force' keeps yours"
        )
    ctx.refs.update(HEADS + branch, theirs, expected=ours, reason=f"pull {report.remote}: fast-forward")
    return report, ours, theirs


def clone(url: str, path: str | os.PathLike[str], endpoint_url: str | None = None,
          config: RepoConfig | None = None) -> tuple[RepoContext, FetchReport]:
    """A new repository at ``path`` with remote "origin", every remote branch as a local branch,
    and HEAD on "main" (or the first branch)."""
    from .remotes import RemoteSpec, open_spec

    # Refuse an empty or foreign remote before creating anything.
    open_spec(RemoteSpec("origin", url, endpoint_url)).require_format()
    ctx = init_context(path, config or RepoConfig())
    add(ctx, "origin", url, endpoint_url)
    report = fetch(ctx, "origin")
    branches = ctx.refs.list(f"{TRACKING}origin/")
    for branch, oid in branches.items():
        ctx.refs.update(HEADS + branch, oid, expected=None, reason=f"clone: from {url}")
    if branches:
        ctx.refs.set_head_branch("main" if "main" in branches else min(branches))
    return ctx, report
