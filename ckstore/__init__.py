"""ckstore: a content-addressed, deduplicating checkpoint store for PyTorch training."""

from __future__ import annotations

__version__ = "0.1.0"

from .errors import CkstoreError, IntegrityError  # noqa: E402
from .repo import Repo  # noqa: E402

__all__ = ["CkstoreError", "IntegrityError", "Repo", "__version__"]
