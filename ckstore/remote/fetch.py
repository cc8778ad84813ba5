"""``fetch``, ``pull`` and ``clone``: bring a remote's commits and the objects they need here.

Every object is checked on arrival, before any ref names it: a commit is decoded and re-hashed
in memory as soon as its bytes come; its chunks (and the delta bases they need) are decoded and
re-hashed against their names as they arrive, by the one verified reader (reader.py), whatever
the pack's version (a version 2 entry's digest is checked as the bytes are read, but it comes
from the same party as the bytes: it proves they arrived intact, not that they are the object
named), and only then staged in rolling ``Backend.batch``es that
land on a background thread while later packs download (landing.py). A corrupt or truncated remote object
raises an IntegrityError naming the object and its pack. The commit objects are written last,
oldest first, once every batch landed, so the local invariant holds at every moment (a commit
present means its objects and its history are present) and an interrupted fetch resumes where
it stopped: a commit already here is never fetched again, and objects that landed are skipped.
Every later read decodes and verifies each object again (store.py), as does ``fsck``.

Remote-tracking refs ``refs/remotes/NAME/BRANCH`` (resolvable as ``NAME/BRANCH``) record each
remote branch as last seen; remote tags become local tags unless a local tag of that name exists.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ckstore.codecs.objects import Encoding
from ckstore.errors import (
    ConflictError,
    IntegrityError,
    InvalidInputError,
    InvalidRefNameError,
    ObjectMissingError,
    RefExistsError,
    RefNotFoundError,
)
from ckstore.format.ids import ObjectId
from ckstore.format.manifest import ChunkReader, Commit, decode_commit
from ckstore.format.settings import RepoConfig, version_for
from ckstore.remote.landing import Batches, Lander, read_objects
from ckstore.remote.layout import Located, RemoteRepo, pack_key, retry_when_gone
from ckstore.remote.names import add, open_remote, tracking_ref
from ckstore.repository.context import RepoContext, init_context
from ckstore.repository.reader import VerifiedReader, bounded_file_list_reader, verified_commit
from ckstore.repository.refs import DEFAULT_BRANCH, HEADS, REMOTES, TAGS, check_ref_name
from ckstore.repository.store import ObjectStore, object_key
from ckstore.repository.writing import writing
from ckstore.runtime.progress import ProgressBar, ProgressFactory
from ckstore.transport.awsconfig import endpoint_problem


@dataclass(frozen=True)
class SkippedRef:
    """A remote ref that fetch left alone, and why: ``damaged`` when the remote is broken there
    (the command fails, naming it), else a name this repository cannot hold (a warning)."""

    ref: str
    reason: str
    damaged: bool


@dataclass
class FetchReport:
    remote: str
    updated: list[tuple[str, ObjectId | None, ObjectId]] = field(default_factory=list)  # local ref, old, new
    commits: int = 0
    objects: int = 0
    bytes: int = 0  # object bytes transferred
    skipped: list[SkippedRef] = field(default_factory=list)

    def check(self) -> None:
        """Raise IntegrityError naming every ref skipped because the remote is damaged there
        (called once the refs that could move have moved, and the report was shown)."""
        damaged = [s for s in self.skipped if s.damaged]
        if damaged:
            raise IntegrityError(
                f"remote {self.remote}: {len(damaged)} ref(s) not fetched (the others were): "
                + "; ".join(f"{s.ref}: {s.reason}" for s in damaged)
            )

    progress: ProgressBar | None = field(default=None, repr=False, compare=False)  # the CLI's bar

    def received(self, n: int, objects: int = 0) -> None:
        self.bytes += n
        self.objects += objects
        if self.progress is not None:
            self.progress.update(n)


def verify_commit(oid: str, data: bytes | memoryview, where: str, read: ChunkReader | None = None) -> Commit:
    """The commit, every field verified; ``read`` reads a version-4 file list (format.md 5.3)."""
    try:
        return decode_commit(verified_commit(oid, data), read=read)
    except IntegrityError as exc:
        raise IntegrityError(f"commit {oid} from {where} is corrupt: {exc}") from None


def file_list_reader(store: ObjectStore, remote: RemoteRepo, where: Mapping[str, Located]) -> ChunkReader:
    """Reads a fetched commit's file list pieces, verified: from here when held here (a piece
    an earlier commit shares), else from the remote's packs. The pieces are then fetched with
    the commit's other chunks (they are in its ``all_chunks``): read twice, stored once."""

    def stored(oid: str, context: str) -> bytes | memoryview:
        if store.has_durable(oid):
            return store.read_raw(oid)
        if oid not in where:
            raise ObjectMissingError(f"object {oid}{context} is in no pack on remote {remote.name}")
        return next(iter(read_objects(remote, where, [oid])))[2]

    context = " (a file list piece)"
    return bounded_file_list_reader(lambda piece: stored(piece, context), VerifiedReader(stored), context)


