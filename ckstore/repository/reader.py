"""The one verified object reader: stored bytes in, bytes proven to hash to their name out.

Every path that turns an object's stored bytes into its content goes through ``VerifiedReader``:
local reads (store.py), push (each object before it is sent), fetch (each object before it is
staged), lazy remote reads (before an object is cached) and compaction (each re-encoding before it
replaces the old one). Where the stored bytes come from is the caller's business (a ``Source``);
what is checked is decided here, once (docs/format.md, "Verification"):

- the header's declared length is checked against what the caller expects, and against the
  limits, before anything is allocated;
- a delta's bases are read through the same reader, on an explicit path: a base already on the
  path is a cycle, a path longer than ``MAX_CHAIN_DEPTH`` an overlong chain, both IntegrityError
  (explicit checks, not recursion limits or asserts, so they hold under ``python -O``);
- the decoded bytes the read holds at once (the object and the bases it is decoding against)
  are counted against ``budget`` before each allocation;
- the result is re-hashed against the name. A base is re-hashed too when it is kept (the base
  cache) or reported (``on_verified``); one used only to decode the delta above it is not, as
  the top object's name vouches for every byte of its chain: when that check fails, the read is
  repeated re-hashing every base, so the error names the object that is corrupt.

A commit's manifest is bounded by what a real one can be: its chunk references are random
names, which do not compress, so a manifest larger than ``MANIFEST_FREE`` decoding to more than
``MANIFEST_RATIO`` times its stored size is refused from its header (a 90 KB object declaring a
1 GiB manifest is refused without decoding it).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ckstore.codecs.objects import Kind, decode_view, parse_header
from ckstore.errors import IntegrityError, ObjectCorruptError, ObjectMissingError
from ckstore.format.ids import chunk_id, commit_id
from ckstore.format.manifest import ChunkReader, ChunkRef

if TYPE_CHECKING:
    import numpy as np

MAX_CHUNK_SIZE = 1 << 28
MAX_COMMIT_SIZE = 1 << 30
# Hard limit on the delta chain a reader follows (docs/format.md): far above the largest
# configurable max_delta_depth (16), so an interrupted repack (whose chains can briefly reach
# 2 * depth + 1) still reads, while a cycle in a damaged repository stops quickly.
MAX_CHAIN_DEPTH = 64
# Decoded bytes one read may hold at once (an object and the bases it decodes against): a chain
# of max_delta_depth links of the largest chunks fits; a 64-link chain of them does not.
DECODE_BUDGET = 1 << 33
# A manifest up to this size is read whatever its compression; above it, it may decode to at
# most MANIFEST_RATIO times its stored size (a real one, mostly random chunk names, compresses
# about 2:1; one naming a single chunk 200,000 times still fits under the free size). Writers
# store a manifest that compresses better than this raw (store.py).
MANIFEST_FREE = 16 << 20
MANIFEST_RATIO = 16
# Decoded bases are decoded into arrays each thread keeps for the next chain, up to this many
# bytes of them: a fresh array costs a page fault per 4 KiB when written, which was about a third
# of the CPU of checking out a commit three deltas deep.
BASE_BUFFERS_BYTES = 64 << 20

# The stored bytes of an object by name (and what it is, for errors); raises ObjectMissingError
# (or KeyError) when there are none.
Source = Callable[[str, str], "bytes | memoryview"]
# Told of each object of a chain once it is verified, with its stored bytes (lazy reads cache it).
Verified = Callable[[str, "bytes | memoryview"], None]


class _Refused(ObjectCorruptError):
    """A failure deeper in a chain whose message already names the object and the chain."""

    def __init__(self, oid: str, context: str, reason: str) -> None:
        super().__init__(
            f"object {oid}{context} is {'refused' if 'memory' in reason else 'corrupt'}: {reason}", oid, reason
        )


def _public(exc: _Refused) -> ObjectCorruptError:
    return ObjectCorruptError(str(exc), exc.oid, exc.reason)


class _Unproven(Exception):
    """The top object of a read does not hash to its name, and a base below it was not checked."""


@dataclass
class _Read:
    """The state of one top-level read: the chain being followed and the bytes it holds."""

    budget: int
    path: list[str] = field(default_factory=list)  # the object being decoded and its deltas above
    below: list[int] = field(default_factory=list)  # for each on the path: links down to whole ones
    borrowed: list[list[np.ndarray]] = field(default_factory=list)  # for each: its bases' buffers
    held: int = 0
    check_bases: bool = False  # re-hash every base, even those only the delta above uses
    unchecked: bool = False  # a base was used without being re-hashed

    def reserve(self, oid: str, n: int, context: str) -> None:
        if self.held + n > self.budget:
            raise _Refused(
                oid,
                context,
                f"decoding it needs more than {self.budget} bytes of memory (its delta chain is too long or too wide)",
            )
        self.held += n


class _BaseBuffers(threading.local):
    """Arrays a thread decodes delta bases into, returned once the delta above is decoded, so a
    chain reuses the same memory chunk after chunk (at most ``BASE_BUFFERS_BYTES`` kept)."""

    def __init__(self) -> None:
        self.free: list[np.ndarray] = []

    def take(self, n: int) -> np.ndarray:
        import numpy as np

        for i, buf in enumerate(self.free):
            if buf.size == n:
                return self.free.pop(i)
        return np.empty(n, np.uint8)

    def give(self, buf: np.ndarray) -> None:
        self.free.append(buf)
        while sum(b.size for b in self.free) > BASE_BUFFERS_BYTES:
            self.free.pop(0)


_BASE_BUFFERS = _BaseBuffers()


def manifest_size_ok(stored_len: int, raw_len: int) -> bool:
    """Whether a manifest of ``raw_len`` bytes may be stored in ``stored_len`` (writers store a
    manifest that compresses better than this raw)."""
    return raw_len <= MANIFEST_FREE or raw_len <= MANIFEST_RATIO * stored_len


def check_manifest_size(stored_len: int, raw_len: int) -> None:
    """Refuse a manifest that declares more bytes than a real one of its stored size can hold."""
    if raw_len > MAX_COMMIT_SIZE:
        raise IntegrityError(f"object declares {raw_len} bytes, more than the limit {MAX_COMMIT_SIZE}")
    if not manifest_size_ok(stored_len, raw_len):
        raise IntegrityError(
            f"manifest declares {raw_len} bytes from {stored_len} stored ones, "
            f"more than a real manifest can compress ({MANIFEST_RATIO}:1)"
        )


class FileListBound:
    """The manifest bound (``check_manifest_size``) over a version-4 file list, whose text is
    stored apart in chunk "pieces" (docs/format.md 5.3): the pieces' declared lengths so far may
    exceed MANIFEST_FREE only by MANIFEST_RATIO times their stored bytes. Checked from each
    piece's stored bytes before it is decompressed, so a remote of a few KiB can no longer make a
    reader decompress and parse a GiB of file list; writers store pieces to obey it (store.py)."""

    def __init__(self) -> None:
        self.declared = 0
        self.stored = 0

    def admit(self, stored_len: int, raw_len: int) -> None:
        self.declared += raw_len
        self.stored += stored_len
        if not manifest_size_ok(self.stored, self.declared):
            raise IntegrityError(
                f"its file list declares {self.declared} bytes from {self.stored} stored ones, "
                f"more than a real file list can compress ({MANIFEST_RATIO}:1)"
            )


def bounded_file_list_reader(
    stored: Callable[[str], bytes | memoryview], reader: VerifiedReader, context: str
) -> ChunkReader:
    """Reads one commit's file-list pieces: each one's stored bytes (``stored``), admitted by the
    commit's ``FileListBound``, then decoded and verified by ``reader``."""
    bound = FileListBound()

    def read(ref: ChunkRef) -> bytes | memoryview:
        data = stored(ref.id)
        bound.admit(len(data), ref.size)
        return reader.chunk(ref.id, ref.size, context, data)

    return read


