"""The reflog: every change of a branch, tag or HEAD, one line each, so that a mistaken delete,
reset or gc can be undone (docs/format.md section 13).

Each ref has its own log, ``logs/<ref key>/.log``; the log of a deleted ref stays, so its
commits can be found and restored. ``.log`` is never a ref name's component (none starts with
``.``), so the log of ``a`` and the folder of the logs of ``a/b`` never collide, whichever of the
two refs exists now.

A line is ``<old id> <new id> <unix time> <who>\\t<what>\\n``, 64 zeros for "none" (git's reflog
line, with ckstore's ids). The ref store appends it under the ref's lock and before the ref
changes, as git does: a crash in between leaves an entry for a change that did not happen (its
commit exists, nothing is lost), never a change without its entry. A last line without its
newline was torn by a crash: readers ignore it and the next append cuts it off.

gc keeps every commit an unexpired entry names, with its history. An entry expires after
``reflog_expire_days`` (90), or after ``reflog_expire_unreachable_days`` (30) when one of its
commits is not reachable from the ref's current value (git's gc.reflogExpire and
gc.reflogExpireUnreachable); ``gc --prune-now`` expires every such unreachable entry at once.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from ckstore.backend.base import Backend
from ckstore.errors import IntegrityError, RefNotFoundError
from ckstore.format.ids import ObjectId, is_object_id

LOGS = "logs/"
LOG_FILE = ".log"
HEAD_LOG = "HEAD"
NONE_ID = "0" * 64
MAX_WHAT = 300
DAY = 86400.0
_SWITCH = re.compile(r": moving from (\S+) to \S+$")


def now() -> float:
    """The time entries are stamped with and expiry is measured from (tests replace it)."""
    return time.time()


def _clean(text: str, limit: int) -> str:
    # One line, no tab (the field separator), nothing UTF-8 cannot hold (lone surrogates from argv).
    return "".join(ch if ch.isprintable() else " " for ch in text)[:limit]


def who() -> str:
    """``user@host``, as git records name and e-mail: enough to tell two machines apart."""
    import getpass  # writers only: a command that reads refs starts without it
    import socket

    try:
        user = getpass.getuser()
    except (OSError, KeyError, ImportError):  # no login name (containers without a passwd entry)
        user = "unknown"
    return _clean(f"{user}@{socket.gethostname()}", 100).replace(" ", "_") or "unknown"


def switch_what(reason: str, old_branch: str | None, new_branch: str) -> str:
    """What a HEAD entry says; ``HEAD@{n}`` reads the branch HEAD named before from it."""
    return f"{reason}: moving from {old_branch or '?'} to {new_branch}"


def switched_from(what: str) -> str | None:
    m = _SWITCH.search(what)
    return m.group(1) if m else None


@dataclass(frozen=True)
class Entry:
    ref: str  # full ref name ("refs/heads/main"), or "HEAD"
    old: ObjectId | None
    new: ObjectId | None
    time: float
    who: str
    what: str

    @property
    def ids(self) -> tuple[ObjectId, ...]:
        return tuple(i for i in (self.old, self.new) if i is not None)

    @property
    def value(self) -> ObjectId | None:
        """What the entry records: the new value, or for a deletion the value deleted (None
        only in a line recording neither). An entry lives as long as this commit does, as in
        git (its old value may be pruned first)."""
        return self.new or self.old

    def line(self) -> bytes:
        return f"{self.old or NONE_ID} {self.new or NONE_ID} {self.time:.6f} {self.who}\t{self.what}\n".encode()


def parse_line(ref: str, line: bytes) -> Entry | None:
    """One entry from its line (without the newline), or None when it is malformed."""
    try:
        head, sep, what = line.decode("utf-8").partition("\t")
    except UnicodeDecodeError:
        return None
    fields = head.split(" ")
    if not sep or len(fields) != 4 or not all(is_object_id(i) for i in fields[:2]) or not fields[3]:
        return None
    try:
        stamp = float(fields[2])
    except ValueError:
        return None
    if not math.isfinite(stamp) or "\n" in what:
        return None
    old, new = (None if i == NONE_ID else ObjectId(i) for i in fields[:2])
    return Entry(ref, old, new, stamp, fields[3], what)


class RefLog:
    """The logs of one repository's refs. ``encode``/``decode`` map a full ref name to the
    backend key its ref file has (and back); the log's key is that key below ``logs/``."""

    def __init__(
        self, backend: Backend, encode: Callable[[str], str] = str, decode: Callable[[str], str | None] = str
    ) -> None:
        self.backend = backend
        self.encode = encode
        self.decode = decode

    def key(self, ref: str) -> str:
        return f"{LOGS}{self.encode(ref)}/{LOG_FILE}"

    def append(self, ref: str, old: ObjectId | None, new: ObjectId | None, what: str) -> None:
        """Record one change of ``ref``; the caller holds the ref's lock."""
        entry = Entry(ref, old, new, now(), who(), _clean(what, MAX_WHAT))
        self.backend.append_line(self.key(ref), entry.line())

    def exists(self, ref: str) -> bool:
        return self.backend.exists(self.key(ref))

    def refs(self) -> list[str]:
        """Every ref that has a log, deleted refs included."""
        out = []
        for key in self.backend.list(LOGS):
            if key.endswith("/" + LOG_FILE):
                ref = self.decode(key[len(LOGS) : -len(LOG_FILE) - 1])
                if ref is not None:
                    out.append(ref)
        return out

    def read(self, ref: str) -> list[Entry]:
        """The entries of ``ref``, oldest first (empty when it has no log)."""
        entries, problems = self._parse(ref)
        if problems:
            raise IntegrityError(problems[0])
        return entries

    def read_all(self) -> dict[str, list[Entry]]:
        return {ref: self.read(ref) for ref in self.refs()}

    def _parse(self, ref: str) -> tuple[list[Entry], list[str]]:
        key = self.key(ref)
        try:
            data = self.backend.get(key)
        except KeyError:
            return [], []
        entries, problems = [], []
        # A last line without its newline was torn by a crash during its append: not an entry.
        for number, line in enumerate(data.split(b"\n")[:-1], start=1):
            entry = parse_line(ref, line)
            if entry is None:
                problems.append(
                    f"reflog {self.backend.describe(key)} line {number} is corrupt;"
                    " fix or delete that line (the reflog only protects commits from gc)"
                )
            else:
                entries.append(entry)
        return entries, problems

    def check(self) -> tuple[list[tuple[str, ObjectId]], list[str]]:
        """fsck: (ref, commit) for every entry's value (an old value may be pruned, as in git),
        and one problem per corrupt line."""
        named: list[tuple[str, ObjectId]] = []
        problems: list[str] = []
        for ref in self.refs():
            entries, bad = self._parse(ref)
            problems.extend(bad)
            named.extend(dict.fromkeys((ref, e.value) for e in entries if e.value is not None))
        return named, problems

    def rewrite(self, ref: str, entries: list[Entry]) -> None:
        """Replace a log by its surviving entries (gc, under the exclusive repository lock)."""
        if entries:
            self.backend.replace(self.key(ref), b"".join(e.line() for e in entries))
        else:
            self.backend.delete(self.key(ref))


