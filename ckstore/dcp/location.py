"""Where a DCP save or load goes: a repository, and optionally a name in it.

``Writer(repo)`` / ``Reader(repo)`` take a repository (a path, or an object with a ``path``
such as ``ckstore.Repo``). Call sites that pass a path instead (``dcp.save(state,
checkpoint_id=PATH, storage_writer=Writer())``, Lightning's, torchtitan's and Accelerate's
checkpoint managers) reach ``reset(PATH)``; ``checkpoint_path`` reads such a path:

- ``<repo>`` (a repository folder, or a folder holding ``.ckstore``): the repository itself, no
  name. A save commits on the Writer's branch (default: the current one); a load reads HEAD.
- ``<repo>/<name>`` (``<name>`` may hold ``/``): a ref in that repository. A save commits on
  branch ``<name>`` when one exists, else on the Writer's branch, and then points tag
  ``<name>`` at the commit (moving it if it exists, as saving to the same folder again replaces
  what was there); a load reads what ``<name>`` resolves to (a branch, tag or commit id).

Only the prefixes of the path as written are tried (for a relative path, down to the current
folder), nearest first, so ``ckpt/step-100`` with ``ckpt`` a repository is tag ``step-100`` of
``ckpt`` whether or not a folder ``ckpt/step-100`` exists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from ckstore.backend.local_location import locate_repository
from ckstore.errors import InvalidInputError
from ckstore.format.settings import CONFIG_KEY
from ckstore.repository.context import DEFAULT_DIR


@dataclass(frozen=True)
class CheckpointPath:
    """A checkpoint path, parsed: the repository it lies in and the name after it."""

    repo: Path  # the repository's folder as written (``.ckstore`` child or the repository itself)
    name: str | None  # the ref or commit after the repository; None: the repository alone


def repository_location(repo: Any) -> str | os.PathLike[str]:
    """A repository path, or an object with a ``path`` (``ckstore.Repo``)."""
    path = getattr(repo, "path", repo)
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidInputError("the repository must be given as a path, or a remote URL (s3://bucket/prefix)")
    return path


def checkpoint_path(checkpoint_id: str | os.PathLike[str]) -> CheckpointPath | None:
    """``checkpoint_id`` as ``<repo>`` or ``<repo>/<name>`` (module docstring), or None when no
    prefix of it is a repository."""
    text = os.fspath(checkpoint_id)
    if not isinstance(text, str) or not text or "://" in text:
        return None
    path = Path(text)
    parts = path.parts
    anchored = path.is_absolute()
    for cut in range(len(parts), -1, -1):
        if cut == 0 and anchored:
            break  # the file system root is never a checkpoint's repository
        prefix = Path(*parts[:cut]) if cut else Path(".")
        if locate_repository(prefix, CONFIG_KEY, DEFAULT_DIR) is None:
            continue
        rest = parts[cut:]
        if any(p in (".", "..") for p in rest):
            raise InvalidInputError(f"checkpoint path {text!r}: the name after the repository has '.' or '..' in it")
        return CheckpointPath(prefix, str(PurePosixPath(*rest)) if rest else None)
    return None
