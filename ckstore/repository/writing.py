"""The one lock discipline of every writer (docs/format.md, "Locking").

An operation that stores objects and then moves a ref (commit, commit_state, import, overlay
commit, fetch/pull/clone, DCP save, compaction) holds the shared repository lock of this
repository and of every base repository it reads through, from its first staged object to its
last ref update. gc and repack hold the exclusive lock, so they run either before the first
object (and then the writer finds only what survived: ``has_durable`` below) or after the ref
moved (and then the ref, or a dependent's ref, names what the writer stored or deduplicated).

A base repository's lock is what pins an overlay's base commit: base gc waits until the
overlay's ref has moved, and from then on ``external_needs`` sees the new overlay commit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from ckstore.repository.context import RepoContext


def lock_order(ctx: RepoContext) -> list[RepoContext]:
    """``ctx`` and its base repositories (recursively), each once, this repository first.

    Always this order (dependent before base), so two writers never wait for each other: gc
    takes only its own repository's lock, and base links form no cycle (overlay.py refuses one).
    """
    out: list[RepoContext] = []
    seen: set[str] = set()

    def visit(c: RepoContext) -> None:
        key = c.location if c.path is not None else f"memory:{id(c.backend)}"
        if key in seen:
            return
        seen.add(key)
        out.append(c)
        for base in c.bases:
            visit(base)

    visit(ctx)
    return out


@contextmanager
def writing(ctx: RepoContext) -> Iterator[None]:
    """Hold the shared lock of ``ctx`` and of its bases; released on every exit, failures too."""
    with ExitStack() as held:
        for repo in lock_order(ctx):
            held.enter_context(repo.backend.shared_lock())
        yield
