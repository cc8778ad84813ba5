"""The files that tie overlay repositories to their bases: ``alternates`` and ``dependents``.

``alternates`` (as git's objects/info/alternates) lists the base repositories whose objects this
one reads through; ``dependents`` lists the overlay repositories that read through this one, so
its gc keeps what they need. One entry per line (docs/format.md, section 12): a path relative to
the repository folder holding the file when both repositories share a folder, so that moving
that folder keeps every link; otherwise an absolute path. ``location`` records where this
repository was when it last wrote its links, so that after a move ``relink`` can tell its own
old entry in a base's ``dependents`` from another overlay's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ckstore.backend.base import Backend
from ckstore.errors import InvalidInputError

ALTERNATES_KEY = "alternates"
DEPENDENTS_KEY = "dependents"
LOCATION_KEY = "location"
MAX_BASE_DEPTH = 16  # base repositories of base repositories…: stop a cycle in a damaged setup


def read_paths(backend: Backend, key: str) -> list[str]:
    try:
        text = backend.get(key).decode("utf-8")
    except (KeyError, UnicodeDecodeError):
        return []
    return [line for line in text.splitlines() if line.strip()]


def write_paths(backend: Backend, key: str, paths: list[str]) -> None:
    if paths:
        backend.replace(key, "".join(f"{p}\n" for p in paths).encode())
    else:
        backend.delete(key)


def resolve_entry(entry: str, holder: str) -> str:
    """The absolute location an entry names; a relative one is relative to ``holder``, the
    repository folder whose file holds it (as git resolves relative alternates)."""
    return os.path.realpath(os.path.join(holder, entry))


def link_entry(target: str, holder: str, same_device: bool = True) -> str:
    """How ``holder`` records ``target`` (both absolute): relative when they share a folder below
    the file-system root on one device (a project folder moved as a whole keeps its links),
    else absolute (a base on another disk stays put when the project moves)."""
    for path in (target, holder):
        if not os.path.isabs(path) or any(ord(c) < 32 or c == "\x7f" for c in path):
            raise InvalidInputError(
                f"cannot record repository location {path!r}: it must be absolute, without control characters"
            )
    common = os.path.commonpath([target, holder])
    if not same_device or os.path.dirname(common) == common:
        return target
    return os.path.relpath(target, holder)


def on_same_device(a: str, b: str) -> bool:
    try:
        return os.stat(a).st_dev == os.stat(b).st_dev
    except OSError:
        return False


def entry_for(target: str, holder: str, allow_relative: bool = True) -> str:
    return link_entry(target, holder, allow_relative and on_same_device(target, holder))


def read_location(backend: Backend) -> str | None:
    """Where this repository was when it last wrote its links (None: never recorded)."""
    paths = read_paths(backend, LOCATION_KEY)
    return paths[0] if paths and os.path.isabs(paths[0]) else None


def write_location(backend: Backend, location: str) -> None:
    write_paths(backend, LOCATION_KEY, [location])


@dataclass(frozen=True)
class Link:
    """One line of ``alternates`` or ``dependents`` and the repository location it names now."""

    entry: str
    location: str


def read_links(backend: Backend, key: str, holder: str) -> list[Link]:
    return [Link(entry, resolve_entry(entry, holder)) for entry in read_paths(backend, key)]


def add_link(backend: Backend, key: str, holder: str, target: str, entry: str) -> bool:
    """Record ``target`` as ``entry`` in ``holder``'s file unless an entry names it; True if written."""
    links = read_links(backend, key, holder)
    if any(link.location == target for link in links):
        return False
    write_paths(backend, key, [*(link.entry for link in links), entry])
    return True
