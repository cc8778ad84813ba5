"""ckstore: a content-addressed, deduplicating checkpoint store for PyTorch training."""

from __future__ import annotations

from typing import Any

from ckstore.errors import CkstoreError, IntegrityError
from ckstore.repo import Repo
from ckstore.version import __version__

__all__ = ["CkstoreError", "IntegrityError", "Repo", "__version__", "rng_state", "set_rng_state"]


def __getattr__(name: str) -> Any:
    # The RNG helpers need torch; importing them lazily keeps `import ckstore` (and the CLI) torch-free.
    if name in ("rng_state", "set_rng_state"):
        from ckstore.training import state

        return getattr(state, name)
    raise AttributeError(f"module 'ckstore' has no attribute {name!r}")

