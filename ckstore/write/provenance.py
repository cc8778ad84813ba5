"""Where a commit came from, recorded automatically (no torch import: versions come from metadata).

Collecting it costs a commit ~0.05-0.09 s (importing importlib.metadata, which then scans
sys.path for torch's distribution, and running git), so a commit starts it on a thread
(``start``) while its chunks are hashed and compressed, which release the GIL.
"""

from __future__ import annotations

import getpass
import os
import platform
import socket
import threading
from pathlib import Path

from ckstore.version import __version__


def _package_version(name: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit(cwd: Path) -> str | None:
    import subprocess

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


class Pending:
    """``collect()`` running on a thread; ``result`` waits for it (and raises what it raised)."""

    def __init__(self, cwd: str | os.PathLike[str] | None = None) -> None:
        self._value: dict[str, str] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(cwd,), name="ckstore-provenance", daemon=True)
        self._thread.start()

    def _run(self, cwd: str | os.PathLike[str] | None) -> None:
        try:
            self._value = collect(cwd)
        except BaseException as exc:  # handed to the committing thread, which reports it
            self._error = exc

    def result(self) -> dict[str, str]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._value is not None
        return self._value


def start(cwd: str | os.PathLike[str] | None = None) -> Pending:
    """Start collecting the provenance of a commit about to be made."""
    return Pending(cwd)
