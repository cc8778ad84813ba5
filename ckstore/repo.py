"""``Repo``: the API every caller uses (the CLI and the integrations are thin layers over it).

A façade: it opens a repository (``context.RepoContext``: backend, settings, object store,
refs, commit graph) and delegates each call to the operation module that owns it. The
operations never import this module, so data flows one way (docs/design.md, "Layers").
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Generic, Literal, TypeVar, overload

from ckstore.backend.base import Backend
from ckstore.format.ids import ObjectId
from ckstore.format.manifest import Commit
from ckstore.format.settings import RepoConfig
from ckstore.format.values import JSONValue
from ckstore.repository import branches
from ckstore.repository.context import (
    DEFAULT_DIR,
    RepoContext,
    find_context,
    init_context,
    memory_context,
    open_context,
    open_or_init_context,
)
from ckstore.repository.refs import HEADS, REMOTES, TAGS, RefStore, check_ref_name
from ckstore.repository.store import ObjectStore
from ckstore.write.background import BackgroundStatus, CommitHandle, work_for

# Operations are imported where they are called, so a command loads only what it runs (start-up:
# scripts/bench_startup.py); the names re-exported below load on first use (``__getattr__``).
if TYPE_CHECKING:
    from ckstore.compaction.compact import CompactReport
    from ckstore.history.log import Decorations, Diff, LogEntry, TensorChange
    from ckstore.history.summary import FileSummary
    from ckstore.maintenance.fsck import Problems
    from ckstore.maintenance.gc import GcReport
    from ckstore.maintenance.repack import RepackReport
    from ckstore.maintenance.sizes import CommitSizes, Stats
    from ckstore.read.checkout import CheckoutResult
    from ckstore.remote.fetch import FetchReport
    from ckstore.remote.gc import RemoteGcReport
    from ckstore.remote.lazy import RemoteObjects
    from ckstore.remote.names import RemoteSpec
    from ckstore.remote.push import PushReport
    from ckstore.report.status import Status
    from ckstore.repository.overlay import RelinkReport
    from ckstore.repository.reflog import Entry as ReflogEntry
    from ckstore.runtime.progress import ProgressBar, ProgressFactory
    from ckstore.training.legacy import ImportResult
    from ckstore.training.partial import LazyTensors
    from ckstore.training.state import Device
    from ckstore.write.commit import CommitRequest
    from ckstore.write.ingest import MemoryFile

_LAZY_EXPORTS = {
    "CheckoutResult": "ckstore.read.checkout",
    "CommitSizes": "ckstore.maintenance.sizes",
    "Stats": "ckstore.maintenance.sizes",
    "Decorations": "ckstore.history.log",
    "Diff": "ckstore.history.log",
    "TensorChange": "ckstore.history.log",
    "ReflogEntry": "ckstore.repository.reflog",
    "ProgressBar": "ckstore.runtime.progress",
    "ProgressFactory": "ckstore.runtime.progress",
}


def __getattr__(name: str) -> object:
    if name not in _LAZY_EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY_EXPORTS[name]), "Entry" if name == "ReflogEntry" else name)


__all__ = [
    "DEFAULT_DIR",
    "BackgroundStatus",
    "CheckoutResult",
    "CommitHandle",
    "CommitSizes",
    "Decorations",
    "Diff",
    "ProgressBar",
    "ProgressFactory",
    "ReflogEntry",
    "Repo",
    "Stats",
    "TensorChange",
]


_V = TypeVar("_V")


class _WorkSetting(Generic[_V]):
    """A ``Repo`` attribute stored in its repository's ``BackgroundWork`` (write/background.py)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, repo: Repo | None, owner: type | None = None) -> _V:
        if repo is None:  # looked up on the class (help(), documentation tools)
            return self  # type: ignore[return-value]
        value: _V = getattr(repo._work, self.name)
        return value

    def __set__(self, repo: Repo, value: _V) -> None:
        setattr(repo._work, self.name, value)


