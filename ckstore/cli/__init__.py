"""The ``ckstore`` command: parse arguments, call ``Repo``, print. No storage work happens here.

Commands live in one module per group (files, inspect, refs, maintenance, overlays, overview, remotes); the
group in base.py imports a module when one of its commands runs or is listed (``COMMAND_MODULES``).

This file imports nothing heavy: ``run``, the entry point, first makes Ctrl-C during start-up
(importing click and the command modules, a tenth of a second) a one-line message and exit 130,
as Ctrl-C is at every later moment, instead of a traceback from inside an import.
"""

from __future__ import annotations

import os
import signal
from typing import Any

EXIT_INTERRUPTED = 130


def _interrupted_while_starting(signum: int, frame: object) -> None:
    # Nothing has been read or written yet: leaving at once is safe, and no import is half-done
    # in a way anyone could observe.
    try:
        os.write(2, b"ckstore: interrupted\n")
    except OSError:
        pass  # stderr closed: the exit code says it
    os._exit(EXIT_INTERRUPTED)


def run() -> None:
    """The ``ckstore`` command (pyproject.toml [project.scripts])."""
    ours = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if ours:
        signal.signal(signal.SIGINT, _interrupted_while_starting)
    from ckstore.cli.base import run as run_command

    if ours:
        # From here on click turns Ctrl-C into "interrupted" (exit 130), and each command's own
        # handler (base.pass_repo) takes over while it runs.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    run_command()


def __getattr__(name: str) -> Any:
    if name == "main":
        from ckstore.cli.base import main

        return main
    raise AttributeError(f"module 'ckstore.cli' has no attribute {name!r}")


__all__ = ["main", "run"]
