"""Which raw chunks compaction already found no smaller whole encoding for.

A fast commit stores a chunk raw when its first bytes do not compress (``encode_sampled``), and
compaction re-encodes such a provisional chunk in its best whole encoding (compact.py). For a
chunk that does not compress at all, that best encoding is raw again: the object keeps its
bytes and its header, so nothing told the next run that the search was done, and every run
(the next epoch's, a second branch's, a re-saved state's) encoded the chunk in full once more.

A run records here the chunks whose full search came out raw; later runs treat a raw chunk
listed here as settled, as any chunk in an encoding only compaction writes. An object id names
its bytes, so the record stays true whatever happens to the object (replaced by a delta, or
deleted by gc and stored raw again by a fast commit): the search it spares would find raw
again, for the same encoding settings, which the record's first line names (another level or
set of encodings: the record is ignored). A cache (docs/format.md 3, ``cache/settled-raw``): a
missing, stale or unreadable record only costs the search being done again, so it is written
without a barrier, holds the most recent ``KEPT`` ids, and a killed run records nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

from ckstore.backend.base import Backend
from ckstore.errors import CkstoreError
from ckstore.format.ids import is_object_id
from ckstore.format.settings import EncodingSettings

KEY = "cache/settled-raw"
# Ids kept, newest last (65 bytes each: a 4 MiB file at most). A run asks only about its window
# of commits' chunks; a 1 MiB chunk size puts 64 GiB of raw-settled chunks in the record.
KEPT = 1 << 16


def _settings_line(settings: EncodingSettings) -> str:
    allowed = ",".join(str(int(e)) for e in sorted(settings.allowed))
    return f"level {settings.zstd_level} encodings {allowed}"


def _ids(text: str, settings: EncodingSettings) -> list[str]:
    lines = text.splitlines()
    if not lines or lines[0] != _settings_line(settings):
        return []
    return [line for line in lines[1:] if is_object_id(line)]


def settled_raw(backend: Backend, settings: EncodingSettings) -> set[str]:
    """The recorded ids (empty when none, unreadable, or recorded under other settings)."""
    try:
        return set(_ids(backend.get(KEY).decode("ascii"), settings))
    except (KeyError, CkstoreError, OSError, UnicodeDecodeError):
        return set()


def record_settled_raw(backend: Backend, settings: EncodingSettings, found: Iterable[str]) -> None:
    """Add ``found`` (chunks whose best whole encoding came out raw) to the record. The caller
    holds the compaction lock, so no other writer races this read-modify-write."""
    new = list(dict.fromkeys(found))
    if not new:
        return
    try:
        old = _ids(backend.get(KEY).decode("ascii"), settings)
    except (KeyError, CkstoreError, OSError, UnicodeDecodeError):
        old = []
    fresh = set(new)
    ids = ([i for i in old if i not in fresh] + new)[-KEPT:]
    try:
        backend.replace(KEY, ("\n".join([_settings_line(settings), *ids]) + "\n").encode("ascii"))
    except (CkstoreError, OSError):
        pass  # a cache: the next run searches again
