"""ckstore: a content-addressed, deduplicating checkpoint store for PyTorch training."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckstore.errors import CkstoreError, IntegrityError
from ckstore.version import __version__

if TYPE_CHECKING:
    from ckstore.repo import Repo

__all__ = ["CkstoreError", "IntegrityError", "Repo", "__version__", "rng_state", "set_rng_state"]


def __getattr__(name: str) -> Any:
    # Loaded on first use: every ``ckstore.*`` import runs this file, and ``ckstore --help`` needs
    # no repository code; the RNG helpers need torch, which the CLI never loads for them.
    if name == "Repo":
        from ckstore.repo import Repo

        return Repo
    if name in ("rng_state", "set_rng_state"):
        from ckstore.training import state

        return getattr(state, name)
    raise AttributeError(f"module 'ckstore' has no attribute {name!r}")
