"""Recording a commit: files or in-memory state → chunks → manifest → branch ref.

Write order, under the writers' locks (writing.py: this repository's shared lock and its base
repositories'): chunks (one durability batch), then the manifest,
then the branch ref by compare-and-swap. A crash at any point leaves the refs as they were plus,
at worst, unreferenced objects, which gc removes under the exclusive lock. When the ref moved
meanwhile (another trainer committed to the branch), the manifest is re-parented onto the new tip
and the swap retried: the objects are already stored.

Every commit goes through here, ``Repo``'s and the DCP writer's alike: ``prepare_commit`` checks
what the commit records besides its files before anything is stored, ``record_commit`` writes
the manifest, moves the ref and hands the commit to the background work (the compaction after
it: background.py). SIGINT is held back from the ref update to that hand-over, so an
interrupted commit either did not happen or is known to have happened.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

from ckstore.backend.syscalls import interrupts_deferred
from ckstore.errors import InvalidInputError, ObjectMissingError, RefChangedError, RefExistsError
from ckstore.format.dcp_record import DcpRecord
from ckstore.format.ids import ObjectId
from ckstore.format.manifest import BaseRef, Commit, FileEntry, StateFiles, encode_commit_parts
from ckstore.format.values import JSONValue, encode_value
from ckstore.repository.context import RepoContext
from ckstore.repository.overlay import merge_files
from ckstore.repository.refs import HEADS, check_ref_name
from ckstore.repository.writing import writing
from ckstore.runtime.progress import ProgressFactory, watching
from ckstore.write import hooks, provenance
from ckstore.write.background import work_for
from ckstore.write.ingest import MemoryFile, SourceFile, ingest

MAX_CAS_ATTEMPTS = 20


def now_iso() -> str:
    """The time a commit records: UTC, microseconds, a trailing Z."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


@dataclass(frozen=True)
class CommitRequest:
    """What a commit records besides its files, checked before anything is stored."""

    message: str
    branch: str | None  # None: the repository's current branch, decided when the ref is moved
    metadata: JSONValue  # typed-JSON encoded (values.py)
    start: ObjectId | None = None  # the parent when the branch does not exist yet; None: a root commit
    links: Mapping[str, str] = field(default_factory=dict)  # provenance the commit hooks add (hooks.py)

    def on_branch(self, ctx: RepoContext) -> CommitRequest:
        """This request with its branch decided now (the current branch when none was given)."""
        return self if self.branch is not None else replace(self, branch=ctx.refs.head_branch())

    def build(
        self,
        parent: ObjectId | None,
        branch: str,
        files: Sequence[FileEntry],
        added: int,
        recorded: Mapping[str, str],
        **extra: Any,
    ) -> Commit:
        """The commit this request makes on ``branch`` over ``parent`` (None: a root commit), its
        time taken now; ``extra``: the kind's own fields (state, base, dcp)."""
        return Commit(
            parents=(parent,) if parent else (),
            time=now_iso(),
            message=self.message,
            branch=branch,
            files=tuple(files),
            metadata=self.metadata,
            provenance=recorded,
            logical_bytes=sum(f.size for f in files),
            added_bytes=added,
            **extra,
        )


def prepare_commit(message: str, branch: str | None, metadata: Mapping[str, Any] | None) -> CommitRequest:
    """Refuse a bad branch name or metadata that cannot be stored, before any object is written."""
    meta = dict(metadata or {})
    for key in meta:
        if not isinstance(key, str):
            raise InvalidInputError(f"metadata keys must be strings, not {key!r}")
    checked = None if branch is None else check_ref_name(branch, "branch name")
    return CommitRequest(message, checked, encode_value(meta), links=hooks.links())


