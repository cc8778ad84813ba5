"""Branches, tags and HEAD: validated names, compare-and-swap updates under lock files.

A ref is the file ``refs/heads/<name>`` or ``refs/tags/<name>`` holding a commit id and a
newline; names follow git's check-ref-format and are percent-encoded into backend keys
(docs/format.md section 6). ``HEAD`` holds ``ref: refs/heads/<branch>``. An update takes
``<ref>.lock`` with an exclusive create (as git's lockfile.h does), re-reads the ref, checks it
still holds the value the caller expects, replaces it atomically and drops the lock: concurrent
writers serialise and exactly one of two racing updates from the same old value wins. Every change is recorded in
the ref's reflog (reflog.py) under the same lock, before the ref file changes.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ckstore.backend.base import Backend
from ckstore.backend.fsio import break_stale_lock, dead_owner, owner_surely_dead, pid_alive, process_owner
from ckstore.errors import (
    IntegrityError,
    InvalidRefNameError,
    LockedError,
    RefChangedError,
    RefExistsError,
    StorageError,
)
from ckstore.format.ids import ObjectId, is_object_id
from ckstore.repository.reflog import RefLog, switch_what

HEADS = "refs/heads/"
TAGS = "refs/tags/"
REFS = "refs/"  # every ref name begins with it
REMOTES = "refs/remotes/"  # remote-tracking refs, NAME/BRANCH (remote/fetch.py)
HEAD = "HEAD"
DEFAULT_BRANCH = "main"
LOCK_SUFFIX = ".lock"
LOCK_WAIT = 10.0
# Characters git's check-ref-format refuses anywhere in a ref name (refs.c refname_disposition);
# '*' is allowed there only in refspec patterns, which ckstore does not have.
_FORBIDDEN = frozenset(" ~^:?[\\*\x7f") | {chr(c) for c in range(0x20)}
# Bytes a ref key keeps as they are: what backend.check_key allows in a component, and '/'.
# This was the whole character set of ref names before, so their keys are unchanged.
_PLAIN = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._@+-/")
_ESCAPE = re.compile(r"%([0-9A-F]{2})")
MAX_KEY_COMPONENT = 250  # bytes: a file name is at most 255, and "<component>.lock" must fit
MAX_KEY_NAME = 600  # bytes: keeps refs/tags/<name>.lock well inside macOS's 1024-byte PATH_MAX


class _Any:
    """Sentinel: update the ref whatever it holds now."""


ANY = _Any()


def _hostname() -> str:
    import socket  # only ref locks need it: a command that reads refs starts without it

    return socket.gethostname()


def _char(ch: str) -> str:
    if ch == " ":
        return "a space"
    if ch < " " or ch == "\x7f":
        return f"a control character (U+{ord(ch):04X})"
    return f"'{ch}'"


def refname_problem(refname: str, allow_onelevel: bool = False) -> str | None:
    """Why git's ``check_refname_format`` (refs.c) refuses a full ref name, or None if it accepts it.

    ``allow_onelevel`` is git's REFNAME_ALLOW_ONELEVEL (``--allow-onelevel``). Pure: no I/O.
    """
    if not refname:
        return "it is empty"
    if any("\ud800" <= ch <= "\udfff" for ch in refname):
        # ckstore: undecodable argv bytes arrive as lone surrogates, which UTF-8 cannot store.
        return "it is not valid Unicode text"
    if refname == "@":
        return "it is '@' alone, which git reads as HEAD"
    bad = next((ch for ch in refname if ch in _FORBIDDEN), None)
    if bad is not None:
        return f"it contains {_char(bad)}"
    for seq in ("..", "@{"):
        if seq in refname:  # '/' cannot split either sequence: a component cannot start with '.'
            return f"it contains {seq!r}"
    if refname.startswith("/"):
        return "it starts with '/'"
    if refname.endswith("/"):
        return "it ends with '/'"
    if "//" in refname:
        return "it contains '//'"
    parts = refname.split("/")
    for part in parts:
        if part.startswith("."):
            return f"its component {part!r} starts with '.'"
        if part.endswith(LOCK_SUFFIX):
            return f"its component {part!r} ends with '.lock'"
    if refname.endswith("."):
        return "it ends with '.'"
    if not allow_onelevel and len(parts) < 2:
        return "it has only one component"
    return None


def _short_name_problem(name: object) -> str | None:
    if not isinstance(name, str) or not name:
        return "it is empty"
    problem = refname_problem(name, allow_onelevel=True)
    if problem:
        return problem
    # git's check_branch_ref / check_tag_ref: a leading '-' reads as an option, HEAD is taken.
    if name.startswith("-"):
        return "it starts with '-'"
    if name == HEAD:
        return "'HEAD' is reserved"
    # ckstore: a revision starting with refs/ is a full ref name, so such a branch could never be
    # named by its short name (git would create the ambiguous refs/heads/refs/heads/x).
    if name.startswith("refs/"):
        hint = next(
            (
                f"; give the short name {name[len(p) :]!r}"
                for p in (HEADS, TAGS)
                if name.startswith(p) and len(name) > len(p)
            ),
            "",
        )
        return f"it starts with 'refs/', which names a full ref{hint}"
    # On-disk safety (docs/format.md section 6): file and path names have length limits.
    key = encode_ref(name)
    if len(key) > MAX_KEY_NAME:
        return f"it takes {len(key)} bytes stored (percent-encoded), more than {MAX_KEY_NAME}"
    long = next((p for p in key.split("/") if len(p) > MAX_KEY_COMPONENT), None)
    if long is not None:
        return f"a component takes {len(long)} bytes stored (percent-encoded), more than {MAX_KEY_COMPONENT}"
    return None


def check_ref_name(name: str, what: str = "ref name") -> str:
    """Validate a branch or tag short name as ``git branch``/``git tag`` do, plus ckstore's storage
    limits; refuse with a one-line error naming the rule broken."""
    problem = _short_name_problem(name)
    if problem:
        raise InvalidRefNameError(f"invalid {what} {name!r}: {problem}")
    return name


def ref_candidates(name: str) -> list[str]:
    """The full ref names a revision may mean, in the order to try (git's rev-parse order, except
    that a branch wins over a tag, as ckstore always did). Refuses invalid names."""
    if name.startswith("refs/"):
        # Only git's format rules: a ref an older ckstore stored under a name now refused for
        # new refs (refs/heads/refs/heads/x) stays reachable by its full name.
        problem = refname_problem(name)
        if problem:
            raise InvalidRefNameError(f"invalid ref name {name!r}: {problem}")
        return [name]
    check_ref_name(name, "revision")
    return [HEADS + name, TAGS + name]


def encode_ref(ref: str) -> str:
    """The backend key of a (full or short) ref name: its UTF-8 bytes, percent-encoded (uppercase
    hex) outside ``_PLAIN``. Injective, ASCII-only, and the identity on every name stored before."""
    return "".join(chr(b) if b in _PLAIN else f"%{b:02X}" for b in ref.encode("utf-8"))


def decode_ref(key: str) -> str | None:
    """The ref name stored under ``key``, or None when the key is no canonical encoding of a valid
    full ref name (a stray file)."""
    try:
        raw = _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), key).encode("latin-1")
        ref = raw.decode("utf-8")
    except UnicodeError:
        return None
    if encode_ref(ref) != key or refname_problem(ref):
        return None
    return ref


def _decode_log_ref(key: str) -> str | None:
    """A log's ref from its key: an encoded full ref name, or HEAD (whose log is HEAD's own)."""
    return HEAD if key == HEAD else decode_ref(key)


class RefStore:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        # The logs live under the same keys as the refs (below logs/): give RefLog the ref-key
        # encoding (and its inverse) wherever ref names map to keys other than themselves.
        self.logs = RefLog(backend, encode=encode_ref, decode=_decode_log_ref)

    # ---- reading -----------------------------------------------------------------------------

    def read(self, ref: str) -> ObjectId | None:
        """The commit id a full ref name (``refs/heads/<name>``) holds, or None when it is absent."""
        try:
            data = self.backend.get(encode_ref(ref))
        except KeyError:
            return None
        text = data.decode("ascii", "replace").strip()
        if not is_object_id(text) or data != (text + "\n").encode():
            raise IntegrityError(f"ref {ref} is corrupt: it does not hold a commit id")
        return ObjectId(text)

    def entries(self, prefix: str) -> Iterator[tuple[str, str | None]]:
        """(key, full ref name) of every ref file under ``prefix``; the name is None for a file
        whose name is no encoded ref name (see ``stray_error``). Lock files are skipped."""
        for key in self.backend.list(prefix):
            if not key.endswith(LOCK_SUFFIX):
                yield key, decode_ref(key)

    def stray_error(self, key: str) -> IntegrityError:
        return IntegrityError(
            f"stray file {self.backend.describe(key)}: its name is not an encoded ref name; move it out of refs/"
        )

    def list(self, prefix: str) -> dict[str, ObjectId]:
        """Short name → commit id for every ref under ``prefix`` (``refs/heads/``, ``refs/tags/``)."""
        out: dict[str, ObjectId] = {}
        for key, ref in self.entries(prefix):
            if ref is None:
                raise self.stray_error(key)  # it might be a ref gc must keep: do not guess
            oid = self.read(ref)
            if oid is not None:
                out[ref[len(prefix) :]] = oid
        return out

    def head_branch(self) -> str:
        try:
            data = self.backend.get(HEAD).decode("utf-8")
        except KeyError:
            return DEFAULT_BRANCH
        except UnicodeDecodeError:
            raise IntegrityError("HEAD is corrupt: it is not UTF-8 text") from None
        if not data.startswith("ref: " + HEADS) or not data.endswith("\n"):
            raise IntegrityError("HEAD is corrupt: it does not name a branch")
        branch = data[len("ref: " + HEADS) : -1]
        # Git's format rules only: a branch an older ckstore created stays usable as HEAD.
        problem = refname_problem(HEADS + branch)
        if problem:
            raise InvalidRefNameError(f"invalid branch name in HEAD {branch!r}: {problem}")
        return branch

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
        lock = encode_ref(ref) + LOCK_SUFFIX
        owner = json.dumps(process_owner()).encode()
        deadline = time.monotonic() + LOCK_WAIT
        while True:
            try:
                if self.backend.create_exclusive(lock, owner):
                    break
            except StorageError:
                self._release(lock, owner)  # linked before the failure (fsync): must not outlive us
                raise
            if self._break_stale_lock(lock, owner):
                continue
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

    def _break_stale_lock(self, lock: str, owner: bytes) -> bool:
        """Remove ``lock`` if the process that holds it is certainly dead (killed inside a ref
        update: a training job preempted at its commit), so the next command goes on; True when
        removed. Breaking is serialised by a second lock (``<ref>.lock.lock``), and the lock is
        deleted only if it still holds the bytes judged stale, so two processes breaking at once
        never delete a lock a live process has just taken. A stale lock that cannot be proven
        stale (an older lock without the process's namespace) is reported with the remedy."""
        try:
            stale = self.backend.get(lock)
            info = json.loads(stale)
            pid, host = int(info["pid"]), str(info["host"])
        except KeyError:
            return False  # released meanwhile
        except (ValueError, TypeError):
            return False  # being written right now, or unreadable: let the timeout speak
        if host != _hostname():
            return False
        if not owner_surely_dead(info):
            if "pidns" in info or pid_alive(pid):
                return False  # alive, or in another pid namespace: it may be; wait for it
            raise LockedError(
                f"stale lock {self.backend.describe(lock)} left by process {pid}, which is no longer running;"
                " if no ckstore command is running, delete that file and retry"
            )
        breaker = lock + LOCK_SUFFIX  # "<ref>.lock.lock": no ref can be named "<ref>.lock"
        broken = break_stale_lock(
            stale,
            read_lock=lambda: self.backend.get(lock),
            delete_lock=lambda: self.backend.delete(lock),
            take_breaker=lambda: self.backend.create_exclusive(breaker, owner),
            drop_breaker=lambda: self._release(breaker, owner),
        )
        if not broken:
            self._refuse_stale_breaker(breaker)
        return broken

    def _refuse_stale_breaker(self, breaker: str) -> None:
        """A breaker is held for one read and one delete; one whose process died is left to a user."""
        try:
            info = dead_owner(self.backend.get(breaker))
        except KeyError:
            return
        if info is not None:
            raise LockedError(
                f"stale lock {self.backend.describe(breaker)} left by process {info.get('pid')}, which is no longer"
                " running; if no ckstore command is running, delete that file and retry"
            )

    def _check_no_conflict(self, ref: str) -> None:
        """Refuse a new ref that would share a file or folder with an existing one: "a" and "a/b"
        everywhere, and names that differ only in letter case on case-insensitive file systems."""
        key = encode_ref(ref)
        parts, names = key.split("/"), ref.split("/")  # '/' is never escaped: components pair up
        for i in range(3, len(parts)):
            if self.backend.exists("/".join(parts[:i])):
                raise RefExistsError(f"cannot create {ref}: {'/'.join(names[:i])} exists")
        if any(True for _ in self.backend.list(key + "/")):
            raise RefExistsError(f"cannot create {ref}: refs exist below it")
        # A repository must stay usable when copied to macOS or Windows: keys are ASCII, so
        # ASCII case folding is exactly what such a file system does to them.
        folded = key.lower().split("/")
        for other, other_ref in self.entries("/".join(parts[:2]) + "/"):
            theirs = other.split("/")
            for i, (mine, their) in enumerate(zip(parts, theirs)):
                if mine == their:
                    continue
                if folded[i] == their.lower():
                    shown = _short(other_ref) if other_ref else self.backend.describe(other)
                    raise RefExistsError(
                        f"cannot create {_short(ref)}: {shown} exists, and {names[i]!r} differs from it only"
                        " in letter case (one name on case-insensitive file systems such as macOS's)"
                    )
                break

    def update(self, ref: str, new: ObjectId, expected: ObjectId | None | _Any = ANY, reason: str = "update") -> None:
        """Point ``ref`` at ``new`` if it still holds ``expected`` (None: must not exist yet);
        ``reason`` is what its reflog entry says ("commit: <message>", "reset: moving to …")."""
        if expected is None or self.read(ref) is None:
            # Checked before taking the lock too: "a/b.lock" cannot even be created when "a" is a
            # ref, and on a case-insensitive file system "Main" reads as an existing "main".
            self._check_no_conflict(ref)
        with self._locked(ref):
            current = self.read(ref)
            if not isinstance(expected, _Any) and current != expected:
                if expected is None:
                    raise RefExistsError(f"{_short(ref)} already exists")
                raise RefChangedError(
                    f"{_short(ref)} moved from {expected[:12]} to {str(current)[:12]} while this command ran"
                )
            if current is None:
                self._check_no_conflict(ref)
            if current == new:
                return  # nothing changes, nothing to record
            self.logs.append(ref, current, new, reason)
            self.backend.replace(encode_ref(ref), f"{new}\n".encode())

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
            deleted = self.backend.delete(encode_ref(ref))
        # Once the lock file is gone too: folders that only held this ref must not block "a".
        self.backend.prune_folders(encode_ref(ref), "/".join(ref.split("/")[:2]))
        return deleted


def _short(ref: str) -> str:
    for prefix, word in ((HEADS, "branch"), (TAGS, "tag")):
        if ref.startswith(prefix):
            return f"{word} {ref[len(prefix) :]!r}"
    return ref