def fetch_history(ctx: RepoContext, remote: RemoteRepo, tips: Sequence[ObjectId], report: FetchReport) -> set[ObjectId]:
    """Fetch every commit reachable from ``tips`` that is not here, with its objects; returns
    the tips no pack on the remote holds (nothing of their history is fetched).

    A tip is never "pruned": a ref value is fetched even when the remote's pruned record lists
    it (a push of an old epoch after a remote gc put it back), and is missing when no pack
    holds it (docs/format.md 15.6)."""
    store, graph = ctx.store, ctx.graph
    where = remote.holdings()
    theirs = remote.read_pruned()
    commits: dict[ObjectId, Commit] = {}
    stored: dict[ObjectId, bytes] = {}  # each commit's stored bytes, verified
    boundary: set[ObjectId] = set()  # parents the remote no longer has (its gc pruned them)
    wanted = [t for t in dict.fromkeys(tips) if not store.has_durable(t)]
    missing = {t for t in wanted if t not in where}
    frontier = [t for t in wanted if t not in missing]
    named = set(frontier)
    read_list = file_list_reader(store, remote, where)
    here: set[ObjectId] = set()  # commits here that fetched ones name: whole here, with all they need
    while frontier:
        # A pruned commit may still lie in a pack that holds live objects too: not fetched.
        present = [oid for oid in frontier if oid in where and (oid not in theirs or oid in named)]
        boundary.update(oid for oid in frontier if oid not in present)
        for oid, pack_id, data in read_objects(remote, where, present):
            commit = verify_commit(oid, data, remote.describe(pack_key(pack_id)), read_list)
            commits[ObjectId(oid)] = commit
            stored[ObjectId(oid)] = bytes(data)
            report.received(len(data))
        nxt = []
        for oid in boundary.intersection(frontier):  # the remote gc pruned it: history goes on with its parents
            for p in theirs.get(oid, ()):
                if p not in commits and p not in nxt and not store.has_durable(p):
                    nxt.append(ObjectId(p))
        for oid in present:
            c = commits[ObjectId(oid)]
            for p in [*c.parents, *([c.base.commit] if c.base is not None else [])]:
                if p in commits or p in nxt:
                    continue
                if store.has_durable(p):
                    here.add(p)
                else:
                    nxt.append(p)
        frontier = nxt
    if boundary:  # history continues through the remote gc's record of what it pruned
        pruned = graph.pruned()
        graph.write_pruned({**pruned, **{b: pruned.get(b, tuple(theirs.get(b, ()))) for b in boundary}})
    order = _oldest_first(commits)
    # Hashing, decoding and staging writes release the GIL: every core works while the next
    # packs download, and full batches land on another thread meanwhile.
    with ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="verify") as pool:
        batches = Batches(store)
        try:
            lander = Lander(store, batches, remote, where, pool, lambda n: report.received(n, objects=1))
            lander.on_newer_encoding = lambda encoding: _allow_encoding(ctx, encoding)
            # A file-list piece a commit here names holds the same entries: their chunks are here
            # with their bases (format.md 5.3), so only the other pieces' chunks are looked at.
            # Not an overlay's: its chunks may be its base repository's.
            pieces = {
                p.id
                for oid in here
                for c in [graph.read_commit(oid, files=False)]
                if c.base is None
                for p in c.file_list
            }
            for oid in order:
                lander.want_commit(oid, commits[oid], pieces, read_list)
            lander.run()
            batches.land_all()
        except BaseException:
            batches.abandon()
            raise
        batches.lander.shutdown()
    # The commits only once every object is durable, oldest first, each durable before the next:
    # a commit here always has its objects and its history.
    for oid in order:
        store.backend.put_if_absent(object_key(oid), stored[oid])
        graph.remember(oid, commits[oid])
        report.commits += 1
        report.objects += 1
    pruned = graph.pruned()
    if named & pruned.keys():  # fetched as a ref's value (an earlier fetch recorded it pruned): here now
        graph.write_pruned({o: p for o, p in pruned.items() if o not in named})
    return missing


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
            stack.extend(
                (p, False) for p in [*c.parents, *([c.base.commit] if c.base is not None else [])] if p not in done
            )
    return out


