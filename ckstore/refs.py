"""Branches, tags and HEAD: validated names, compare-and-swap updates under lock files.

A ref is the file ``refs/heads/<name>`` or ``refs/tags/<name>`` holding a commit id and a
newline. ``HEAD`` holds ``ref: refs/heads/<branch>``. An update takes ``<ref>.lock`` with an
exclusive create (as git's lockfile.h does), re-reads the ref, checks it still holds the value
the caller expects, replaces it atomically and drops the lock: concurrent writers serialise and
exactly one of two racing updates from the same old value wins. Every change is recorded in
the ref's reflog (reflog.py) under the same lock, before the ref file changes.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

from .backend.base import Backend
from .fsio import pid_alive
from .errors import (
    IntegrityError,
    InvalidRefNameError,
    LockedError,
    RefChangedError,
    RefExistsError,
    StorageError,
)
from .ids import ObjectId, is_object_id
from .reflog import RefLog, switch_what

HEADS = "refs/heads/"
TAGS = "refs/tags/"
HEAD = "HEAD"
DEFAULT_BRANCH = "main"
LOCK_SUFFIX = ".lock"
LOCK_WAIT = 10.0
_ALLOWED = re.compile(r"[A-Za-z0-9._/@+-]+")


class _Any:
    """Sentinel: update the ref whatever it holds now."""


ANY = _Any()


def check_ref_name(name: str, what: str = "ref name") -> str:
    """Validate a branch or tag name by git's check-ref-format rules, more strictly on characters."""
    problem = None
    if not isinstance(name, str) or not name:
        problem = "is empty"
    elif not _ALLOWED.fullmatch(name):
        problem = "holds a space, control or special character"
    elif name.startswith("-"):
        problem = "starts with '-'"
    elif ".." in name or "//" in name or "@{" in name or name == "@":
        problem = "holds '..', '//' or '@{'"
    elif name.startswith("/") or name.endswith("/") or name.endswith("."):
        problem = "starts or ends with '/' or ends with '.'"
    elif any(part.startswith(".") or part.endswith(LOCK_SUFFIX) for part in name.split("/")):
        problem = "has a component starting with '.' or ending with '.lock'"
    elif name == HEAD or len(name) > 200:
        problem = "is reserved or too long"
    if problem:
        raise InvalidRefNameError(f"invalid {what} {name!r}: it {problem}")
    return name


