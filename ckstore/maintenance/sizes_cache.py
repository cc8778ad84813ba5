"""The last storage figures measured (``stats``), kept in ``cache/sizes.json`` for ``status``.

What ``stats`` reports (stored, unreferenced: what plain gc would free) walks every kept commit
and reads every object's header: 10 CPU seconds at 10^5 objects. ``status`` is asked often and
should answer in the time its other lines take, so it shows the figures of the last measurement
while nothing they depend on changed since (the cache is *current*), measures them itself when
the last measurement was quick, and otherwise shows them as of when they were measured and says
how to measure again (docs/design.md, "Status").

Current means: the refs' values and the backend's ``state_signature`` (object folders, packs,
reflogs, pruned record, links, config: about 260 stats) equal what they were when the figures
were measured. It is written only when nothing had changed within ``SETTLE_SECONDS`` before the
measurement started, so a change in the same clock tick as the last one before it still shows.
gc and repack, which hold the exclusive lock, keep the figures they leave the same way, keyed
to the state once its newest change is older than the timestamps' granularity (``settled_key``),
so ``status`` right after them is exact at once. Reflog entries that expire by age alone are not a change: at most a few commits' objects, and the
figure says when it was measured. A repository with overlay dependents is never cached (what they
need changes without anything here changing). The file is a cache: a reader ignores a damaged
or unknown one, and deleting it costs one measurement.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from ckstore.errors import CkstoreError
from ckstore.repository.context import RepoContext
from ckstore.repository.links import DEPENDENTS_KEY
from ckstore.repository.refs import REFS

KEY = "cache/sizes.json"
VERSION = 1
SETTLE_SECONDS = 1.0
FINE_SETTLE_SECONDS = 0.02


@dataclass(frozen=True)
class Measured:
    figures: dict[str, int | None]  # sizes.Stats' fields
    measured: float  # seconds since the epoch, when the measurement started
    seconds: float  # how long it took (wall)
    key: str  # the state it was measured in


def state_key(ctx: RepoContext, settled_before: float = float("inf")) -> str | None:
    """A digest of everything the figures depend on, or None when it cannot be told cheaply
    (in memory, overlay dependents) or changed at ``settled_before`` or later."""
    signature = _signature(ctx, settled_before)
    return None if signature is None else _key(ctx, signature)


def settled_key(ctx: RepoContext) -> str | None:
    """``state_key`` of the repository as it is now, for figures computed while nobody else
    could change it (gc and repack under the exclusive lock): first waits, up to
    ``SETTLE_SECONDS``, until its newest change is older than the filesystem's timestamp
    granularity, so that a change after the lock is released cannot share that timestamp and
    go unseen. A filesystem whose timestamps have sub-millisecond digits takes them from the
    kernel's clock, which ticks at least every 10 ms: the wait is then ``FINE_SETTLE_SECONDS``
    at most. None when the state cannot be keyed (``state_key``) or did not settle in time."""
    deadline = time.time() + SETTLE_SECONDS + FINE_SETTLE_SECONDS
    while True:
        signature = _signature(ctx, float("inf"))
        if signature is None:
            return None
        stamps = [mtime for _, mtime, _ in signature if mtime > 0]
        settle = FINE_SETTLE_SECONDS if any(m % 1_000_000 for m in stamps) else SETTLE_SECONDS
        wait = max(stamps, default=0) / 1e9 + settle - time.time()
        if wait <= 0:
            return _key(ctx, signature)
        if time.time() + wait > deadline:
            return None
        time.sleep(wait)


def _signature(ctx: RepoContext, settled_before: float) -> list[tuple[str, int, int]] | None:
    try:
        ctx.backend.get(DEPENDENTS_KEY)
        return None
    except KeyError:
        pass
    return ctx.backend.state_signature(settled_before)


def _key(ctx: RepoContext, signature: list[tuple[str, int, int]]) -> str:
    refs = sorted(ctx.refs.list(REFS).items())
    text = json.dumps([refs, signature], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def read(ctx: RepoContext, fields: Collection[str]) -> Measured | None:
    """The last measurement recorded, or None (none, damaged, of another version or without
    exactly ``fields``)."""
    try:
        doc = json.loads(ctx.backend.get(KEY))
        if doc.get("ckstore") != "sizes cache" or doc.get("version") != VERSION:
            return None
        figures = doc["stats"]
        if (
            not isinstance(figures, dict)
            or set(figures) != set(fields)
            or not all(v is None or (type(v) is int and v >= 0) for v in figures.values())
        ):
            return None
        measured, seconds, key = doc["measured"], doc["seconds"], doc["key"]
        if not (isinstance(measured, (int, float)) and isinstance(seconds, (int, float)) and isinstance(key, str)):
            return None
        return Measured(figures, float(measured), float(seconds), key)
    except (KeyError, ValueError, TypeError, AttributeError):
        return None


def record(ctx: RepoContext, key: str | None, started: float, figures: dict[str, int | None]) -> None:
    """Keep ``figures``, measured from ``started`` in the state ``key`` (None: not cached).
    Failing to write is not an error: the next status measures again."""
    if key is None:
        return
    doc: dict[str, Any] = {
        "ckstore": "sizes cache",
        "version": VERSION,
        "key": key,
        "measured": started,
        "seconds": time.time() - started,
        "stats": figures,
    }
    try:
        ctx.backend.replace(KEY, json.dumps(doc, separators=(",", ":")).encode())
    except (OSError, CkstoreError):
        pass
