"""Where a commit came from, recorded automatically (no torch import: versions come from metadata)."""

from __future__ import annotations

import getpass
import importlib.metadata
import os
import platform
import socket
import subprocess
from pathlib import Path

from ckstore.version import __version__


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit(cwd: Path) -> str | None:
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    text = result.stdout.strip()
    return text if result.returncode == 0 and text else None


def collect(cwd: str | os.PathLike[str] | None = None) -> dict[str, str]:
    info = {
        "ckstore": __version__,
        "python": platform.python_version(),
        "hostname": socket.gethostname(),
    }
    torch_version = _package_version("torch")
    if torch_version:
        info["torch"] = torch_version
    try:
        info["user"] = getpass.getuser()
    except (KeyError, OSError):
        pass
    git = _git_commit(Path(cwd) if cwd else Path.cwd())
    if git:
        info["git_commit"] = git
    return info
