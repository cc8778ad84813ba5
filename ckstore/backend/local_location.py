"""Where a local repository is: the folder a path names, the nearest one above a working folder,
and a new one's folder made ready (refusing one that holds anything)."""

from __future__ import annotations

import os
from pathlib import Path

from ckstore.backend.base import storage_error
from ckstore.errors import OutputExistsError, RefExistsError


def locate_repository(path: str | os.PathLike[str], marker: str, default_dir: str) -> Path | None:
    """The repository folder at ``path`` (or its ``default_dir`` child): where ``marker`` exists."""
    root = Path(path)
    for candidate in (root, root / default_dir):
        if (candidate / marker).is_file():
            return candidate
    return None


def find_repository(start: str | os.PathLike[str], marker: str, default_dir: str) -> Path | None:
    """The nearest ``default_dir`` holding ``marker`` at or above ``start``."""
    here = Path(start).resolve()
    for folder in (here, *here.parents):
        if (folder / default_dir / marker).is_file():
            return folder / default_dir
    return None


def prepare_new_repository(path: str | os.PathLike[str], marker: str) -> Path:
    """Create the folder for a new repository; refuse one that exists with anything in it."""
    root = Path(path)
    if (root / marker).exists():
        raise RefExistsError(f"a repository already exists at {root}")
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        # Exit 6, "output exists", as for init over a repository, not 5.
        raise OutputExistsError(f"{root} exists and is not an empty directory")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise storage_error(exc, f"creating {root}") from None
    return root