def commit_sources(
    ctx: RepoContext,
    sources: Sequence[SourceFile | MemoryFile],
    request: CommitRequest,
    progress: ProgressFactory | None = None,
    state: StateFiles | None = None,
    base: BaseRef | None = None,
) -> ObjectId:
    """Store ``sources`` and record them as one commit; return its id."""
    origin = provenance.start()
    with writing(ctx):
        # Read under the base's lock: a base gc that ran before it has deleted it or kept it.
        base_commit = _base_commit(ctx, base) if base is not None else None
        request = request.on_branch(ctx)
        assert request.branch is not None  # on_branch decided it
        # The relative change recorded for unchanged tensors is against the branch's tip now;
        # record_commit drops it if another writer moves the tip before this commit lands.
        tip = ctx.refs.read(HEADS + request.branch) or request.start
        previous = ctx.graph.read_commit(tip).files if tip else ()
        stats = {(f.path, t.name): t for f in previous for t in f.tensors}
        # An overlay's tensors are forward deltas against its base's (the base may live in
        # another repository and must not change); a branch's new chunks are stored fast, and
        # compaction (compact.py) re-encodes them and the parent's once the commit is durable.
        overlay = bool(base_commit and ctx.config.encoding.max_delta_depth)
        hints = base_commit.files if overlay and base_commit else None
        # One durability barrier for all of the commit's chunks; they are durable under their
        # names when the block ends, before the manifest is written (format.md §8).
        with (
            watching(progress, sum(s.size for s in sources), "commit") as advance,
            ctx.store.batch(sum(s.size for s in sources), len(sources)) as staged,
        ):
            files, added = ingest(
                staged,
                sources,
                ctx.config.chunk_size,
                advance,
                parent=hints,
                fast=base_commit is None,
                stats=stats,
            )
        if base_commit is not None:
            files = merge_files(base_commit, files)
        return record_commit(ctx, files, added, request, state, base, stats_parent=tip, origin=origin)


def without_change(files: Sequence[FileEntry]) -> list[FileEntry]:
    """The files with each tensor's recorded relative change cleared (it named another parent)."""
    return [
        replace(f, tensors=tuple(replace(t, stats=replace(t.stats, change=None)) if t.stats else t for t in f.tensors))
        for f in files
    ]


def _base_commit(ctx: RepoContext, base: BaseRef) -> Commit:
    if not ctx.store.has_durable(base.commit):
        raise ObjectMissingError(f"base commit {base.commit} is gone (deleted by gc in its repository)")
    return ctx.graph.read_commit(base.commit)


def _reflog_reason(parent: str | None, message: str) -> str:
    """git's wording: "commit: <first line>", "(initial)" for the first commit of a branch."""
    first = next((line.strip() for line in message.splitlines() if line.strip()), "")
    return f"commit{'' if parent else ' (initial)'}: {first}"


def record_commit(
    ctx: RepoContext,
    files: Sequence[FileEntry],
    added: int,
    request: CommitRequest,
    state: StateFiles | None = None,
    base: BaseRef | None = None,
    dcp: DcpRecord | None = None,
    stats_parent: str | None = None,
    origin: provenance.Pending | None = None,
) -> ObjectId:
    """Write the manifest and move the request's branch to it (objects must be stored already).

    ``stats_parent``: the commit the tensors' recorded relative change was measured against;
    ``origin``: the provenance, collected meanwhile (``provenance.start``).
    """
    branch = request.on_branch(ctx).branch
    assert branch is not None  # on_branch decided it
    ref = HEADS + branch
    recorded = origin.result() if origin is not None else provenance.collect()  # runs git: once, not per retry
    recorded = {**recorded, **request.links}
    for _ in range(MAX_CAS_ATTEMPTS):
        current = ctx.refs.read(ref)
        parent = current or request.start  # a new branch starts at ``start`` (git's checkout -b)
        if parent != stats_parent:
            files = without_change(files)
        commit = request.build(parent, branch, files, added, recorded, state=state, base=base, dcp=dcp)
        manifest, pieces = encode_commit_parts(commit)
        if pieces:  # a large file list (format.md 5.3): its chunks are durable before the manifest
            with ctx.store.batch(sum(len(p) for _, p in pieces), len(pieces)) as view:
                for _, piece in pieces:
                    view.put_file_list_piece(piece)
            commit = replace(commit, file_list=tuple(ref for ref, _ in pieces))
        oid = ctx.store.put_commit(manifest).id
        with interrupts_deferred():
            try:
                ctx.refs.update(ref, oid, expected=current, reason=_reflog_reason(parent, request.message))
            except RefChangedError:
                continue  # another writer advanced the branch: re-parent onto its commit, as documented
            except RefExistsError:
                if ctx.refs.read(ref) is None:
                    raise  # a name conflict ("a" vs "a/b"), not a race
                continue  # another writer created the branch first: re-parent onto its commit
            if ctx.refs.read(HEADS + ctx.refs.head_branch()) is None and branch != ctx.refs.head_branch():
                ctx.refs.set_head_branch(branch, reason="commit")
            ctx.graph.remember(oid, commit)
            # An overlay's chunks are forward deltas against its base's already: nothing to compact.
            work_for(ctx).commit_recorded(ctx, oid, branch, compact=base is None)
        hooks.announce(hooks.Recorded(oid, commit, ctx.path))
        return oid
    raise RefChangedError(f"branch {branch!r} kept moving; commit not recorded")
