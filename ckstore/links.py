"""The files that tie overlay repositories to their bases: ``alternates`` and ``dependents``.

``alternates`` (as git's objects/info/alternates) lists the base repositories whose objects this
one reads through; ``dependents`` lists the overlay repositories that read through this one, so
its gc keeps what they need. One location per line (docs/format.md).
"""

from __future__ import annotations

from .backend.base import Backend

ALTERNATES_KEY = "alternates"
DEPENDENTS_KEY = "dependents"
MAX_BASE_DEPTH = 16  # base repositories of base repositories…: stop a cycle in a damaged setup


def read_paths(backend: Backend, key: str) -> list[str]:
    try:
        text = backend.get(key).decode("utf-8")
    except (KeyError, UnicodeDecodeError):
        return []
    return [line for line in text.splitlines() if line.strip()]


def add_path(backend: Backend, key: str, path: str) -> None:
    paths = read_paths(backend, key)
    if path not in paths:
        backend.replace(key, "".join(f"{p}\n" for p in [*paths, path]).encode())
