"""Commit hooks: what an integration adds to every commit, and what it does once one is recorded.

An experiment tracker (``ckstore.integrations.mlflow``) links commits and runs both ways: the
commit's provenance names the run, and the run lists the commit. Both halves need a moment of
their own. ``links`` runs when the commit is *prepared*, in the caller's thread, before anything
is stored: trackers keep the active run per thread, and a background commit is written on a
worker thread that has none. ``recorded`` runs once the commit's ref moved (the commit stands),
on whichever thread wrote it; what it raises is reported as a ``CkstoreWarning`` and never undoes
or fails the commit, which is durable by then.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ckstore.errors import CkstoreWarning
from ckstore.format.ids import ObjectId
from ckstore.format.manifest import Commit


@dataclass(frozen=True)
class Recorded:
    """A commit that has just been recorded: its id, manifest and repository (None: in memory)."""

    id: ObjectId
    commit: Commit
    repository: Path | None


@dataclass(frozen=True)
class CommitHook:
    name: str  # one hook per name: registering it again replaces it
    links: Callable[[], Mapping[str, str]]  # provenance entries for the commit being prepared
    recorded: Callable[[Recorded], object]


_hooks: dict[str, CommitHook] = {}
_lock = threading.Lock()


def register(hook: CommitHook) -> None:
    with _lock:
        _hooks[hook.name] = hook


def unregister(name: str) -> bool:
    """Remove the hook ``name``; whether there was one."""
    with _lock:
        return _hooks.pop(name, None) is not None


def registered() -> tuple[CommitHook, ...]:
    with _lock:
        return tuple(_hooks.values())


def links() -> dict[str, str]:
    """The provenance entries every registered hook adds to a commit prepared now."""
    out: dict[str, str] = {}
    for hook in registered():
        out.update(hook.links())
    return out


def announce(done: Recorded) -> None:
    """Tell every hook that ``done`` stands; a hook's failure is a warning, the commit stays."""
    for hook in registered():
        try:
            hook.recorded(done)
        except Exception as exc:  # the commit is durable: report, do not fail it
            warnings.warn(
                CkstoreWarning(f"commit {done.id[:12]} is recorded, but the {hook.name} hook failed: {exc}"),
                stacklevel=2,
            )
