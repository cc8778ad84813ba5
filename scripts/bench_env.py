"""The environment the benchmarks run the ``ckstore`` command in: Python as a user's has it.

An installed package's modules are compiled once (pip writes the .pyc files at install) and read
from the bytecode cache at every start. This machine sets PYTHONDONTWRITEBYTECODE, and a source
tree run that way compiles every ckstore module at every start (0.1-0.3 s of a command's start-up
here), a cost no user pays. The cache is kept out of the source tree (PYTHONPYCACHEPREFIX).
"""

from __future__ import annotations

import compileall
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def installed_like_env(cache: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with bytecode cached under ``cache``,
    ckstore's modules compiled there now (as pip does), and that cache used by every process
    started with it (the command and the compaction it detaches)."""
    env = dict(os.environ if base is None else base)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(cache)
    previous = sys.pycache_prefix
    sys.pycache_prefix = str(cache)
    try:
        compileall.compile_dir(str(ROOT / "ckstore"), quiet=1)
    finally:
        sys.pycache_prefix = previous
    return env
