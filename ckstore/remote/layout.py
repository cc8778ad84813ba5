"""The layout of a remote repository on a transport: which keys hold what, and the small
protocol objects (format marker, refs, the pack catalogue, gc's condemned list).

docs/format.md section 15 is the normative description; in short, under the remote's prefix:

    ckstore-remote.json          format marker {"format": "ckstore remote", "version": 1}
    packs/<pack id>.pack         packs (pack.py), immutable, named by the hash of their bytes
    indexes/<pack id>.idx        one index per pack, written after its pack
    refs/heads/<ref>, refs/tags/<ref>   "<commit id>\\n", changed only by compare-and-swap
    gc/condemned.json            packs a remote gc found unreferenced (compare-and-swap)
    gc/lock.json                 held (put-if-absent) while a remote gc runs
    gc/pruned                    commits a remote gc's retention dropped, with their parents

Writers order their puts "packs, then indexes, then refs": an index names only a durable pack,
and a ref only commits whose every object is in an indexed pack. This module reads and writes
keys through a ``Transport`` (``ckstore.transport``: S3 or a folder) and knows nothing of the
local object store or commit graph: push.py, fetch.py and gc.py, beside it, join the two. Every write to the remote is a ``fsio.mutating_step`` (the crash tests kill
a push at each one).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from ckstore.backend.base import Backend
from ckstore.backend.fsio import mutating_step
from ckstore.errors import IntegrityError, PackGoneError, StorageError, UnsupportedFormatError
from ckstore.format.ids import ObjectId, is_object_id
from ckstore.format.pack import (
    ENTRY,
    INDEX_HEADER,
    MAX_PACK_OBJECTS,
    PackEntry,
    PackTable,
    check_read,
    parse_index_table,
)
from ckstore.format.pruned import Pruned, encode_pruned, parse_pruned
from ckstore.repository.refs import REFS
from ckstore.transport.base import MAX_SWAPPED, NotFound, Transport

FORMAT_KEY = "ckstore-remote.json"
FORMAT_NAME = "ckstore remote"
FORMAT_VERSION = 1
PACKS = "packs/"
INDEXES = "indexes/"
CONDEMNED_KEY = "gc/condemned.json"
PRUNED_KEY = "gc/pruned"
GC_LOCK_KEY = "gc/lock.json"
# How long a pack found unreferenced stays before a remote gc may delete it; also how young a
# pack may be and still never be condemned (a push that uploaded it has not published its ref
# yet). A push re-checks the condemned list when its last check is older than half of this.
DEFAULT_GRACE = 3600.0
_INDEX_WORKERS = 8
# What a real value of each key can be, so nothing read from a remote is read past its bound
# (docs/format.md 15.5): a hostile, damaged or sparse value is refused, not loaded whole.
MAX_MARKER = 4096
REF_SIZE = 65  # 64 hex digits and a newline
MAX_INDEX_SIZE = INDEX_HEADER.size + MAX_PACK_OBJECTS * ENTRY.size + 32
MAX_CONDEMNED = 16 << 20  # about 100,000 packs
MAX_PRUNED = MAX_SWAPPED  # about 250,000 pruned commits with their parents
MAX_GC_LOCK = 4096
# A reader whose located pack was deleted (superseded by a push) reads the holdings again and
# retries: once is enough unless pushes supersede the same objects again meanwhile.
READ_ATTEMPTS = 3
T = TypeVar("T")


def pack_key(pack_id: str) -> str:
    return f"{PACKS}{pack_id}.pack"


def index_key(pack_id: str) -> str:
    return f"{INDEXES}{pack_id}.idx"


def pack_name(key: str) -> str | None:
    """The pack id of a ``packs/<id>.pack`` key (None for any other key)."""
    return _named(key, PACKS, ".pack")


def _named(key: str, folder: str, suffix: str) -> str | None:
    name = key[len(folder) : -len(suffix)] if key.startswith(folder) and key.endswith(suffix) else ""
    return name if is_object_id(name) else None


def canonical(doc: object) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode() + b"\n"


@dataclass(frozen=True)
class Located:
    """Where one object lies on the remote."""

    pack_id: str
    entry: PackEntry


@dataclass
class Condemned:
    """gc's list of unreferenced packs: pack id -> (time condemned, whether a sweep claimed it).

    A pack merely condemned may be rescued by a push (removed from the list by compare-and-swap);
    one a sweep has claimed is being deleted and must be treated as gone.
    """

    packs: dict[str, tuple[float, bool]] = field(default_factory=dict)
    token: str | None = None

    def to_bytes(self) -> bytes:
        return canonical(
            {"version": 1, "packs": {p: {"since": s, "claimed": c} for p, (s, c) in sorted(self.packs.items())}}
        )

    @classmethod
    def parse(cls, data: bytes, token: str | None, where: str) -> Condemned:
        try:
            doc = json.loads(data)
            if doc.get("version") != 1:
                raise UnsupportedFormatError(f"{where} has unknown version {doc.get('version')!r}; upgrade ckstore")
            packs = {p: (float(v["since"]), bool(v["claimed"])) for p, v in doc["packs"].items() if is_object_id(p)}
        except (ValueError, KeyError, TypeError, AttributeError):
            raise IntegrityError(f"{where} is corrupt") from None
        return cls(packs, token)

    def claimed(self) -> set[str]:
        return {p for p, (_, c) in self.packs.items() if c}


class RemoteRepo:
    """A remote repository: the layout above over one transport.

    ``cache`` is an optional local folder-like store of index files (keyed by pack id), so a
    client downloads each immutable index once.
    """

    def __init__(
        self,
        transport: Transport,
        encode_ref: Callable[[str], str],
        decode_ref: Callable[[str], str | None],
        name: str = "",
        cache: IndexCache | None = None,
    ) -> None:
        self.transport = transport
        # The ref-name encoding of local repositories (refs.py, a layer above this one).
        self.encode_ref, self.decode_ref = encode_ref, decode_ref
        self.name = name or transport.url
        self.cache = cache
        self._catalogue: dict[str, PackTable] = {}

    def describe(self, key: str = "") -> str:
        return self.transport.describe(key)

    def get(self, key: str, limit: int) -> bytes:
        """A small protocol value, refused (IntegrityError) when longer than ``limit``: at most
        ``limit + 1`` bytes of it are ever read."""
        return self._bounded(key, limit, self.transport.get(key, limit))

    def get_versioned(self, key: str, limit: int) -> tuple[bytes, str]:
        """``get`` with the value's compare-and-swap token."""
        data, token = self.transport.get_versioned(key, limit)
        return self._bounded(key, limit, data), token

    def _bounded(self, key: str, limit: int, data: bytes) -> bytes:
        if len(data) > limit:
            raise IntegrityError(
                f"{self.describe(key)} is corrupt: larger than {limit} bytes, more than a real one can be"
            )
        return data

    # ---- format ----------------------------------------------------------------------------

    def check_format(self, create: bool = False) -> bool:
        """Whether the remote holds a repository (creating the marker when ``create``); refuses
        another format or a newer version. A remote with no marker is empty."""
        marker = canonical({"format": FORMAT_NAME, "version": FORMAT_VERSION})
        if create:
            self.transport.create_location()
        try:
            data = self.get(FORMAT_KEY, MAX_MARKER)
        except NotFound:
            if not create:
                return False
            mutating_step()
            if self.transport.put_if_absent(FORMAT_KEY, marker):
                return True
            data = self.get(FORMAT_KEY, MAX_MARKER)
        try:
            doc = json.loads(data)
            fmt, version = doc["format"], doc["version"]
        except (ValueError, KeyError, TypeError):
            raise UnsupportedFormatError(f"{self.describe(FORMAT_KEY)} is not a ckstore remote marker") from None
        if fmt != FORMAT_NAME:
            raise UnsupportedFormatError(f"{self.describe()} is not a ckstore remote ({fmt!r})")
        if version != FORMAT_VERSION:
            raise UnsupportedFormatError(
                f"{self.describe()} has remote format version {version}; this ckstore reads version {FORMAT_VERSION}"
            )
        return True

    def require_format(self) -> None:
        if not self.check_format():
            raise StorageError(f"remote {self.name}: {self.describe()} holds no ckstore repository (push to it first)")

    # ---- refs ------------------------------------------------------------------------------

    def list_refs(self, problems: dict[str, str] | None = None) -> dict[str, ObjectId]:
        """Full ref name -> commit id for every branch and tag on the remote. A ref file that
        holds no commit id raises, unless ``problems`` is given: then it is recorded there
        (ref or key -> why), as is a key that encodes no valid ref name, and the rest is read."""
        keys = [info.key for info in self.transport.list(REFS)]

        def read(key: str) -> tuple[str, ObjectId | None, str | None]:
            ref = self.decode_ref(key)
            if ref is None:
                return key, None, "its file name is no valid ref name"
            try:
                return ref, self._parse_ref(ref, self.transport.get(key, REF_SIZE)), None
            except NotFound:
                return ref, None, None
            except IntegrityError:  # from _parse_ref
                if problems is None:
                    raise
                return ref, None, "its file does not hold a commit id"

        with ThreadPoolExecutor(_INDEX_WORKERS) as pool:
            triples = list(pool.map(read, keys))
        if problems is not None:
            problems.update({ref: why for ref, _, why in triples if why is not None})
        return {ref: oid for ref, oid, _ in triples if oid is not None}

    def _parse_ref(self, ref: str, data: bytes) -> ObjectId:
        text = data.decode("ascii", "replace").strip()
        if not is_object_id(text) or data != (text + "\n").encode():
            raise IntegrityError(f"remote ref {self.describe(ref)} is corrupt: it does not hold a commit id")
        return ObjectId(text)

    def read_ref(self, ref: str) -> tuple[ObjectId | None, str | None]:
        """(commit id, token for compare-and-swap), (None, None) when the ref is absent."""
        try:
            data, token = self.transport.get_versioned(self.encode_ref(ref), REF_SIZE)
        except NotFound:
            return None, None
        return self._parse_ref(ref, data), token

    def swap_ref(self, ref: str, new: str, token: str | None) -> bool:
        """Point ``ref`` at ``new`` if it still has ``token`` (None: only if absent)."""
        mutating_step()
        return self.transport.put_if_match(self.encode_ref(ref), f"{new}\n".encode(), token)

    def delete_ref(self, ref: str) -> None:
        mutating_step()
        self.transport.delete(self.encode_ref(ref))

    # ---- packs -----------------------------------------------------------------------------

    def pack_ids(self) -> set[str]:
        return {p for info in self.transport.list(PACKS) if (p := pack_name(info.key))}

    def indexed_packs(self) -> dict[str, float]:
        """Pack id -> index upload time (seconds since the epoch) of every index on the remote."""
        out = {}
        for info in self.transport.list(INDEXES):
            p = _named(info.key, INDEXES, ".idx")
            if p:
                out[p] = info.last_modified.timestamp()
        return out

    def catalogue(self, refresh: bool = True) -> dict[str, PackTable]:
        """Every indexed pack's index, fetched once (then from the cache)."""
        if refresh or not self._catalogue:
            listed = set(self.indexed_packs())
            known = {p: i for p, i in self._catalogue.items() if p in listed}
            todo = [p for p in listed if p not in known]
            with ThreadPoolExecutor(_INDEX_WORKERS) as pool:
                for index in pool.map(self.read_index, todo):
                    if index is not None:
                        known[index.pack_id] = index
            self._catalogue = known
        return self._catalogue

    def read_index(self, pack_id: str) -> PackTable | None:
        """One pack's index (None when it vanished meanwhile: a gc deleted it)."""
        if self.cache is not None:
            data = self.cache.get(pack_id)
            if data is not None:
                try:
                    # Validated whole before it was cached (below, or built by upload_pack):
                    # its checksum shows it is still those bytes.
                    return parse_index_table(data, pack_id, validated=True)
                except IntegrityError:
                    pass  # a damaged cache entry is fetched again
        try:
            data = self.transport.get(index_key(pack_id), MAX_INDEX_SIZE)  # parse_index refuses a longer one
        except NotFound:
            return None
        index = parse_index_table(data, pack_id)  # names the pack when damaged
        if self.cache is not None:
            self.cache.put(pack_id, data)
        return index

    def locate(self, exclude: Iterable[str] = (), avoid: Iterable[str] = ()) -> dict[str, Located]:
        """Object id -> the copy to count on, over every indexed pack not in ``exclude`` (the
        catalogue as last read): outside ``avoid`` (condemned packs) when possible, then the
        smallest, then not in a stale pack (one holding a copy that a smaller one elsewhere
        supersedes, remote/repack.py), then by pack id. Push's reliance, fetch, lazy reads and
        remote gc's liveness all choose by this one rule, so a superseded pack is relied on by
        none of them and remote gc may drop it."""
        skip = set(exclude)
        return choose_copies(((p, t) for p, t in self.catalogue(refresh=False).items() if p not in skip), set(avoid))

    def holdings(self, forget: Iterable[str] = (), condemned: Condemned | None = None) -> Holdings:
        """What the remote holds (the one definition): object id -> the copy to count on
        (``locate``'s rule), for every object an index lists, in packs that no remote gc has
        claimed for deletion, nor in ``forget`` (packs found claimed meanwhile). Packs merely
        condemned still count, last: a push rescues them. ``condemned``: the record as the
        caller just read it. Looked up per object (``Holdings``): a push or fetch of one commit
        asks about its few objects, not about the remote's millions."""
        self.catalogue()
        condemned = self.read_condemned() if condemned is None else condemned
        exclude, avoid = condemned.claimed() | set(forget), set(condemned.packs)
        return Holdings({p: t for p, t in self.catalogue(refresh=False).items() if p not in exclude}, avoid)

    def read_objects(self, pack_id: str, entries: list[PackEntry]) -> Iterator[tuple[PackEntry, bytes | memoryview]]:
        """The stored bytes of ``entries`` of one pack, by ranged reads (nearby ones merged);
        ``PackGoneError`` when the pack was deleted since it was located."""
        ordered = sorted(entries, key=lambda e: e.offset)
        datas = self.read_ranges(pack_id, [(e.offset, e.length) for e in ordered])
        for e, data in zip(ordered, datas):
            check_read(data, e, pack_id)
            yield e, data

    def read_ranges(self, pack_id: str, ranges: Sequence[tuple[int, int]]) -> list[bytes | memoryview]:
        """Ranged reads of one pack; ``PackGoneError`` when it is gone (a push deletes a pack it
        superseded at once, docs/format.md 15.9: every object in it is held in another pack, so
        a reader that located something there reads the holdings again and retries)."""
        try:
            return self.transport.get_ranges(pack_key(pack_id), ranges)
        except NotFound:
            raise PackGoneError(
                f"remote {self.name}: {self.describe(pack_key(pack_id))} was deleted while it was being read "
                "(a push superseded it); run the command again"
            ) from None

    def upload_pack(self, pack_id: str, parts: Iterable[bytes | memoryview], index: Callable[[], bytes]) -> None:
        """Pack first (sent part by part as ``parts`` yields them), then its index, made by
        ``index()`` once every part is sent: an index never names a pack that is not there."""
        mutating_step()
        self.transport.put_parts(pack_key(pack_id), parts)
        mutating_step()
        index_data = index()
        self.transport.put(index_key(pack_id), index_data)
        if self.cache is not None:
            self.cache.put(pack_id, index_data)

    # ---- gc --------------------------------------------------------------------------------

    def read_condemned(self) -> Condemned:
        try:
            data, token = self.get_versioned(CONDEMNED_KEY, MAX_CONDEMNED)
        except NotFound:
            return Condemned()
        return Condemned.parse(data, token, self.describe(CONDEMNED_KEY))

    def write_condemned(self, condemned: Condemned) -> bool:
        """Compare-and-swap the condemned list; False when another writer changed it first."""
        mutating_step()
        return self.transport.put_if_match(CONDEMNED_KEY, condemned.to_bytes(), condemned.token)

    def read_pruned(self) -> Pruned:
        """Commits a remote gc pruned, each with its parents (the local ``pruned`` format)."""
        try:
            return parse_pruned(self.get(PRUNED_KEY, MAX_PRUNED), self.describe(PRUNED_KEY))
        except NotFound:
            return {}

    def add_pruned(self, entries: Mapping[ObjectId, Sequence[str]]) -> None:
        """Merge ``entries`` into the pruned record by compare-and-swap (pushes of histories
        pruned locally and remote gcs both add to it; neither may lose the other's lines)."""
        while True:
            try:
                data, token = self.get_versioned(PRUNED_KEY, MAX_PRUNED)
            except NotFound:
                data, token = b"", None
            current = parse_pruned(data, self.describe(PRUNED_KEY))
            if all(o in current for o in entries):
                return
            merged: Pruned = {**{ObjectId(o): tuple(map(ObjectId, p)) for o, p in entries.items()}, **current}
            mutating_step()
            if self.transport.put_if_match(PRUNED_KEY, encode_pruned(merged), token):
                return
            time.sleep(0.01)

    def rescue(self, packs: set[str]) -> set[str]:
        """Take ``packs`` off the condemned list so a push may rely on them; returns those that
        a sweep has already claimed (gone, or about to be: their objects must be re-sent)."""
        while True:
            condemned = self.read_condemned()
            lost = packs & condemned.claimed()
            saved = (packs & set(condemned.packs)) - lost
            if not saved:
                return lost
            for p in saved:
                del condemned.packs[p]
            if self.write_condemned(condemned):
                return lost
            time.sleep(0.01)  # gc changed the list meanwhile: read it again


