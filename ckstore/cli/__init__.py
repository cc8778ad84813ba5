"""The ``ckstore`` command: parse arguments, call ``Repo``, print. No storage work happens here.

Commands live in one module per group (files, inspect, refs, maintenance, overlays, overview, remotes); importing them
registers them on ``main``.
"""

from __future__ import annotations

from ckstore.cli import files
from ckstore.cli import inspect
from ckstore.cli import maintenance
from ckstore.cli import overlays
from ckstore.cli import overview
from ckstore.cli import refs
from ckstore.cli import remotes  # noqa: F401  (registers the commands)
from ckstore.cli.base import main, run

__all__ = ["main", "run"]
