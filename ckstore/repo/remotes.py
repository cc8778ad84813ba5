"""``Repo``'s remote methods (names, push, fetch, pull, remote gc, lazy reads)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ckstore.format.ids import ObjectId
from ckstore.repo.core import RepoCore

# Operations are imported where they are called, so a command loads only what it runs (start-up:
# scripts/bench_startup.py); the names re-exported below load on first use (``__getattr__``).
if TYPE_CHECKING:
    from ckstore.remote.fetch import FetchReport
    from ckstore.remote.gc import RemoteGcReport
    from ckstore.remote.lazy import RemoteObjects
    from ckstore.remote.names import RemoteSpec
    from ckstore.remote.push import PushReport
    from ckstore.runtime.progress import ProgressFactory


class Remotes(RepoCore):
    """Remotes: their names, push, fetch and pull, remote gc, reading through a remote."""

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
        """Send ``refs`` (default: the current branch) and what they need to ``remote``, then what
        local compaction re-encoded since; see push.py and supersede.py (``target_size``: bytes
        per pack; ``grace``: seconds a condemned pack stays reachable)."""
        from ckstore.format.pack import DEFAULT_TARGET_SIZE
        from ckstore.remote.layout import DEFAULT_GRACE
        from ckstore.remote.supersede import push_and_supersede

        self.wait()
        return push_and_supersede(
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