def retry_when_gone(attempt: Callable[[], T], again: Callable[[], object]) -> T:
    """``attempt()``; when a pack it located is gone (``PackGoneError``: a push deleted it as
    superseded, 15.9), ``again()`` (read the holdings anew) and retry, ``READ_ATTEMPTS`` in all."""
    for n in range(1, READ_ATTEMPTS + 1):
        try:
            return attempt()
        except PackGoneError:
            if n == READ_ATTEMPTS:
                raise
            again()
    raise AssertionError("unreachable")


def all_copies(tables: Iterable[tuple[str, PackTable]], oid: str) -> list[Located]:
    """Every copy of ``oid`` in ``tables`` (pack id, table)."""
    return [Located(pack_id, e) for pack_id, table in tables if (e := table.find(oid)) is not None]


def choose_copies(tables: Iterable[tuple[str, PackTable]], avoided: set[str]) -> dict[str, Located]:
    """``RemoteRepo.locate`` over ``tables`` (pack id, table)."""
    copies: dict[str, list[Located]] = {}
    for pack_id, index in tables:
        for e in index.entries:
            copies.setdefault(e.id, []).append(Located(pack_id, e))
    stale = {
        loc.pack_id
        for locs in copies.values()
        if len(locs) > 1
        for loc in locs
        if loc.entry.length > min(c.entry.length for c in locs)
    }
    return {
        oid: locs[0]
        if len(locs) == 1
        else min(locs, key=lambda c: (c.pack_id in avoided, c.entry.length, c.pack_id in stale, c.pack_id))
        for oid, locs in copies.items()
    }