def verified_commit(oid: str, data: bytes | memoryview) -> bytes:
    """The manifest bytes of a stored commit object, proven to hash to ``oid``; IntegrityError
    (saying what is wrong, not which object: callers name it) otherwise."""
    check_manifest_size(len(data), parse_header(data).raw_len)
    raw = decode_view(data, Kind.COMMIT, MAX_COMMIT_SIZE)
    raw = raw if isinstance(raw, bytes) else raw.tobytes()
    if commit_id(raw) != oid:
        raise IntegrityError("its bytes do not hash to its name")
    return raw


class VerifiedReader:
    """Decodes and verifies objects whose stored bytes come from ``source``.

    ``base_cache`` bytes of verified decoded bases are kept (least recently used first out), so a
    run of deltas on one base decodes it once; a base larger than the cache is never kept.
    Thread-safe: each read has its own path and budget; only the cache is shared.
    """

    def __init__(
        self, source: Source, budget: int = DECODE_BUDGET, base_cache: int = 0, on_verified: Verified | None = None
    ) -> None:
        self.source = source
        self.on_verified = on_verified
        self.budget = budget
        self.cache_limit = base_cache
        self._cache: OrderedDict[str, tuple[bytes | memoryview, int]] = OrderedDict()  # raw, chain depth
        self._cached = 0
        self._lock = threading.Lock()

    def chunk(
        self,
        oid: str,
        size: int | None,
        context: str = "",
        data: bytes | memoryview | None = None,
        out: np.ndarray | None = None,
    ) -> bytes | memoryview:
        """The verified bytes of chunk ``oid`` (``size`` long when given); ``data`` is its stored
        form when the caller has it already. ``context`` names it in errors. A chunk that is not
        stored whole-and-plain may be decoded into ``out`` (a uint8 array of ``size`` bytes the
        caller reuses), which the result is then a view of."""
        stored = self._stored(oid, context) if data is None else data
        into = None if out is None else (lambda n: out if n == out.size else None)
        return self._read(oid, stored, size, context, into)[0]

    def commit(self, oid: str, data: bytes | memoryview) -> bytes:
        """The verified manifest bytes of commit ``oid`` from its stored bytes ``data``."""
        try:
            return verified_commit(oid, data)
        except IntegrityError as exc:
            raise IntegrityError(f"commit {oid} is corrupt: {exc}") from None

    def verify(self, oid: str, data: bytes | memoryview, context: str = "") -> Kind:
        """Decode and verify any object (a chunk or a commit) from its stored bytes; its kind."""
        try:
            header = parse_header(data)
        except IntegrityError as exc:
            raise IntegrityError(f"object {oid}{context} is corrupt: {exc}") from None
        if header.kind == Kind.COMMIT:
            try:
                verified_commit(oid, data)
            except IntegrityError as exc:  # "commit ID (read from PACK) is corrupt: ..."
                context = context.replace(" (a commit)", "")  # the store's note: "commit" says it
                raise IntegrityError(f"commit {oid}{context} is corrupt: {exc}") from None
        else:
            self.chunk(oid, header.raw_len, context, data)
        return header.kind

    # ---- internals ---------------------------------------------------------------------------

    def _stored(self, oid: str, context: str) -> bytes | memoryview:
        try:
            return self.source(oid, context)
        except KeyError:
            raise ObjectMissingError(f"object {oid} is missing{context}") from None

    def _keeps(self, n: int) -> bool:
        """Whether a base of ``n`` decoded bytes goes into the cache."""
        return 0 < self.cache_limit and n <= self.cache_limit

    def remember(self, oid: str, raw: bytes | memoryview, depth: int) -> bool:
        """Keep the verified bytes of ``oid`` (``depth`` delta links above whole objects) for
        deltas that will decode against it, within the cache's bound; whether they were kept
        (then nothing else may reuse their memory)."""
        if not self._keeps(len(raw)):
            return False
        with self._lock:
            if oid not in self._cache:
                self._cache[oid] = (raw, depth)
                self._cached += len(raw)
            while self._cached > self.cache_limit:
                self._cached -= len(self._cache.popitem(last=False)[1][0])
        return True

    def chunk_depth(
        self, oid: str, size: int | None, context: str, data: bytes | memoryview
    ) -> tuple[bytes | memoryview, int]:
        """``chunk`` and the verified chunk's delta chain depth (0 when whole)."""
        raw, depth, _ = self._read(oid, data, size, context, None)
        return raw, depth

    def _read(
        self,
        oid: str,
        data: bytes | memoryview,
        size: int | None,
        context: str,
        into: Callable[[int], np.ndarray | None] | None,
    ) -> tuple[bytes | memoryview, int, np.ndarray | None]:
        """One top-level read; repeated re-hashing every base when the object does not hash to
        its name and some base was not re-hashed (so the error names the corrupt object)."""
        try:
            try:
                return self._decode_into(oid, data, size, context, _Read(self.budget), into)
            except _Unproven:
                return self._decode_into(oid, data, size, context, _Read(self.budget, check_bases=True), into)
        except _Refused as exc:
            raise _public(exc) from None

    def _decode_into(
        self,
        oid: str,
        data: bytes | memoryview,
        size: int | None,
        context: str,
        read: _Read,
        into: Callable[[int], np.ndarray | None] | None,
    ) -> tuple[bytes | memoryview, int, np.ndarray | None]:
        """Decode and verify ``oid`` and its chain, into the array ``into`` gives for the raw
        length once it is reserved (also returned: a base's buffer goes back to the thread's once
        nothing reads it)."""
        if oid in read.path:
            raise _Refused(oid, context, "its delta chain is a cycle")
        if len(read.path) > MAX_CHAIN_DEPTH:
            raise _Refused(oid, context, f"delta chain longer than {MAX_CHAIN_DEPTH}")
        try:
            header = parse_header(data)
        except IntegrityError as exc:
            raise _Refused(oid, context, str(exc)) from None
        out = None
        if header.kind == Kind.CHUNK and header.raw_len == (size or header.raw_len) <= MAX_CHUNK_SIZE:
            read.reserve(oid, header.raw_len, context)  # else decode_view refuses it, allocating nothing
            out = into(header.raw_len) if into is not None else None
        read.path.append(oid)
        read.below.append(0)
        read.borrowed.append([])
        held_before = read.held
        try:
            raw = decode_view(
                data,
                Kind.CHUNK,
                MAX_CHUNK_SIZE,
                expected_len=size,
                fetch_base=lambda base, length: self._base(base, length, oid, context, read),
                out=out,
            )
        except _Refused:
            raise
        except IntegrityError as exc:
            raise _Refused(oid, context, str(exc)) from None
        finally:
            read.path.pop()
            depth = read.below.pop()
            read.held = held_before  # the bases' bytes are freed once this object is decoded
            for buf in read.borrowed.pop():  # and their memory serves the next chain
                _BASE_BUFFERS.give(buf)
        if read.path and not (read.check_bases or self.on_verified is not None or self._keeps(len(raw))):
            read.unchecked = True  # a base only the delta above uses: that delta's name vouches for it
        elif chunk_id(raw) != oid:
            if read.unchecked and not read.path:
                raise _Unproven()
            raise _Refused(oid, context, "its bytes do not hash to its name")
        elif self.on_verified is not None:
            self.on_verified(oid, data)
        return raw, depth, out

    def _base(self, base: str, length: int, of: str, context: str, read: _Read) -> bytes | memoryview:
        with self._lock:
            cached = self._cache.get(base)
            if cached is not None:
                self._cache.move_to_end(base)
        if cached is not None:
            raw, depth = cached  # decode_view checks its length
            if len(read.path) + depth > MAX_CHAIN_DEPTH:
                raise _Refused(of, context, f"delta chain longer than {MAX_CHAIN_DEPTH}")
        else:
            where = f" (delta base of {of}{context})"
            raw, depth, buf = self._decode_into(
                base, self._stored(base, where), length, where, read, _BASE_BUFFERS.take
            )
            if not self.remember(base, raw, depth) and buf is not None:  # its bytes stay reserved
                read.borrowed[-1].append(buf)
        read.below[-1] = max(read.below[-1], depth + 1)
        return raw


