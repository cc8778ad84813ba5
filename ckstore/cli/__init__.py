"""The ``ckstore`` command: parse arguments, call ``Repo``, print. No storage work happens here.

Commands live in one module per group (files, inspect, refs, maintenance, overlays, remotes); importing them
registers them on ``main``.
"""

from __future__ import annotations

from . import files, inspect, maintenance, overlays, refs, remotes  # noqa: F401  (registers the commands)
from .base import main, run

__all__ = ["main", "run"]
