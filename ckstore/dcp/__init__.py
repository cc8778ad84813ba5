"""Distributed checkpoints: ckstore as a torch.distributed.checkpoint storage backend.

``Writer`` and ``Reader`` (storage.py) import torch; they are loaded on first access so that
importing this package for its torch-free parts (consolidate.py, used by checkout) stays light.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Reader", "Writer", "saved_commit", "wait_compaction"]


def __getattr__(name: str) -> Any:
    if name == "wait_compaction":
        from ckstore.dcp.compaction import wait_compaction

        return wait_compaction
    if name in __all__:
        from ckstore.dcp import storage

        return getattr(storage, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