def check_reencoded(oid: str, data: bytes, raw: bytes, bases: dict[str, bytes] | None = None) -> None:
    """Raise IntegrityError unless the new encoding ``data`` of ``oid`` decodes, its bases taken
    only from ``bases`` (verified bytes in memory), to ``raw``: the chunk's bytes, re-hashed
    against ``oid`` when they were read. The one check every re-encoding (compaction, repack)
    passes before it replaces a good object. Comparing with them proves what re-hashing the decoded
    bytes would, at about a third of blake3's CPU (0.09 against 0.34 ms per MiB)."""

    def fetch_base(wanted: str, length: int) -> bytes:
        if bases is None or wanted not in bases or length != len(bases[wanted]):
            raise IntegrityError(f"it names an unexpected base {wanted}")
        return bases[wanted]

    try:
        decoded = decode_view(data, Kind.CHUNK, len(raw), expected_len=len(raw), fetch_base=fetch_base)
    except IntegrityError as exc:
        raise IntegrityError(f"object {oid} (re-encoded) is corrupt: {exc}") from None
    if not _same_bytes(decoded, raw):
        raise IntegrityError(f"object {oid} (re-encoded) does not decode to its bytes")


def _same_bytes(decoded: bytes | memoryview, raw: bytes) -> bool:
    """``decoded == raw`` without copying a decoded view into bytes first (a 1 MiB copy a checked
    chunk); numpy compares the view, as Python compares a memoryview element by element (about
    1 ms a MiB)."""
    if isinstance(decoded, bytes):
        return decoded == raw
    import numpy as np

    return len(decoded) == len(raw) and bool(
        np.array_equal(np.frombuffer(decoded, dtype=np.uint8), np.frombuffer(raw, dtype=np.uint8))
    )