class Holdings(Mapping[str, Located]):
    """``RemoteRepo.holdings``, answered per object: each lookup binary-searches the packs'
    tables (arrays, ``PackTable``) and remembers the answer, so its cost follows the objects
    asked about. Copies are chosen by ``RemoteRepo.locate``'s rule: outside the avoided
    (condemned) packs, then the smallest; the next key, "not in a stale pack", needs every
    pack's objects, so a tie there (two pushers sent one object at once) builds the whole map
    once (``complete``). Iterating builds it too (nothing iterates on the paths of push and
    fetch)."""

    def __init__(self, tables: Mapping[str, PackTable], avoid: Collection[str]) -> None:
        self._tables = sorted(tables.items())
        self._avoid = set(avoid)
        self._whole: dict[str, Located] | None = None
        self._found: dict[str, Located | None] = {}

    def complete(self) -> dict[str, Located]:
        """Every object and its copy (what ``RemoteRepo.locate`` returns for these tables)."""
        if self._whole is None:
            self._whole = choose_copies(self._tables, self._avoid)
        return self._whole

    def _lookup(self, oid: str) -> Located | None:
        if oid in self._found:
            return self._found[oid]
        copies = all_copies(self._tables, oid)
        if len(copies) > 1:
            rank = {id(c): (c.pack_id in self._avoid, c.entry.length) for c in copies}
            best = min(rank.values())
            tied = [c for c in copies if rank[id(c)] == best]
            copies = tied if len(tied) == 1 else [self.complete()[oid]]
        found = copies[0] if copies else None
        self._found[oid] = found
        return found

    def next_copy(self, oid: str, tried: Collection[str]) -> Located | None:
        """The best copy of ``oid`` outside the packs ``tried``: the one counted on, else outside
        the avoided packs, smallest first; where a reader turns when the chosen copies of a
        delta chain form a cycle (chains.py)."""
        chosen = self._lookup(oid)
        left = [c for c in all_copies(self._tables, oid) if c.pack_id not in tried]
        return min(left, key=lambda c: (c != chosen, c.pack_id in self._avoid, c.entry.length, c.pack_id), default=None)

    def __getitem__(self, oid: str) -> Located:
        found = self._lookup(oid)
        if found is None:
            raise KeyError(oid)
        return found

    def __contains__(self, oid: object) -> bool:
        return isinstance(oid, str) and self._lookup(oid) is not None

    def __iter__(self) -> Iterator[str]:
        return iter(self.complete())

    def __len__(self) -> int:
        return len(self.complete())


class IndexCache:
    """Index files kept locally, by pack id (a small mapping interface over a backend)."""

    def __init__(self, backend: Backend, folder: str) -> None:
        self.backend = backend
        self.folder = folder.rstrip("/") + "/"

    def get(self, pack_id: str) -> bytes | None:
        try:
            return self.backend.get(self.folder + pack_id)
        except KeyError:
            return None

    def put(self, pack_id: str, data: bytes) -> None:
        self.backend.put_if_absent(self.folder + pack_id, data)
