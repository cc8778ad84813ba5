"""Where numba keeps ckstore's compiled kernels: a folder only this user can write, or none.

numba's on-disk cache (``cache=True``) reads its index with ``pickle``, so whoever can write the
cache folder runs code in every process that loads the kernels. numba's own defaults are the
``__pycache__`` beside the source (writable in a shared or editable install) or whatever
``NUMBA_CACHE_DIR`` names (often a shared folder under /tmp on clusters). The kernels are cached
only in a folder that is as trusted as the installed code:

- ``NUMBA_CACHE_DIR`` when the user set it and it passes the checks below;
- else, when it is not set, ``$XDG_CACHE_HOME/ckstore/numba`` (``~/.cache/ckstore/numba``),
  created with mode 0700;
- else no on-disk cache: each process compiles the kernels again (~2.6 s of CPU), which is slow
  but runs nothing anyone else wrote.

A folder passes when it is a real folder (not a symlink), owned by this user, writable by nobody
else, and every folder above it is owned by this user or root and writable by nobody else unless
sticky (/tmp): nobody else can then rename or replace it. When others can enter the folder, the
entries numba would read for ckstore's kernels are checked the same way (a file left writable by
a permissive umask).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH
_REPORTED: set[str] = set()  # reasons already returned as news, so a process says each once


@dataclass(frozen=True)
class KernelCache:
    """The folder numba caches ckstore's kernels in, or None with the reason it is not cached."""

    folder: Path | None
    reason: str = ""
    news: bool = False  # the first time this process meets this reason (worth a warning)


def _owned_and_private(st: os.stat_result, uid: int, what: str, *, allow_root: bool, allow_sticky: bool) -> str:
    """Why an entry with these stats is unsafe, or "" when it is not."""
    if st.st_uid != uid and not (allow_root and st.st_uid == 0):
        return f"{what} is owned by another user (uid {st.st_uid})"
    if st.st_mode & _WRITABLE_BY_OTHERS and not (allow_sticky and st.st_mode & stat.S_ISVTX):
        return f"{what} is writable by other users"
    return ""


def unsafe_reason(folder: Path, entries: list[Path] | None = None) -> str:
    """Why ``folder`` may not hold a cache that is read with pickle, or "" when it may."""
    uid = os.geteuid()
    try:
        st = os.lstat(folder)
    except OSError as exc:
        return f"{folder} cannot be read ({exc.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return f"{folder} is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return f"{folder} is not a folder"
    reason = _owned_and_private(st, uid, str(folder), allow_root=False, allow_sticky=False)
    if reason:
        return reason
    for parent in folder.absolute().parents:
        try:
            pst = os.stat(parent)
        except OSError as exc:
            return f"{parent} cannot be read ({exc.strerror})"
        reason = _owned_and_private(pst, uid, str(parent), allow_root=True, allow_sticky=True)
        if reason:
            return reason
    if not st.st_mode & (stat.S_IXGRP | stat.S_IXOTH):
        return ""  # nobody else can reach what is inside, whatever its modes
    for entry in entries or []:
        try:
            est = os.lstat(entry)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(est.st_mode):
            return f"{entry} is a symlink"
        reason = _owned_and_private(est, uid, str(entry), allow_root=False, allow_sticky=False)
        if reason:
            return reason
    return ""


def _default_folder(env: Mapping[str, str]) -> Path:
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ckstore" / "numba"


def _kernel_entries(folder: Path, source: Path) -> list[Path]:
    """The subfolder numba caches ``source``'s functions in, and the files in it."""
    from numba.core.caching import _CacheLocator

    sub = folder / _CacheLocator.get_suitable_cache_subpath(str(source))
    try:
        return [sub, *sub.iterdir()]
    except OSError:
        return [sub]


def choose(source: Path, environ: Mapping[str, str] | None = None) -> KernelCache:
    """The folder to cache the kernels of ``source`` (a module file) in, creating the default."""
    env = os.environ if environ is None else environ
    if env.get("NUMBA_CACHE_LOCATOR_CLASSES"):
        return KernelCache(None, "NUMBA_CACHE_LOCATOR_CLASSES chooses numba's cache folders")
    given = env.get("NUMBA_CACHE_DIR", "")
    folder = Path(given) if given else _default_folder(env)
    if not given:
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            return KernelCache(None, f"{folder} cannot be created ({exc.strerror})")
    reason = unsafe_reason(folder, _kernel_entries(folder, source))
    return KernelCache(None, reason) if reason else KernelCache(folder)


def configure_numba(source: str) -> KernelCache:
    """Point numba (already imported) at the folder ``choose`` gives; call before the decorators.

    numba reads its cache folder when a function is decorated, and its compiler re-reads the
    environment, so both ``numba.config`` and ``NUMBA_CACHE_DIR`` are set. When no folder is safe
    the caller compiles without ``cache=True``."""
    import numba

    cache = choose(Path(source))
    if cache.folder is None:
        news = cache.reason not in _REPORTED
        _REPORTED.add(cache.reason)
        return KernelCache(None, cache.reason, news)
    os.environ["NUMBA_CACHE_DIR"] = str(cache.folder)
    config: Any = numba.config
    config.CACHE_DIR = str(cache.folder)
    return cache
