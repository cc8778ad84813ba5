"""The base of ``Repo`` (repo/__init__.py): the opened repository, its refs and background work."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Generic, TypeVar

from ckstore.backend.base import Backend
from ckstore.format.ids import ObjectId
from ckstore.format.manifest import Commit
from ckstore.format.settings import RepoConfig
from ckstore.repository import branches
from ckstore.repository.context import (
    RepoContext,
    open_context,
)
from ckstore.repository.refs import HEADS, REMOTES, TAGS, RefStore
from ckstore.repository.store import ObjectStore
from ckstore.write.background import BackgroundStatus, work_for

# Operations are imported where they are called, so a command loads only what it runs (start-up:
# scripts/bench_startup.py); the names re-exported below load on first use (``__getattr__``).
if TYPE_CHECKING:
    from ckstore.repository.reflog import Entry as ReflogEntry


_V = TypeVar("_V")


class _WorkSetting(Generic[_V]):
    """A ``Repo`` attribute stored in its repository's ``BackgroundWork`` (write/background.py)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, repo: RepoCore | None, owner: type | None = None) -> _V:
        if repo is None:  # looked up on the class (help(), documentation tools)
            return self  # type: ignore[return-value]  # a descriptor shows itself on the class
        value: _V = getattr(repo._work, self.name)
        return value

    def __set__(self, repo: RepoCore, value: _V) -> None:
        setattr(repo._work, self.name, value)


class RepoCore:
    """What every part of ``Repo`` stands on: the opened repository (``RepoContext``), its refs,
    commits by name, and the background work of this process."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        backend: Backend | None = None,
        _context: RepoContext | None = None,
    ) -> None:
        self._ctx = _context or open_context(path, backend=backend)
        self._work = work_for(self._ctx)  # once: ``commits_recorded`` (a signal handler's) takes no lock

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

    def wait(self) -> None:
        """Wait for background commits and this process's compaction after them; raise the error
        of a background commit that failed unobserved. (A detached compaction is not waited
        for: ``wait_background`` does.)"""
        self._work.wait()
