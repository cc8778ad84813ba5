"""Compaction on the remote: the previous save's chunks become deltas of a new commit's, on the
remote itself, without any machine holding the history locally.

Local compaction re-encodes a commit's parent as reverse deltas of the commit (compaction/).
A commit that reached the remote some other way than a push from a compacted repository — a
DCP save whose ranks uploaded their pieces straight to object storage, a push from a machine that
never compacted — leaves the remote holding every save whole. ``compact_remote`` brings such a
remote to what a local repository that compacted the same history holds:

1. it opens a scratch repository (a temporary folder) whose store reads what it lacks from the
   remote, lazily, one ranged read per object (``lazy.RemoteObjects``; every object decoded and
   re-hashed as it arrives), through ``cache`` when given: a folder of objects kept between calls
   (a node-local disk), which each run leaves holding only what the next run reads again, the
   commit's chunks (its parent's then), so the parent's are not downloaded again and the folder
   holds one save's worth, not the history's;
2. it runs local compaction's tip pair on the commit and its first parents
   (``compaction.compact.compact_commits``: positions paired by file and tensor name, else by
   tensor name, so a DCP piece ``<fqn>@<offsets>`` pairs with the previous save's piece of the
   same name and offsets whichever rank wrote it; predicted deltas for AdamW weights and
   second moments; chain depths counted on the remote's stored headers), restricted to
   ``paths`` when given (one rank compacting only its own file);
3. it reads the other objects of every remote pack that holds a re-encoded object, then sends
   again, verified like a push, the objects of each such pack that it now stores in at least
   10% less (``supersede.resend_and_replace``: remote repack's rule), and deletes at once the
   packs those copies strictly supersede, or condemns them when they are superseded otherwise,
   by the rule of pushes (docs/format.md 15.9, "Supersession by push"): safe against concurrent
   readers (they read the holdings again when a pack they located is gone), pushers and other
   compactions (copies are only deleted for strictly smaller ones or for ones sent after the
   deleted pack existed);
4. it also sweeps what earlier pushes or compactions condemned at least ``grace`` ago.

Only the commit, its first parents' commit objects (for the chain depths) and the chunks of the
positions compacted are read: two saves' worth at most, one rank's file's when ``paths`` names
it. The refs are not touched, and nothing needs a lock: a run killed at any point leaves every
object readable (new packs before any deletion; a deletion only of packs whose every object is
held elsewhere), and the next run, or the next push, finishes it.

Interface, for a caller such as a DCP writer's coordinator or each of its ranks::

    from ckstore.remote.compaction import compact_remote, open_url
    remote = open_url("s3://bucket/prefix", endpoint_url=None)   # AWS settings from the environment
    report = compact_remote(remote, commit_id)                   # the whole commit, from one machine
    report = compact_remote(remote, commit_id, paths=["dcp/rank-00001.safetensors"],
                            cache="/local/ckstore-cache")         # one rank's file, per rank

``commit_id`` must be on the remote with its parent (a ref need not name it yet, but a commit no
ref names may be deleted by a remote gc); with no parent there is nothing to do. Several ranks
may run at once, on disjoint ``paths``. The report says what was re-encoded, read, sent and
deleted (``RemoteCompactReport``).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ckstore.backend.fsio import private_folder
from ckstore.backend.local import LocalBackend
from ckstore.compaction.compact import compact_commits
from ckstore.compaction.pairing import Job
from ckstore.errors import ObjectMissingError
from ckstore.format.ids import OBJECTS_PREFIX, ObjectId, key_object_id
from ckstore.format.manifest import Commit
from ckstore.format.pack import DEFAULT_TARGET_SIZE
from ckstore.format.settings import RepoConfig
from ckstore.remote.layout import DEFAULT_GRACE, RemoteRepo
from ckstore.remote.lazy import RemoteObjects
from ckstore.remote.names import RemoteSpec, open_spec
from ckstore.remote.push import PushReport
from ckstore.remote.supersede import resend_and_replace, sweep_superseded
from ckstore.repository.context import RepoContext, init_context
from ckstore.repository.store import ObjectStore, object_key

SCRATCH_PREFIX = "ckstore-remote-compact-scratch-"


@dataclass
class RemoteCompactReport:
    commit: ObjectId
    parent: ObjectId | None = None  # the commit whose chunks became deltas (None: nothing to do)
    deltas: int = 0  # the parent's chunks re-encoded as deltas (predicted ones included)
    predicted: int = 0
    recompressed: int = 0  # chunks re-encoded in their best whole encoding
    read_objects: int = 0  # objects read from the remote
    read_bytes: int = 0
    sent_objects: int = 0  # objects sent again, in their new or (the rest of their pack) old encoding
    sent_bytes: int = 0
    sent_packs: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)  # packs deleted (superseded)
    freed_bytes: int = 0
    condemned: list[str] = field(default_factory=list)  # packs superseded, left to the grace
    uncached: int = 0  # objects deleted from ``cache``: none of the next run's


def open_url(url: str, endpoint_url: str | None = None, cache: str | os.PathLike[str] | None = None) -> RemoteRepo:
    """The remote at ``url`` (``s3://bucket/prefix`` or a folder), without a local repository;
    ``cache``: a folder where its index files are kept between calls."""
    backend = None
    if cache is not None:
        Path(cache).mkdir(parents=True, exist_ok=True)
        backend = LocalBackend(cache)
    return open_spec(RemoteSpec("origin", url, endpoint_url), backend)


def compact_remote(
    remote: RemoteRepo,
    commit: str,
    *,
    paths: Collection[str] | None = None,
    cache: str | os.PathLike[str] | None = None,
    config: RepoConfig | None = None,
    target_size: int = DEFAULT_TARGET_SIZE,
    grace: float = DEFAULT_GRACE,
) -> RemoteCompactReport:
    """Re-encode ``commit``'s parent on the remote as deltas of ``commit`` (the module
    docstring). ``paths``: only these files of ``commit`` (a rank's); ``cache``: a folder of
    objects kept between calls, left holding only ``commit``'s chunks (``paths``') and its first
    parents' commit objects (one per concurrent run: ``_keep_only``); ``config``: the encoding
    settings (chunking is the commit's own; the defaults of a new repository otherwise)."""
    remote.require_format()
    report = RemoteCompactReport(ObjectId(commit))
    with _scratch(config or RepoConfig()) as ctx:
        lazy = RemoteObjects(remote, _cache_store(ctx, cache), prefix_reads=True)
        ctx.store.sources.append(lazy)
        commits = ctx.graph.first_parents(ObjectId(commit), ctx.config.encoding.max_delta_depth + 3)
        if not commits:
            raise ObjectMissingError(f"commit {commit} is not on remote {remote.name}")
        if len(commits) < 2:
            report.uncached = 0 if cache is None else _keep_only(lazy, commit, commits, paths)
            return report
        report.parent = commits[0].parents[0]
        child = commits[0]
        if paths is not None:
            wanted = set(paths)
            child = dataclasses.replace(child, files=tuple(f for f in child.files if f.path in wanted))
        done = compact_commits(ctx, [child, *commits[1:]], lambda jobs: _bring(ctx, lazy, jobs))
        report.deltas, report.predicted, report.recompressed = done.deltas, done.predicted, done.recompressed
        _complete_packs(ctx, remote, lazy)
        sent = PushReport(remote.name)
        sweep_superseded(remote, grace, sent)
        resend_and_replace(ctx, remote, sent, target_size)
        report.read_objects, report.read_bytes = lazy.fetched_objects, lazy.fetched_bytes
        report.sent_objects, report.sent_bytes, report.sent_packs = sent.objects, sent.bytes, sent.sent_packs
        report.deleted, report.freed_bytes, report.condemned = sent.deleted, sent.freed_bytes, sent.condemned
        if cache is not None:
            report.uncached = _keep_only(lazy, commit, commits, paths)
    return report


def _keep_only(lazy: RemoteObjects, commit: str, commits: Sequence[Commit], paths: Collection[str] | None) -> int:
    """Delete from the cache every object but what the next run, on the commit after
    ``commit`` (``commits[0]``), reads of it again: its chunks (``paths``' only, when given) and
    the commit objects of its first parents; how many were deleted. Several runs at once must
    not share a cache: one would delete what another is still reading (which then reads it from
    the remote again)."""
    keep = {commit, *(c.parents[0] for c in commits[:-1]), *(c.id for c in commits[0].file_list)}
    keep.update(c.id for f in commits[0].files if paths is None or f.path in paths for c in f.all_chunks())
    dropped = 0
    for key in list(lazy.backend.list(OBJECTS_PREFIX)):
        oid = key_object_id(key)
        if oid is not None and oid not in keep and lazy.backend.delete(key):
            dropped += 1
    return dropped


@contextmanager
def _scratch(config: RepoConfig) -> Iterator[RepoContext]:
    """A throwaway repository: compaction's replacements are staged and applied there. Its
    folder records its process, so that the next run removes a killed run's (two saves' paired
    chunks: gigabytes, in the temporary folder)."""
    folder = private_folder(None, SCRATCH_PREFIX)
    try:
        yield init_context(folder / "repo", config)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _cache_store(ctx: RepoContext, cache: str | os.PathLike[str] | None) -> ObjectStore:
    """Where lazily read objects are kept: ``cache`` (kept between calls), else a folder beside
    the scratch repository."""
    folder = Path(cache) if cache is not None else Path(str(ctx.path)).parent / "cache"
    folder.mkdir(parents=True, exist_ok=True)
    return ObjectStore(LocalBackend(folder), ctx.store.settings)


def _bring(ctx: RepoContext, lazy: RemoteObjects, jobs: Sequence[Job]) -> None:
    """The chunks compaction re-encodes or reads whole, into the scratch store (compaction
    changes only objects there): each job's own, its parent's, a prediction's bases."""
    wanted: dict[str, None] = {}
    for job in jobs:
        if job.parent is None and not job.settle and job.prediction is None:
            continue  # a chunk the parent lacks, not settled: nothing reads it
        wanted.update(dict.fromkeys([job.slot.id, *([job.parent] if job.parent else [])]))
        if job.prediction is not None:
            p = job.prediction
            wanted.update(dict.fromkeys([*p.bases, *p.whole, *([p.moment] if p.moment else [])]))
    _copy_in(ctx, lazy, wanted)


def _copy_in(ctx: RepoContext, lazy: RemoteObjects, oids: Iterable[str]) -> None:
    """Objects as the remote (or the cache) stores them, verified, into the scratch store."""
    backend = ctx.store.backend
    for oid in oids:
        key = object_key(oid)
        if not backend.exists(key):
            backend.put_if_absent(key, lazy.read_stored(oid, None, ""))


def _complete_packs(ctx: RepoContext, remote: RemoteRepo, lazy: RemoteObjects) -> None:
    """Every object of each remote pack holding an object compaction re-encoded smaller, into
    the scratch store: a pack is sent again only whole, so that the old one holds nothing anybody
    needs and goes (chunks unchanged between the saves, the commit objects and file lists of
    that pack go again as they are)."""
    where = lazy.where()
    sizes = ctx.store.stored_sizes()
    smaller = {oid for oid, n in sizes.items() if oid in where and n < where[oid].entry.length}
    for table in remote.catalogue(refresh=False).values():
        ids = table.ids()
        if any(oid in smaller for oid in ids):
            _copy_in(ctx, lazy, ids)