def _allow_encoding(ctx: RepoContext, encoding: Encoding) -> None:
    """A repository of format 2 or newer is upgraded before it holds an object whose encoding its
    version lacks: 4 for a predicted delta, 6 for a context-sorted one (docs/format.md)."""
    ctx.upgrade(version_for(encoding))


def fetch(ctx: RepoContext, remote_name: str | None = None, progress: ProgressFactory | None = None) -> FetchReport:
    """Fetch every ref of the remote that can be fetched; the report names those skipped (a
    damaged one: ``FetchReport.check`` raises for it once the caller has shown the report)."""
    # The writers' locks from the first landed object to the last tracking ref (writing.py):
    # a gc in between would delete what landed before any ref names it.
    with writing(ctx):
        return _fetch_locked(ctx, remote_name, progress)


def _fetch_locked(ctx: RepoContext, remote_name: str | None, progress: ProgressFactory | None) -> FetchReport:
    remote = open_remote(ctx, remote_name)
    report = FetchReport(remote.name)
    remote.require_format()
    problems: dict[str, str] = {}
    refs = remote.list_refs(problems)
    report.skipped += [SkippedRef(ref, why, damaged=True) for ref, why in sorted(problems.items())]
    for ref in list(refs):
        problem = _local_name_problem(ref)
        if problem:
            report.skipped.append(SkippedRef(ref, problem, damaged=False))
            del refs[ref]
    # The total is not known before the commits are read: the bar counts bytes and their rate.
    report.progress = progress(0, f"fetch {remote.name}") if progress else None
    try:
        # A pack deleted mid-fetch (a push superseded it: its objects are in other packs) makes
        # the fetch start again from the holdings as they are now; what landed is not fetched again.
        missing = retry_when_gone(lambda: fetch_history(ctx, remote, list(refs.values()), report), lambda: None)
    finally:
        if report.progress is not None:
            report.progress.close()
    for ref, oid in sorted(refs.items()):
        if oid in missing:
            report.skipped.append(
                SkippedRef(ref, f"it names commit {oid[:12]}, which no pack there holds", damaged=True)
            )
            continue
        local = tracking_ref(remote.name, ref)
        if local is None:
            if not ref.startswith(TAGS) or ctx.refs.read(ref) is not None:
                continue  # a local tag of that name wins, as in git
            local = ref
        old = ctx.refs.read(local)
        if old != oid:
            try:
                ctx.refs.update(local, oid, reason=f"fetch {remote.name}")
            except RefExistsError as exc:  # "exp" here and "exp/x" there, which S3 allows
                report.skipped.append(SkippedRef(ref, str(exc), damaged=False))
                continue
            report.updated.append((local, old, oid))
    # Branches deleted on the remote: their tracking refs go (the reflog keeps what they held).
    # A branch skipped above is still there: its tracking ref stays as last seen.
    prefix = f"{REMOTES}{remote.name}/"
    skipped = {s.ref for s in report.skipped}
    for branch in ctx.refs.list(prefix):
        if HEADS + branch not in refs and HEADS + branch not in skipped:
            ctx.refs.delete(prefix + branch, reason=f"fetch {remote.name}: gone from the remote")
    return report


def _local_name_problem(ref: str) -> str | None:
    """Why a remote branch or tag cannot become a ref here (``HEAD``, ``-x``: names the local
    rules forbid, which the CLI could then neither name nor delete), or None."""
    for prefix in (HEADS, TAGS):
        if ref.startswith(prefix):
            try:
                check_ref_name(ref[len(prefix) :], "branch" if prefix == HEADS else "tag")
            except InvalidRefNameError as exc:
                return str(exc)
    return None


def pull(
    ctx: RepoContext, remote_name: str | None = None, progress: ProgressFactory | None = None
) -> tuple[FetchReport, ObjectId | None, ObjectId | None]:
    """Fetch, then fast-forward the current branch to its remote-tracking ref; (report, old, new)."""
    with writing(ctx):
        return _pull_locked(ctx, remote_name, progress)


