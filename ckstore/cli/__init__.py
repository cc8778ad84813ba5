"""The ``ckstore`` command: parse arguments, call ``Repo``, print. No storage work happens here.

Commands live in one module per group (files, inspect, refs, maintenance, overlays, overview, remotes); the
group in base.py imports a module when one of its commands runs or is listed (``COMMAND_MODULES``).
"""

from __future__ import annotations

from ckstore.cli.base import main, run

__all__ = ["main", "run"]