# ---- reading a log by name ----------------------------------------------------------------------


def head_view(head: list[Entry], branches: Mapping[str, list[Entry]], branch_now: str) -> list[Entry]:
    """What HEAD pointed at over time, newest first (git's HEAD reflog): the entries of the branch
    HEAD named at each moment, and the switches between branches. ``branches`` is keyed by short
    branch name."""
    merged = sorted([*head, *(e for entries in branches.values() for e in entries)], key=lambda e: e.time)
    ref_of = {id(e): name for name, entries in branches.items() for e in entries}
    out: list[Entry] = []
    branch: str | None = branch_now
    for entry in reversed(merged):
        if id(entry) not in ref_of:
            out.append(entry)
            branch = switched_from(entry.what)
        elif ref_of[id(entry)] == branch:
            out.append(entry)
    return out


def nth_value(entries: list[Entry], n: int, spec: str, name: str) -> ObjectId:
    """``name@{n}``: the value ``name`` had ``n`` changes ago (``entries`` newest first)."""
    if n < len(entries):
        value = entries[n].new
        if value is None:
            raise RefNotFoundError(f"{spec}: {name} was deleted then; 'ckstore reflog {name}' lists its earlier values")
        return value
    if n == len(entries) and entries and entries[-1].old is not None:
        return entries[-1].old  # the value before the oldest recorded change
    raise RefNotFoundError(f"{spec}: the reflog of {name} has only {len(entries)} entries")


# ---- expiry -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Expiry:
    """Entry ages (seconds) beyond which gc drops an entry; ``-inf``: drop at once."""

    reachable: float
    unreachable: float
    at: float

    @classmethod
    def from_days(cls, reachable_days: float, unreachable_days: float, prune_now: bool = False) -> Expiry:
        return cls(reachable_days * DAY, -math.inf if prune_now else unreachable_days * DAY, now())


def surviving(
    entries: Iterable[Entry], from_tip: Callable[[ObjectId], bool], exists: Callable[[ObjectId], bool], expiry: Expiry
) -> list[Entry]:
    """The entries of one ref that survive expiry. ``from_tip``: whether a commit is reachable
    from the ref's current value; an entry whose value (``Entry.value``) is gone is dropped too."""
    out = []
    for entry in entries:
        age = expiry.at - entry.time
        if entry.value is None or not exists(entry.value) or age > expiry.reachable:
            continue
        if age > expiry.unreachable and not all(from_tip(i) for i in entry.ids):
            continue
        out.append(entry)
    return out
