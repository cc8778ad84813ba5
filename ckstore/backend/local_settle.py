"""Settling local packs: large objects spread into loose files, small ones kept packed.

A commit's (or a fetch's, or a DCP save's) pack is an intake (local_packs.py). The objects that
the object-by-object machinery works on are the large ones: chunks that compaction and repack
re-encode in place, whose damage should stay confined to one file. They are spread into loose
objects, as before. Small objects (under ``SMALL_OBJECT`` stored bytes: manifests of small
commits, tiny files, small chunks) stay packed: one file per object cost more than the objects
(a commit of 10^5 small files left 10^5 files; listing a cold folder of them took 51 s, and
10^4 of them held 42 MB on disk for 2.1 MB of objects, docs/benchmarks.md), and nothing
re-encodes them in place often enough to matter (a re-encoded object is written loose and the
loose copy wins, docs/format.md 15.9).

One pass (``settle``) rewrites the packs that need it into at most one new pack: packs that hold
a large object, an object that also lies loose (a replacement, or a copy a crash left), or an
object gc drops; and, once ``MERGE_AT`` packs have accumulated, all of them. Compaction's pass
(``keep_clean``) leaves a pack that no object of is dropped and none of which was replaced (lies
loose too), or, for a pack of 1 GiB or more, at most half of whose bytes were, large objects
included: those are the newest commit's chunks,
which the next compaction replaces (deltas) or settles (whole) loose. Copying them out first
cost a DCP step 2 CPU s of its ~10, and at 10 GB wrote the whole tip again and left it out of
the page cache for the checkout that follows (docs/benchmarks.md, the 10 GB runs). A
compaction replaces none of the tip's own chunks (only a tip chunk that came back as a delta),
so the tip's pack is mostly clean; a pack with replaced copies stays until the next compaction,
which replaces most of the rest and rewrites it, unless it is small: then it is rewritten at
once (cheap, and it keeps no extra bytes: 10-15% of the store at 0.27 GB when left).
Such packs are merged too, once ``MERGE_AT`` of them have piled up (commits whose chunks no
compaction replaces). gc and repack spread every large object: they re-encode objects in place. ``gather`` (gc)
also moves loose small objects into the new pack when there are at least ``GATHER_AT`` of them.
Order, for crash safety: the new pack and the spread loose objects are made durable (a batch's
two barriers) before any old pack or gathered loose file is deleted, so at every instant each
kept object has a durable copy; a crash leaves duplicates, which readers accept and the next
pass removes. The caller holds a lock that keeps other settlers out (compaction's, or gc's
exclusive one); readers that lose a pack under them look again (local.py ``_read``).
"""

from __future__ import annotations

import os
from collections.abc import Collection

from ckstore.backend.fsio import mutating_step
from ckstore.backend.local_batch import LocalBatch, StagingBackend
from ckstore.errors import IntegrityError
from ckstore.format.ids import object_key
from ckstore.format.pack import PackIndex, PackTable, check_read

# Objects shorter than this (stored bytes) rest in packs; longer ones are spread loose.
SMALL_OBJECT = 64 << 10
# Settling merges every pack once there are this many (each settle otherwise adds one).
MERGE_AT = 8
# Compaction leaves a pack of at least RESTING_MIN_BYTES of which at most RESTING_STALE_MAX of
# the bytes were replaced (module docstring); a smaller one is rewritten at once, which costs
# little and keeps no replaced copy.
RESTING_STALE_MAX = 0.5
RESTING_MIN_BYTES = 1 << 30
# gc gathers loose small objects into a pack once there are at least this many.
GATHER_AT = 64


def settle(
    backend: StagingBackend,
    drop: Collection[str] = (),
    gather: bool = False,
    keep_clean: bool = False,
    only_dropping: bool = False,
) -> int:
    """Rewrite the packs that need it (module docstring); return how many were removed.
    ``only_dropping``: rewrite only the packs that hold an object of ``drop`` (gc deletes in
    dependency order, a few objects at a time, and on a full disk: nothing else is copied)."""
    indexes = sorted(backend.packs.indexes(), key=lambda ix: ix.pack_id)
    if not indexes and not gather:
        return 0
    loose = _loose_objects(backend)  # one listing, not a stat per packed object
    if only_dropping:
        return _rewrite(backend, [ix for ix in indexes if any(oid in ix for oid in drop)], [], drop, loose)
    loose_small = [(oid, path) for oid, path in _small(loose) if oid not in drop] if gather else []
    if len(loose_small) < GATHER_AT:
        loose_small = []
    # Clean packs of large objects that compaction leaves as they are (module docstring).
    shadowed = backend.packs.shadowed_bytes(loose) if keep_clean else {}
    resting = (
        {ix.pack_id for ix in indexes if _longest(ix) >= SMALL_OBJECT and _may_rest(ix, drop, shadowed)}
        if keep_clean
        else set()
    )
    if len(resting) >= MERGE_AT:
        resting = set()
    if len(indexes) - len(resting) + bool(loose_small) >= MERGE_AT:
        targets = [ix for ix in indexes if ix.pack_id not in resting]
    else:
        targets = [ix for ix in indexes if ix.pack_id not in resting and _needs_rewrite(ix, drop, loose)]
    return _rewrite(backend, targets, loose_small, drop, loose)