# Each object's delta bases, for a batch of objects (read from their headers, empty when whole).
BasesOfMany = Callable[[list[str]], Iterable[tuple[str, Iterable[str]]]]


def delta_closure(
    objects: Iterable[str], bases_of: Callable[[str], Iterable[str]], follow: Callable[[str], bool] = lambda oid: True
) -> set[str]:
    """``objects`` plus every delta base they need, transitively (the one closure over delta
    bases; ``delta_closure_many`` reads headers a batch at a time). ``bases_of`` reads an
    object's bases from its header; a missing object has none to follow (fsck reports it)."""

    def each(oids: list[str]) -> Iterator[tuple[str, Iterable[str]]]:
        for oid in oids:
            try:
                yield oid, bases_of(oid)
            except ObjectMissingError:
                yield oid, ()

    return delta_closure_many(objects, each, follow)


def delta_closure_many(
    objects: Iterable[str],
    bases_of_many: BasesOfMany,
    follow: Callable[[str], bool] = lambda oid: True,
    edges: dict[str, tuple[str, ...]] | None = None,
) -> set[str]:
    """``delta_closure``, one round of header reads per level of the chains. An object for which
    ``follow`` is False is included but not read (it is not where the headers are read). A
    header that cannot be read (IntegrityError) stops the walk with one error text: without it
    nobody can know what the object needs, so deleting or sending anything on a guess could lose
    data. ``edges``, when given, receives each object read and its bases (for ``in_cycles``)."""
    live = set(objects)
    todo = [o for o in live if follow(o)]
    while todo:
        found: list[str] = []
        try:
            for oid, bases in bases_of_many(todo):
                if edges is not None:
                    bases = edges[oid] = tuple(bases)
                for base in bases:
                    if base not in live:
                        live.add(base)
                        if follow(base):
                            found.append(base)
        except ObjectCorruptError as exc:
            raise ObjectCorruptError(f"{exc}; stopped, as what it needs cannot be known", exc.oid, exc.reason) from None
        except IntegrityError as exc:
            raise IntegrityError(f"{exc}; stopped, as what it needs cannot be known") from None
        todo = found
    return live


def in_cycles(edges: Mapping[str, Sequence[str]]) -> set[str]:
    """The objects of ``edges`` (object -> its delta bases, as stored where they were read) that
    never decode: on a cycle of bases, or with a base that is. An object outside ``edges`` ends a
    chain (it was not followed: whole, missing or elsewhere, which the caller judges). Linear:
    each object resolves once all its bases have, the rest is what cycles leave."""
    waiting = {oid: sum(1 for b in bases if b in edges) for oid, bases in edges.items()}
    needers: dict[str, list[str]] = {}
    for oid, bases in edges.items():
        for b in bases:
            if b in edges:
                needers.setdefault(b, []).append(oid)
    ready = [oid for oid, n in waiting.items() if n == 0]
    while ready:
        for needer in needers.get(ready.pop(), ()):
            waiting[needer] -= 1
            if waiting[needer] == 0:
                ready.append(needer)
    return {oid for oid, n in waiting.items() if n > 0}
