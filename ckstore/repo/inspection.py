"""``Repo``'s history and inspection methods (log, diff, summaries, sizes)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ckstore.format.ids import ObjectId
from ckstore.format.manifest import Commit
from ckstore.format.values import JSONValue
from ckstore.repo.core import RepoCore

# Operations are imported where they are called, so a command loads only what it runs (start-up:
# scripts/bench_startup.py); the names re-exported below load on first use (``__getattr__``).
if TYPE_CHECKING:
    from ckstore.history.log import Decorations, Diff, LogEntry
    from ckstore.history.summary import FileSummary
    from ckstore.maintenance.sizes import CommitSizes, Stats


class Inspection(RepoCore):
    """History and inspection: log, diff, summaries, sizes, the best commit by a metric."""

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