def _pull_locked(
    ctx: RepoContext, remote_name: str | None, progress: ProgressFactory | None
) -> tuple[FetchReport, ObjectId | None, ObjectId | None]:
    report = fetch(ctx, remote_name, progress)
    branch = ctx.refs.head_branch()
    theirs = ctx.refs.read(f"{REMOTES}{report.remote}/{branch}")
    if theirs is None:
        report.check()  # the branch may be there, damaged: say so rather than "no branch"
        raise RefNotFoundError(f"remote {report.remote} has no branch {branch!r}")
    ours = ctx.refs.read(HEADS + branch)
    # The fast-forward first: each walk stops where it finds the other commit, so the usual
    # pull costs the commits it brings, not the branch's whole history.
    behind = ours is None or ctx.graph.reaches(theirs, ours)
    if ours == theirs or (ours is not None and not behind and ctx.graph.reaches(ours, theirs)):
        return report, ours, ours  # up to date (or ahead)
    if not behind:
        raise ConflictError(
            f"branch {branch!r} and {report.remote}/{branch} have diverged; ckstore does not merge: "
            f"'ckstore reset {report.remote}/{branch}' takes theirs, 'ckstore push --force' keeps yours"
        )
    ctx.refs.update(HEADS + branch, theirs, expected=ours, reason=f"pull {report.remote}: fast-forward")
    return report, ours, theirs


CLONE_INCOMPLETE = "clone-incomplete"  # in a repository whose clone skipped refs: what to resume


def clone(
    url: str,
    path: str | os.PathLike[str],
    endpoint_url: str | None = None,
    config: RepoConfig | None = None,
    progress: ProgressFactory | None = None,
) -> tuple[RepoContext, FetchReport]:
    """A new repository at ``path`` with remote "origin", every remote branch as a local branch,
    and HEAD on "main" (or the first branch).

    A clone that fails outright (an error, Ctrl-C) removes what it made. One that could not fetch
    some refs (the remote is damaged there) keeps the branches it fetched and records
    ``clone-incomplete``; the same clone run again resumes into it: it fetches again, adds the
    branches that arrive now, and drops the record once nothing was skipped."""
    from ckstore.remote.names import RemoteSpec, open_spec

    # Refuse bad input, then an empty or foreign remote, before creating anything.
    problem = endpoint_problem(endpoint_url) if endpoint_url is not None else None
    if problem:
        raise InvalidInputError(problem)
    open_spec(RemoteSpec("origin", url, endpoint_url)).require_format()
    target = Path(path)
    record = json.dumps({"url": url, "endpoint_url": endpoint_url}, sort_keys=True).encode()
    resumed = _resumable(target, record)
    if resumed is not None:
        return resumed, _fill_clone(resumed, url, progress)
    existed = target.exists()
    ctx = init_context(path, config or RepoConfig())  # refuses a folder with anything in it: the rest is ours
    try:
        add(ctx, "origin", url, endpoint_url)
        ctx.backend.replace(CLONE_INCOMPLETE, record)
        report = _fill_clone(ctx, url, progress)
    except BaseException:
        _remove_failed_clone(target, existed)
        raise
    return ctx, report


def _resumable(target: Path, record: bytes) -> RepoContext | None:
    """The repository an earlier, incomplete clone of the same remote left at ``target``."""
    from ckstore.repository.context import open_context

    if not (target / CLONE_INCOMPLETE).is_file():
        return None
    ctx = open_context(target)
    try:
        if ctx.backend.get(CLONE_INCOMPLETE) == record:
            return ctx
    except KeyError:
        pass
    return None


def _fill_clone(ctx: RepoContext, url: str, progress: ProgressFactory | None) -> FetchReport:
    """Fetch "origin" and make each of its branches a local one (those not made yet)."""
    with writing(ctx):
        report = fetch(ctx, "origin", progress)
        branches = ctx.refs.list(f"{REMOTES}origin/")
        for branch, oid in branches.items():
            if ctx.refs.read(HEADS + branch) is None:
                ctx.refs.update(HEADS + branch, oid, expected=None, reason=f"clone: from {url}")
    if branches and ctx.refs.read(HEADS + ctx.refs.head_branch()) is None:
        ctx.refs.set_head_branch(DEFAULT_BRANCH if DEFAULT_BRANCH in branches else min(branches))
    if not any(s.damaged for s in report.skipped):
        ctx.backend.delete(CLONE_INCOMPLETE)
    return report


def _remove_failed_clone(target: Path, existed: bool) -> None:
    """What a failed clone made goes, as git does, so that running it again works: the folder,
    or only its contents when it existed before (empty: init refuses any other)."""
    if not existed:
        shutil.rmtree(target, ignore_errors=True)
        return
    for child in target.iterdir() if target.is_dir() else ():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