class RefStore:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        # The logs live under the same keys as the refs (below logs/): give RefLog the ref-key
        # encoding (and its inverse) wherever ref names map to keys other than themselves.
        self.logs = RefLog(backend)

    # ---- reading -----------------------------------------------------------------------------

    def read(self, ref: str) -> ObjectId | None:
        try:
            data = self.backend.get(ref)
        except KeyError:
            return None
        text = data.decode("ascii", "replace").strip()
        if not is_object_id(text) or data != (text + "\n").encode():
            raise IntegrityError(f"ref {ref} is corrupt: it does not hold a commit id")
        return ObjectId(text)

    def list(self, prefix: str) -> dict[str, ObjectId]:
        """Short name → commit id for every ref under ``prefix`` (``refs/heads/``, ``refs/tags/``)."""
        out: dict[str, ObjectId] = {}
        for key in self.backend.list(prefix):
            if key.endswith(LOCK_SUFFIX):
                continue
            oid = self.read(key)
            if oid is not None:
                out[key[len(prefix):]] = oid
        return out

    def head_branch(self) -> str:
        try:
            data = self.backend.get(HEAD).decode("utf-8", "replace")
        except KeyError:
            return DEFAULT_BRANCH
        if not data.startswith("ref: " + HEADS) or not data.endswith("\n"):
            raise IntegrityError("HEAD is corrupt: it does not name a branch")
        return check_ref_name(data[len("ref: " + HEADS):-1], "branch name in HEAD")

    def set_head_branch(self, branch: str, reason: str | None = None) -> None:
        """Point HEAD at ``branch``; with a ``reason``, under HEAD's lock and logged in HEAD's
        reflog (old and new: the commits HEAD meant before and after)."""
        value = f"ref: {HEADS}{check_ref_name(branch, 'branch name')}\n".encode()
        if reason is None:  # a new repository: nothing to record
            self.backend.replace(HEAD, value)
            return
        with self._locked(HEAD):
            try:
                old_branch: str | None = self.head_branch()
            except (IntegrityError, InvalidRefNameError):
                old_branch = None  # a damaged HEAD: switching is how it is repaired
            if old_branch == branch:
                return
            old = self.read(HEADS + old_branch) if old_branch else None
            self.logs.append(HEAD, old, self.read(HEADS + branch), switch_what(reason, old_branch, branch))
            self.backend.replace(HEAD, value)

    # ---- writing -----------------------------------------------------------------------------

    @contextmanager
    def _locked(self, ref: str) -> Iterator[None]:
        # gc empties tmp/ under the exclusive repository lock, and a ref update writes through
        # tmp/ (its lock file, the new value): so it holds the repository lock shared, as a commit.
        with self.backend.shared_lock(), self._ref_lock(ref):
            yield

    @contextmanager
    def _ref_lock(self, ref: str) -> Iterator[None]:
        lock = ref + LOCK_SUFFIX
        owner = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "time": time.time()}).encode()
        deadline = time.monotonic() + LOCK_WAIT
        while True:
            try:
                if self.backend.create_exclusive(lock, owner):
                    break
            except StorageError:
                self._release(lock, owner)  # linked before the failure (fsync): must not outlive us
                raise
            self._refuse_stale_lock(lock)
            if time.monotonic() >= deadline:
                raise LockedError(f"ref {ref} is locked by another ckstore process; try again")
            time.sleep(0.02)
        try:
            yield
        finally:
            self._release(lock, owner)

    def _release(self, lock: str, owner: bytes) -> None:
        """Delete our own lock, trying twice: a leftover lock blocks the ref until a user acts."""
        for attempt in (1, 2):
            try:
                if self.backend.get(lock) == owner:
                    self.backend.delete(lock)
                return
            except KeyError:
                return
            except StorageError:
                if attempt == 2:
                    raise

    def _refuse_stale_lock(self, lock: str) -> None:
        try:
            info = json.loads(self.backend.get(lock))
            pid, host = int(info["pid"]), str(info["host"])
        except KeyError:
            return  # released meanwhile
        except (ValueError, TypeError):
            return  # being written right now, or unreadable: let the timeout speak
        if host == socket.gethostname() and not pid_alive(pid):
            raise LockedError(
                f"stale lock {self.backend.describe(lock)} left by process {pid}, which is no longer running;"
                " if no ckstore command is running, delete that file and retry"
            )

    def _check_no_dir_conflict(self, ref: str) -> None:
        parts = ref.split("/")
        for i in range(3, len(parts)):
            if self.backend.exists("/".join(parts[:i])):
                raise RefExistsError(f"cannot create {ref}: {'/'.join(parts[:i])} exists")
        if any(True for _ in self.backend.list(ref + "/")):
            raise RefExistsError(f"cannot create {ref}: refs exist below it")

    def update(self, ref: str, new: ObjectId, expected: ObjectId | None | _Any = ANY, reason: str = "update") -> None:
        """Point ``ref`` at ``new`` if it still holds ``expected`` (None: must not exist yet);
        ``reason`` is what its reflog entry says ("commit: <message>", "reset: moving to …")."""
        if self.read(ref) is None:
            # Checked before taking the lock too: "a/b.lock" cannot even be created when "a" is a ref.
            self._check_no_dir_conflict(ref)
        with self._locked(ref):
            current = self.read(ref)
            if not isinstance(expected, _Any) and current != expected:
                if expected is None:
                    raise RefExistsError(f"{_short(ref)} already exists")
                raise RefChangedError(
                    f"{_short(ref)} moved from {expected[:12]} to {str(current)[:12]} while this command ran"
                )
            if current is None:
                self._check_no_dir_conflict(ref)
            if current == new:
                return  # nothing changes, nothing to record
            self.logs.append(ref, current, new, reason)
            self.backend.replace(ref, f"{new}\n".encode())

    def delete(self, ref: str, expected: ObjectId | _Any = ANY, reason: str = "delete") -> bool:
        """Delete ``ref`` if it still holds ``expected``; False when it does not exist. Its
        reflog stays (with this deletion as its last entry), so its commits can be restored."""
        if self.read(ref) is None:
            return False  # nothing to lock; "a/b" may not even be lockable when "a" is a ref
        with self._locked(ref):
            current = self.read(ref)
            if current is None:
                return False
            if not isinstance(expected, _Any) and current != expected:
                raise RefChangedError(
                    f"{_short(ref)} moved from {expected[:12]} to {current[:12]} while this command ran"
                )
            self.logs.append(ref, current, None, reason)
            return self.backend.delete(ref)


def _short(ref: str) -> str:
    for prefix, word in ((HEADS, "branch"), (TAGS, "tag")):
        if ref.startswith(prefix):
            return f"{word} {ref[len(prefix):]!r}"
    return ref