def _rewrite(
    backend: StagingBackend,
    targets: list[PackIndex | PackTable],
    loose_small: list[tuple[str, str]],
    drop: Collection[str],
    loose: dict[str, str],
) -> int:
    """Copy what ``targets`` keep (and ``loose_small``) into at most one new pack, make it
    durable, then remove the gathered loose files and the old packs."""
    if not targets and not loose_small:
        return 0
    staged = LocalBatch(backend, pack_below=SMALL_OBJECT)
    damaged: set[str] = set()
    gathered: list[str] = []
    try:
        for oid, path in loose_small:
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                continue
            staged.put_new(object_key(oid), data)
            gathered.append(path)
        for index in targets:
            if not _copy_pack(backend, staged, index, drop, loose):
                damaged.add(index.pack_id)
    except BaseException:
        staged.discard()
        raise
    staged.flush()  # every kept object durable in its new place before an old copy goes
    for path in gathered:
        mutating_step()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    removed = 0
    for index in targets:
        if index.pack_id in damaged:
            continue  # left for fsck to name; its good objects were copied
        mutating_step()
        backend.packs.path_of(index.pack_id).unlink(missing_ok=True)
        backend.packs.forget(index.pack_id)
        removed += 1
    if removed:
        mutating_step()
        from ckstore.backend.fsio import fsync_path

        fsync_path(backend.packs.folder)
    return removed


def _needs_rewrite(index: PackIndex | PackTable, drop: Collection[str], loose: Collection[str]) -> bool:
    """Whether a pack holds a large object, one gc drops, or one that also lies loose."""
    return _longest(index) >= SMALL_OBJECT or _stale(index, drop, loose)


def _longest(index: PackIndex | PackTable) -> int:
    return index.longest() if isinstance(index, PackTable) else max(e.length for e in index.entries)


def _stale(index: PackIndex | PackTable, drop: Collection[str], loose: Collection[str]) -> bool:
    """Whether a pack holds an object gc drops, or one that also lies loose."""
    return any(oid in index for oid in drop) or any(oid in index for oid in loose)


def _may_rest(index: PackIndex | PackTable, drop: Collection[str], shadowed: dict[str, int]) -> bool:
    """Whether compaction may leave a pack as it is: no object of it is dropped, and none of it
    was replaced (``shadowed``: lies loose too), or it is large and at most ``RESTING_STALE_MAX``
    of its bytes were."""
    if any(oid in index for oid in drop):
        return False
    replaced = shadowed.get(index.pack_id, 0)
    return not replaced or (index.pack_size >= RESTING_MIN_BYTES and replaced <= index.pack_size * RESTING_STALE_MAX)


def _loose_objects(backend: StagingBackend) -> dict[str, str]:
    """Every loose object, by id, with its path (names only: no stat). Paths as strings: a Path
    per entry was nine tenths of the listing's CPU (~6000 loose objects after a DCP benchmark
    step: 0.1 thread-s under the profiler)."""
    found: dict[str, str] = {}
    for folder in sorted((backend.root / "objects").glob("[0-9a-f][0-9a-f]")):
        try:
            with os.scandir(folder) as entries:
                found.update((folder.name + e.name, e.path) for e in entries if not e.name.startswith("."))
        except FileNotFoundError:
            continue
    return found


def _small(loose: dict[str, str]) -> list[tuple[str, str]]:
    """The loose objects shorter than ``SMALL_OBJECT``."""
    found = []
    for oid, path in loose.items():
        try:
            if os.stat(path).st_size < SMALL_OBJECT:
                found.append((oid, path))
        except FileNotFoundError:
            continue
    return found


def _copy_pack(
    backend: StagingBackend,
    staged: LocalBatch,
    index: PackIndex | PackTable,
    drop: Collection[str],
    loose: Collection[str],
) -> bool:
    """Stage every kept object of one pack that has no loose copy (small ones into the batch's
    pack, large ones loose); False when the pack is damaged or gone (it is not deleted then)."""
    path = backend.packs.path_of(index.pack_id)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        for entry in index.in_pack_order():
            if entry.id in drop or entry.id in loose:
                continue  # dropped, or the loose copy wins (a replacement, an earlier spread)
            data = os.pread(fd, entry.length, entry.offset)
            check_read(data, entry, index.pack_id)
            staged.put_new(object_key(entry.id), data)
    except IntegrityError:
        return False
    finally:
        os.close(fd)
    return True