class Repo:
    """A ckstore repository. ``Repo(path)`` opens one; ``Repo.init(path)`` creates one."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        backend: Backend | None = None,
        _context: RepoContext | None = None,
    ) -> None:
        self._ctx = _context or open_context(path, backend=backend)
        self._work = work_for(self._ctx)  # once: ``commits_recorded`` (a signal handler's) takes no lock

    # ---- creating and finding ----------------------------------------------------------------

    @classmethod
    def init(
        cls,
        path: str | os.PathLike[str] = DEFAULT_DIR,
        *,
        chunk_size: int | None = None,
        zstd_level: int | None = None,
        max_delta_depth: int | None = None,
        backend: Backend | None = None,
        exist_ok: bool = False,
    ) -> Repo:
        """Create a repository; with ``exist_ok`` open the one already at ``path`` instead (settings
        given here must then match its own)."""
        config = _config(chunk_size, zstd_level, max_delta_depth)
        if exist_ok:
            given = {"chunk_size": chunk_size, "zstd_level": zstd_level, "max_delta_depth": max_delta_depth}
            return cls(
                _context=open_or_init_context(path, config, backend, [k for k, v in given.items() if v is not None])
            )
        return cls(_context=init_context(path, config, backend))

    @classmethod
    def memory(cls, **config: int) -> Repo:
        """A repository held in memory (tests, experiments)."""
        return cls(_context=memory_context(_config(**config)))

    @classmethod
    def find(cls, explicit: str | os.PathLike[str] | None = None, start: str | os.PathLike[str] | None = None) -> Repo:
        """``explicit``, else $CKSTORE_REPO, else the nearest .ckstore at or above ``start``."""
        return cls(_context=find_context(explicit, start))

    # ---- what the repository is made of ------------------------------------------------------

    @property
    def path(self) -> Path | None:
        return self._ctx.path

    @property
    def backend(self) -> Backend:
        return self._ctx.backend

    @property
    def store(self) -> ObjectStore:
        return self._ctx.store

    @property
    def refs(self) -> RefStore:
        return self._ctx.refs

    @property
    def config(self) -> RepoConfig:
        return self._ctx.config

    # ---- background work (write/background.py) -----------------------------------------------

    # Settings of the repository's background work, kept there (the façade holds no state):
    # snapshots a background commit may hold at once (host memory; set before the first one);
    # whether each commit's parent is re-encoded as deltas once the commit is durable (False
    # leaves it to the next commit that compacts, or to repack); and whether that compaction runs
    # in a detached process that outlives this one (the CLI: compaction/detached.py) instead of on this
    # process's thread (a repository in memory always uses the thread); and whether that process
    # may be a fork of this one, which must then be a ckstore command and nothing else (the CLI).
    commits_in_flight: _WorkSetting[int] = _WorkSetting()
    compact_after_commit: _WorkSetting[bool] = _WorkSetting()
    detach_compaction: _WorkSetting[bool] = _WorkSetting()
    fork_compaction: _WorkSetting[bool] = _WorkSetting()

    def background_work(self) -> BackgroundStatus:
        """What still runs after the calls that started it: background commits of this process,
        and whether a compaction runs or waits (this process's, or a detached one's, whichever
        process started it), with the log detached compactions write to."""
        return self._work.status(self._ctx)

    def commits_recorded(self) -> tuple[ObjectId, ...]:
        """The commits recorded through this repository so far, oldest first. It takes no lock
        and does no I/O, so a signal handler may ask it (the CLI's Ctrl-C handler does)."""
        return tuple(self._work.recorded)

    def wait_background(self, poll: float = 0.1) -> None:
        """``wait``, then wait until no compaction of this repository runs or waits, detached
        ones included, then bring the current branch to rest (``ckstore wait``)."""
        import time

        from ckstore.compaction.at_rest import is_at_rest

        self.wait()
        while self.background_work().compaction_pending:
            time.sleep(poll)
        tip = self.refs.read(HEADS + self.head_branch)
        if tip is not None and not is_at_rest(self.backend, tip):  # compaction's modules only when needed
            from ckstore.compaction.compact import settle_branch

            settle_branch(self._ctx, self.head_branch)

    def set_config(self, config: RepoConfig) -> None:
        """Replace the repository settings (they apply to objects written from now on)."""
        self._ctx.set_config(config)

    # ---- refs ----------------------------------------------------------------------------------

    @property
    def head_branch(self) -> str:
        return self.refs.head_branch()

    def branches(self) -> dict[str, ObjectId]:
        return self.refs.list(HEADS)

    def tags(self) -> dict[str, ObjectId]:
        return self.refs.list(TAGS)

    def remote_branches(self) -> dict[str, ObjectId]:
        """Remote-tracking branches, ``REMOTE/BRANCH`` -> commit, as of the last push or fetch."""
        return self._ctx.refs.list(REMOTES)

    def create_branch(self, name: str, ref: str = "HEAD", force: bool = False) -> ObjectId:
        """Create branch ``name`` at ``ref``; ``force`` moves it there if it exists."""
        return branches.create(self._ctx, "branch", name, ref, force)[1]

    def create_tag(self, name: str, ref: str = "HEAD", force: bool = False) -> ObjectId:
        return branches.create(self._ctx, "tag", name, ref, force)[1]

    def delete_branch(self, name: str, force: bool = False) -> ObjectId:
        """Delete a branch; return the commit it held. The current or only branch needs ``force``."""
        return branches.delete(self._ctx, "branch", name, force)

    def delete_tag(self, name: str) -> ObjectId:
        return branches.delete(self._ctx, "tag", name)

    def switch(self, name: str, create_at: str | None = None) -> ObjectId:
        """Make ``name`` the current branch (created at ``create_at`` if given); return its commit."""
        return branches.switch(self._ctx, name, create_at)

    def reset(self, ref: str) -> tuple[ObjectId | None, ObjectId]:
        """Move the current branch to ``ref``; return (its old commit, the new one)."""
        return branches.reset(self._ctx, ref)

    def reflog(self, ref: str | None = None) -> list[tuple[str, ReflogEntry]]:
        """(``name@{n}``, entry) newest first: of ``ref`` (a branch or tag, deleted ones too, or
        HEAD), or of every ref when None."""
        graph = self._ctx.graph
        if ref is None:
            return graph.reflog_all()
        name, entries = graph.reflog(ref)
        return [(f"{name}@{{{n}}}", e) for n, e in enumerate(entries)]

    def resolve(self, spec: str) -> ObjectId:
        """A commit id from a full id, unique prefix (6+), branch, tag, HEAD, or any of these + ``~N``/``^``."""
        return self._ctx.graph.resolve(spec)

    def read_commit(self, oid: str, files: bool = True) -> Commit:
        """``files=False``: the header, its file list read on first use (graph.read_commit)."""
        return self._ctx.graph.read_commit(oid, files=files)

    def pruned(self) -> dict[ObjectId, tuple[ObjectId, ...]]:
        return self._ctx.graph.pruned()

    def reachable_commits(self) -> list[ObjectId]:
        """Every commit reachable from a branch or tag, walking through pruned commits' parents."""
        return self._ctx.graph.reachable_commits()

    # ---- commits -------------------------------------------------------------------------------

    def commit(
        self,
        paths: Sequence[str | os.PathLike[str]] | str | os.PathLike[str],
        message: str = "",
        branch: str | None = None,
        metadata: Mapping[str, object] | None = None,
        progress: ProgressFactory | None = None,
        base: str | None = None,
        base_repo: str | os.PathLike[str] | None = None,
        raw: bool = False,
        start: str | None = None,
    ) -> ObjectId:
        """Record files and directories as one commit on ``branch``; return the commit id.

        A ``branch`` that does not exist yet starts at ``start`` (a ref: "HEAD" as git's
        ``checkout -b``; HEAD with no commits yet gives a root commit), or, when ``start`` is None,
        with a root commit: a history unrelated to the others.

        With ``base`` (and optionally ``base_repo``) the commit is an overlay: every file of the
        base commit that the given paths do not replace is inherited, and tensors equal to the
        base's cost nothing. A pickle checkpoint given as a path is refused unless ``raw``
        (``import_checkpoint`` stores its tensors); see ``ingest.collect_sources``.
        """
        from ckstore.repository.overlay import resolve_base
        from ckstore.runtime.pipeline import collection_paused
        from ckstore.write.commit import commit_sources, prepare_commit
        from ckstore.write.ingest import collect_sources

        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        work = self._work
        work.wait_commits()
        request = self._start_new_branch(prepare_commit(message, branch, metadata).on_branch(self._ctx), start)
        sources = collect_sources(paths, exclude=self.path or Path("/nonexistent"), raw=raw)
        based = resolve_base(self._ctx, base, base_repo)
        with collection_paused():  # as commit_state: 11% of the pipeline thread's samples were collections
            return commit_sources(self._ctx, sources, request, progress, base=based)

    def _start_new_branch(self, request: CommitRequest, start: str | None) -> CommitRequest:
        """``request`` with the commit ``start`` names as its parent if its branch is new."""
        assert request.branch is not None
        refs = self._ctx.refs
        if start is None or refs.read(HEADS + request.branch) is not None:
            return request
        if start == "HEAD" and refs.read(HEADS + refs.head_branch()) is None:
            return request  # nothing committed yet: the first commit is a root wherever it goes
        return replace(request, start=self.resolve(start))

    @overload
    def commit_state(
        self,
        state: object,
        message: str = "",
        branch: str | None = None,
        metadata: Mapping[str, object] | None = None,
        progress: ProgressFactory | None = None,
        base: str | None = None,
        base_repo: str | os.PathLike[str] | None = None,
        background: Literal[False] = False,
        start: str | None = None,
    ) -> ObjectId: ...

    @overload
    def commit_state(
        self,
        state: object,
        message: str = "",
        branch: str | None = None,
        metadata: Mapping[str, object] | None = None,
        progress: ProgressFactory | None = None,
        base: str | None = None,
        base_repo: str | os.PathLike[str] | None = None,
        *,
        background: Literal[True],
        start: str | None = None,
    ) -> CommitHandle: ...

    def commit_state(
        self,
        state: object,
        message: str = "",
        branch: str | None = None,
        metadata: Mapping[str, object] | None = None,
        progress: ProgressFactory | None = None,
        base: str | None = None,
        base_repo: str | os.PathLike[str] | None = None,
        background: bool = False,
        start: str | None = None,
    ) -> ObjectId | CommitHandle:
        """Commit a nested training state (tensors, arrays, scalars…) without pickle; return the id.

        A ``branch`` that does not exist yet starts at ``start``, as in ``commit``.

        With ``background`` the tensors are copied and a ``CommitHandle`` is returned at once;
        hashing, encoding and writing go on in the background (see write/background.py).
        """
        from ckstore.format.manifest import StateFiles
        from ckstore.repository.overlay import resolve_base
        from ckstore.runtime.pipeline import collection_paused
        from ckstore.training.state import STATE_TENSORS, STATE_VALUES, state_files
        from ckstore.write.commit import commit_sources, prepare_commit

        request = self._start_new_branch(prepare_commit(message, branch, metadata).on_branch(self._ctx), start)
        based = resolve_base(self._ctx, base, base_repo)

        def write(sources: Sequence[MemoryFile]) -> ObjectId:
            return commit_sources(
                self._ctx, sources, request, progress, state=StateFiles(STATE_VALUES, STATE_TENSORS), base=based
            )

        work = self._work
        if background:
            return work.submit_commit(lambda: state_files(state, snapshot=True), write)
        work.wait_commits()
        with collection_paused():
            return write(state_files(state))  # refuses unencodable values before anything is stored

    def wait(self) -> None:
        """Wait for background commits and this process's compaction after them; raise the error
        of a background commit that failed unobserved. (A detached compaction is not waited
        for: ``wait_background`` does.)"""
        self._work.wait()

    def compact(self, branch: str | None = None) -> CompactReport:
        """Re-encode the tip of ``branch`` and its parent now (what runs after every commit), and
        settle the tip's own chunks: the branch is at rest after it."""
        from ckstore.compaction.compact import compact_branch

        branch = check_ref_name(self.head_branch if branch is None else branch, "branch name")
        return compact_branch(self._ctx, branch, settle=True)

    def load_state(
        self,
        ref: str = "HEAD",
        *,
        only: str | Sequence[str] | None = None,
        device: Device = "cpu",
        lazy: bool = False,
    ) -> object:
        """The state committed at ``ref``, bit-exact; ``only`` filters by key prefix or glob."""
        from ckstore.runtime.pipeline import collection_paused
        from ckstore.training.state import load_state

        with collection_paused():
            return load_state(self._ctx.graph, ref, only=only, device=device, lazy=lazy)

    def checkout(
        self,
        ref: str,
        out_dir: str | os.PathLike[str],
        *,
        force: bool = False,
        only: Sequence[str] | None = None,
        progress: ProgressFactory | None = None,
        shard_size: int | str | None = None,
        merge_lora: bool = False,
        fsync: bool = False,
    ) -> CheckoutResult:
        """Write the files of ``ref`` into ``out_dir``, byte-identical (or only matching tensors).

        ``shard_size`` ("500MB", "2GiB", bytes) writes the tensors as Hugging Face shards instead;
        ``merge_lora`` writes the base model with a committed PEFT LoRA adapter merged in;
        ``fsync`` makes the files durable before returning (by default they are written as git's
        checkout or cp writes them: the repository holds the durable copy).
        """
        from ckstore.read.checkout import write_with_progress
        from ckstore.read.export import plan_checkout
        from ckstore.runtime.pipeline import collection_paused

        outputs = plan_checkout(self.store, self.read_commit(self.resolve(ref)), only, shard_size, merge_lora)
        with collection_paused():
            return write_with_progress(self.store, outputs, Path(out_dir), force, progress, durable=fsync)

    def export(
        self,
        ref: str,
        out_dir: str | os.PathLike[str],
        *,
        prefix: str | None = None,
        weights: Sequence[str] | None = None,
        files_from: str | None = None,
        shard_size: int | str | None = None,
        force: bool = False,
        progress: ProgressFactory | None = None,
        fsync: bool = False,
    ) -> CheckoutResult:
        """Write exactly the model of ``ref`` as a folder ``from_pretrained`` loads (see export.py).

        ``prefix``: the key whose tensors are the model, removed from their names (a training
        state: "model" by default); ``weights``: globs of the safetensors files holding the model
        (a commit of files: model.safetensors and its shards by default); ``files_from``: a commit
        whose config, tokenizer and other files are copied instead of ``ref``'s own. A commit
        holding a PEFT LoRA adapter exports the base model with the adapter merged in. ``fsync``
        as for ``checkout``.
        """
        from ckstore.read.checkout import write_with_progress
        from ckstore.read.export import plan_export

        source = self.read_commit(self.resolve(files_from)) if files_from is not None else None
        plan = plan_export(
            self.store,
            self.read_commit(self.resolve(ref)),
            prefix=prefix,
            weights=weights,
            files_from=source,
            shard_size=shard_size,
        )
        result = write_with_progress(self.store, plan.outputs, Path(out_dir), force, progress, "export", durable=fsync)
        result.merged_adapter = plan.merged_adapter
        return result

    def import_checkpoint(
        self,
        path: str | os.PathLike[str],
        *,
        recursive: bool = False,
        message: str | None = None,
        branch: str | None = None,
        delete_source: bool = False,
        metadata: Mapping[str, object] | None = None,
        start: str | None = None,
    ) -> list[ImportResult]:
        """Commit PyTorch pickle checkpoints safely (weights_only), one commit per file; see legacy.py.

        A ``branch`` that does not exist yet starts at ``start``, as in ``commit``."""
        return list(
            self.iter_import(
                path,
                recursive=recursive,
                message=message,
                branch=branch,
                delete_source=delete_source,
                metadata=metadata,
                start=start,
            )
        )

    def iter_import(
        self,
        path: str | os.PathLike[str],
        *,
        recursive: bool = False,
        message: str | None = None,
        branch: str | None = None,
        delete_source: bool = False,
        metadata: Mapping[str, object] | None = None,
        start: str | None = None,
    ) -> Iterator[ImportResult]:
        """Like ``import_checkpoint``, yielding each file's result as its commit lands."""
        from functools import partial

        from ckstore.training.legacy import import_checkpoints

        # Only the first file's commit can find its branch new; the later ones follow it.
        yield from import_checkpoints(
            partial(self.commit_state, start=start),
            self.load_state,
            path,
            exclude=self.path,
            recursive=recursive,
            message=message,
            branch=branch,
            delete_source=delete_source,
            metadata=metadata,
        )

    def open(self, ref: str = "HEAD", *, path: str | None = None, framework: str | None = None) -> LazyTensors:
        """A lazy read-only mapping of the commit's tensors with safe_open-style slices; see partial.py."""
        from ckstore.training.partial import LazyTensors

        return LazyTensors(self._ctx.graph, ref, path, framework)

    # ---- history and inspection ----------------------------------------------------------------

    def log(
        self, ref: str | Sequence[str] | None = None, limit: int | None = None, best: tuple[str, bool] | None = None
    ) -> list[LogEntry]:
        """Commits reachable from ``ref`` (default HEAD; a list: from any of them), newest first, at most ``limit``, with the
        names pointing at each; ``best=(metric, maximize)`` marks the best of them by ``metric``."""
        from ckstore.history.log import log

        return log(self._ctx.graph, ref, limit, best)

    def decorations(self) -> dict[ObjectId, Decorations]:
        """Branches and tags by the commit they point at (HEAD marks its branch's)."""
        from ckstore.history.log import decorations

        return decorations(self._ctx.graph)

    def commit_sizes(self, oids: Sequence[str]) -> dict[ObjectId, CommitSizes]:
        """Each commit's size figures: logical, added when committed, new, held alone (sizes.py)."""
        from ckstore.maintenance import sizes

        self.wait()  # figures of a repository that this process is not changing underneath
        return sizes.commit_sizes(self._ctx, [self.resolve(o) for o in oids])

    def show(self, ref: str = "HEAD") -> tuple[ObjectId, Commit]:
        oid = self.resolve(ref)
        return oid, self.read_commit(oid)

    def from_base(self, ref: str) -> set[tuple[str, str | None]]:
        """(path, tensor) pairs of an overlay commit that are identical to its base's; empty otherwise."""
        from ckstore.repository.overlay import from_base

        commit = self.read_commit(self.resolve(ref))
        return set() if commit.base is None else from_base(commit, self.read_commit(commit.base.commit))

    def base_location(self, ref: str) -> str | None:
        """Where an overlay commit's base commit lives now: the base repository (found through
        ``alternates``, so after a move or relink) that holds it; None if in this repository or
        unreachable (fsck names an unreachable base)."""
        commit = self.read_commit(self.resolve(ref))
        if commit.base is None or commit.base.repo is None:
            return None
        return next((b.location for b in self._ctx.bases if b.store.has(commit.base.commit)), None)

    def state_document(self, ref: str) -> JSONValue:
        """The typed-JSON non-tensor part of a training-state commit (tensors appear as $tensor)."""
        from ckstore.repository.filedata import state_values

        oid = self.resolve(ref)
        return state_values(self.store, oid, self.read_commit(oid))

    def diff(self, a: str, b: str) -> Diff:
        """Per tensor (and per plain file): added, removed, changed or unchanged from ``a`` to ``b``."""
        from ckstore.history.log import diff

        return diff(self._ctx.graph, a, b)

    def diff_folder(self, ref: str, folder: str | os.PathLike[str]) -> Diff:
        """``diff`` from commit ``ref`` to the files under ``folder`` (hashed, not stored)."""
        from ckstore.read.folder_diff import diff_folder

        return diff_folder(self._ctx, ref, folder)

    def summary(self, ref: str = "HEAD") -> list[FileSummary]:
        """Per file of ``ref``: tensor count, dtypes, bytes, tensors grouped by name (summary.py)."""
        from ckstore.history.summary import summarise

        oid = self.resolve(ref)
        return summarise(self.read_commit(oid), self.from_base(oid))

    def stats(self) -> Stats:
        """Logical bytes over all commits, bytes stored (and unreferenced), and counts."""
        from ckstore.maintenance import sizes

        self.wait()
        return sizes.stats(self._ctx)

    def best(self, metric: str, mode: str = "min", branch: str | None = None) -> ObjectId:
        """The commit with the best ``metric`` in its metadata (``mode`` "min" or "max")."""
        from ckstore.maintenance.retention import best

        return best(self._ctx.graph, metric, mode, branch)

    # ---- maintenance ---------------------------------------------------------------------------

    def gc(
        self,
        *,
        keep_last: int | None = None,
        keep_best: int | None = None,
        metric: str | None = None,
        maximize: bool = False,
        keep_every: int | None = None,
        dry_run: bool = False,
        repack: bool = False,
        prune_now: bool = False,
        force: bool = False,
        progress: ProgressFactory | None = None,
    ) -> GcReport:
        """Delete commits outside the retention policy (if any) and every object no kept commit needs.

        Commits that unexpired reflog entries name are kept (``prune_now``: expire every entry
        the refs no longer reach first). With ``repack``, kept objects are re-encoded first
        (newest commits whole, older ones deltas). A gc that would delete every commit needs ``force``.
        """
        from ckstore.maintenance.gc import collect_garbage
        from ckstore.maintenance.retention import RetentionPolicy

        policy = RetentionPolicy(keep_last, keep_best, metric, maximize, keep_every)
        self.wait()
        return collect_garbage(
            self._ctx, policy, dry_run=dry_run, repack=repack, prune_now=prune_now, force=force, progress=progress
        )

    def repack(self, progress: ProgressFactory | None = None) -> RepackReport:
        from ckstore.maintenance.repack import repack

        self.wait()
        return repack(self._ctx, progress)

    def relink(
        self,
        bases: Sequence[str | os.PathLike[str]] = (),
        *,
        dependents: Sequence[str | os.PathLike[str]] = (),
        prune: bool = False,
    ) -> RelinkReport:
        """Repair overlay links after a move: ``bases`` are base repositories' new locations,
        ``dependents`` overlays' new locations; ``prune`` forgets deleted overlays (see overlay.py)."""
        from ckstore.repository.overlay import relink

        return relink(self._ctx, bases, dependents, prune)

    # ---- remotes (remote/: names.py, push.py, fetch.py, gc.py, lazy.py) ------------------------

    def remotes(self) -> dict[str, RemoteSpec]:
        """Name -> RemoteSpec (url, endpoint_url) of every remote."""
        from ckstore.remote.names import read_remotes

        return read_remotes(self._ctx.backend)

    def add_remote(self, name: str, url: str, endpoint_url: str | None = None) -> RemoteSpec:
        from ckstore.remote import names as remotes

        return remotes.add(self._ctx, name, url, endpoint_url)

    def remove_remote(self, name: str) -> RemoteSpec:
        from ckstore.remote import names as remotes

        return remotes.remove(self._ctx, name)

    def push(
        self,
        remote: str | None = None,
        refs: Sequence[str] = (),
        force: bool = False,
        *,
        target_size: int | None = None,
        grace: float | None = None,
        progress: ProgressFactory | None = None,
    ) -> PushReport:
        """Send ``refs`` (default: the current branch) and what they need to ``remote``; see push.py
        (``target_size``: bytes per pack; ``grace``: seconds a condemned pack stays reachable)."""
        from ckstore.format.pack import DEFAULT_TARGET_SIZE
        from ckstore.remote.layout import DEFAULT_GRACE
        from ckstore.remote.push import push

        self.wait()
        return push(
            self._ctx,
            remote,
            refs,
            force,
            DEFAULT_TARGET_SIZE if target_size is None else target_size,
            DEFAULT_GRACE if grace is None else grace,
            progress,
        )

    def fetch(self, remote: str | None = None, progress: ProgressFactory | None = None) -> FetchReport:
        """Fetch every branch and tag of ``remote`` (as NAME/BRANCH) and what they need; see fetch.py.
        Refs it could not take are in the report's ``skipped`` (``report.check()`` raises for damaged ones)."""
        from ckstore.remote.fetch import fetch

        return fetch(self._ctx, remote, progress)

    def pull(
        self, remote: str | None = None, progress: ProgressFactory | None = None
    ) -> tuple[FetchReport, ObjectId | None, ObjectId | None]:
        """Fetch, then fast-forward the current branch; returns (report, old commit, new commit)."""
        from ckstore.remote.fetch import pull

        return pull(self._ctx, remote, progress)

    @classmethod
    def clone(
        cls,
        url: str,
        path: str | os.PathLike[str] = DEFAULT_DIR,
        *,
        endpoint_url: str | None = None,
        progress: ProgressFactory | None = None,
        check: bool = True,
    ) -> tuple[Repo, FetchReport]:
        """A new repository at ``path`` with every branch of the remote at ``url`` ("origin"), and
        the report of the fetch that filled it. A ref the remote is damaged at raises
        IntegrityError naming it, after the others landed (with ``check=False``, it is only in the
        report's ``skipped``: ``report.check()`` raises then)."""
        from ckstore.remote.fetch import clone

        ctx, report = clone(url, path, endpoint_url, progress=progress)
        if check:
            report.check()
        return cls(_context=ctx), report

    def gc_remote(
        self,
        remote: str | None = None,
        *,
        keep_last: int | None = None,
        keep_best: int | None = None,
        metric: str | None = None,
        maximize: bool = False,
        keep_every: int | None = None,
        grace: float | None = None,
        dry_run: bool = False,
    ) -> RemoteGcReport:
        """Garbage-collect a remote (two-phase, see remote/gc.py): the retention policy as ``gc``'s,
        ``grace`` seconds before a condemned pack is deleted."""
        from ckstore.remote.gc import collect_remote
        from ckstore.remote.layout import DEFAULT_GRACE

        return collect_remote(
            self._ctx,
            remote,
            keep_last=keep_last,
            keep_best=keep_best,
            metric=metric,
            maximize=maximize,
            keep_every=keep_every,
            grace=DEFAULT_GRACE if grace is None else grace,
            dry_run=dry_run,
        )

    def use_remote(self, remote: str | None = None) -> RemoteObjects:
        """Read objects missing here from ``remote`` on demand (ranged reads, cached locally):
        ``checkout``, ``open`` and ``load_state`` then work on commits only the remote holds."""
        from ckstore.remote.lazy import attach

        return attach(self._ctx, remote)

    def status(self) -> Status:
        """The current branch and HEAD, pending compaction, stored size and what gc would free,
        overlay bases reachable or not, and each remote's tracking refs ahead/behind (status.py)."""
        from ckstore.report.status import status

        return status(self._ctx, {name: spec.url for name, spec in self.remotes().items()})

    def report(self, refs: Sequence[str], output: str | os.PathLike[str]) -> int:
        """Write the self-contained HTML report of the history of ``refs`` (default HEAD) to
        ``output``: per-module change heatmap, storage, metrics, lineage, health (report/)."""
        from ckstore.report.build import write_report

        self.wait()
        return write_report(self._ctx, refs, Path(output))

    def fsck(self, read_data: bool = False, progress: ProgressFactory | None = None) -> Problems:
        """Problem lines, empty when the repository is whole (``Problems.only_unreachable_bases``:
        nothing but moved base repositories)."""
        from ckstore.maintenance.fsck import check

        self.wait()
        return check(self._ctx, read_data=read_data, progress=progress)


def _config(
    chunk_size: int | None = None, zstd_level: int | None = None, max_delta_depth: int | None = None
) -> RepoConfig:
    defaults = RepoConfig()
    # None means "the default"; 0 is a value like any other, refused by validation (newcomer item 11).
    return RepoConfig(
        defaults.chunk_size if chunk_size is None else chunk_size,
        defaults.zstd_level if zstd_level is None else zstd_level,
        defaults.max_delta_depth if max_delta_depth is None else max_delta_depth,
    )
