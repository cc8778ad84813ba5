"""The object store: chunks and commit manifests by name, over a storage backend.

Objects live under ``objects/<first two hex digits>/<remaining 62>``. Writes are put-if-absent
(an object that exists is never rewritten by a commit: same name, same content); only repack
replaces an object, atomically, with another encoding of the same bytes. Every read decodes within
the size the caller expects and re-hashes the result against the name, so corrupt data raises
IntegrityError instead of flowing on. Decoding is the one verified reader's (reader.py): a
delta's bases are read through it too, so a cycle or a chain over ``MAX_CHAIN_DEPTH`` links in a
damaged repository is an IntegrityError, not a hang.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from ckstore.backend.base import Backend
from ckstore.codecs.objects import (
    BASES_PREFIX_SIZE,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    OBJECT_VERSION,
    Encoding,
    Kind,
    delta_bases,
    encode,
    encode_chunk,
    encode_sampled,
    parse_header,
)
from ckstore.errors import CkstoreError, IntegrityError, ObjectMissingError
from ckstore.format.ids import ObjectId, chunk_id, commit_id, is_object_id, object_key
from ckstore.format.settings import EncodingSettings
from ckstore.repository.reader import (  # noqa: F401  (the limits are part of the store's face)
    MANIFEST_RATIO,
    MAX_CHAIN_DEPTH,
    MAX_CHUNK_SIZE,
    MAX_COMMIT_SIZE,
    VerifiedReader,
    delta_closure,
    delta_closure_many,
    manifest_size_ok,
    verified_commit,
)
from ckstore.repository.sources import ObjectSource

if TYPE_CHECKING:
    import numpy as np

_PREFIX = BASES_PREFIX_SIZE


def _whole_header_starts() -> frozenset[bytes]:
    """The first 8 bytes (magic, version, kind, encoding, reserved) of every header that
    ``parse_header`` accepts and whose encoding names no delta base, decided by the codec itself:
    a header starting so has no bases, without parsing it (10^6 packed objects at gc)."""
    out = set()
    for kind in Kind:
        for encoding in Encoding:
            header = HEADER.pack(MAGIC, OBJECT_VERSION, kind, encoding, 0, 0)
            try:
                if delta_bases(header) == ():
                    out.add(header[:8])
            except IntegrityError:
                continue  # a predicted delta's header alone is too short: it names bases
    return frozenset(out)


_WHOLE_STARTS = _whole_header_starts()


def bases_in(oid: str, prefix: bytes) -> tuple[ObjectId, ...] | IntegrityError:
    """The delta bases an object's stored ``prefix`` names, or the error ``bases_of`` raises."""
    if len(prefix) >= HEADER_SIZE and prefix[:8] in _WHOLE_STARTS:
        return ()  # what delta_bases returns for it, without parsing (most objects are whole)
    try:
        return tuple(ObjectId(b) for b in delta_bases(prefix))
    except IntegrityError as exc:
        return IntegrityError(f"object {oid} is corrupt: {exc}")


# Object headers read at once by the batch readers (``bases_of_many``).
HEADER_READERS = 4
HEADER_BATCH = 128  # objects per task: a task per object cost more than its read


@dataclass(frozen=True)
class PutResult:
    id: ObjectId
    stored: int  # bytes this put added to the store (0 when the object existed)


class ObjectStore:
    def __init__(self, backend: Backend, settings: EncodingSettings | None = None) -> None:
        self.backend = backend
        self.settings = settings or EncodingSettings()
        # Base repositories' stores (overlays): reads fall through to them, and an object one of
        # them holds is referenced, never copied. Writes and deletes stay local.
        # Read through in order when the backend lacks an object (sources.py: base repositories'
        # stores, a remote's lazy reads).
        self.sources: list[ObjectSource] = []
        self.missing_hint = ""  # appended to "object … is missing" (a base repository that moved)

    def has_local(self, oid: str) -> bool:
        return self.backend.exists(object_key(oid))

    def has(self, oid: str) -> bool:
        return self.has_local(oid) or any(source.has(oid) for source in self.sources)

    def has_durable(self, oid: str) -> bool:
        """Held here or in a base repository, whose gc the writers' locks hold off (writing.py):
        the only objects a write may deduplicate against or delta-encode on. A remote's lazily
        read objects (lazy.py) are not: the remote may delete them, and they are not ours."""
        return self.has_local(oid) or any(source.has_durable(oid) for source in self.sources)

    def stored_size(self, oid: str) -> int | None:
        return self.backend.size(object_key(oid))

    def _put(self, oid: ObjectId, raw: bytes | memoryview, kind: Kind) -> PutResult:
        key = object_key(oid)
        if self.has_durable(oid):
            return PutResult(oid, 0)
        data = encode(raw, kind, self.settings.zstd_level)
        if kind == Kind.COMMIT and not manifest_size_ok(len(data), len(raw)):
            # Compresses better than readers believe a manifest can: stored raw, readable by all.
            data = _raw_object(Kind.COMMIT, raw)
        return PutResult(oid, len(data) if self.backend.put_new(key, data) else 0)

    def put_file_list_piece(self, raw: bytes) -> PutResult:
        """Store a piece of a version-4 file list as a plain chunk that keeps the file list within
        the bound readers apply to it (reader.FileListBound): raw when it compresses better than
        MANIFEST_RATIO:1 (a list of many files sharing the same chunks can). A copy of ours
        stored smaller than that already (by a writer that did not check) is replaced by the raw
        form; a base repository's copy is not ours to rewrite."""
        oid = chunk_id(raw)
        key = object_key(oid)
        if self.has_durable(oid):
            stored = self.stored_size(oid)
            if stored is None or len(raw) <= MANIFEST_RATIO * stored:
                return PutResult(oid, 0)
            data = _raw_object(Kind.CHUNK, raw)
            self.backend.replace(key, data)
            return PutResult(oid, len(data) - stored)
        data = encode(raw, Kind.CHUNK, self.settings.zstd_level)
        if len(raw) > MANIFEST_RATIO * len(data):
            data = _raw_object(Kind.CHUNK, raw)
        return PutResult(oid, len(data) if self.backend.put_new(key, data) else 0)

    def put_chunk(
        self,
        raw: bytes | memoryview,
        width: int = 1,
        base_id: str | None = None,
        fast: bool = False,
        oid: str | None = None,
    ) -> PutResult:
        """Store a chunk of elements ``width`` bytes wide; ``base_id`` is a delta base candidate
        (the same chunk in the parent commit), used when its chain leaves room for one more.

        ``fast`` stores a multi-byte chunk with plain zstd at its fast level (a commit on the
        training loop's critical path); ``is_provisional`` tells compaction to re-encode it.
        """
        oid = ObjectId(oid) if oid else chunk_id(raw)  # ``oid``: the caller hashed ``raw`` already
        key = object_key(oid)
        if self.has_durable(oid):
            return PutResult(oid, 0)
        if fast and width > 1:
            data = encode_sampled(raw, Kind.CHUNK, self.settings.fast_level)
        else:
            data = self.encode_chunk(raw, width, base_id if base_id != oid else None)
        return PutResult(oid, len(data) if self.backend.put_new(key, data) else 0)

    def is_provisional(self, encoding: Encoding, width: int) -> bool:
        """Whether an object of a multi-byte chunk was stored by a fast commit (plain zstd or raw)
        and byte grouping, which the best encoding of such a chunk always tries, is allowed."""
        return width > 1 and encoding in (Encoding.ZSTD, Encoding.RAW) and Encoding.GROUPED in self.settings.allowed

    def encode_chunk(self, raw: bytes | memoryview, width: int, base_id: str | None) -> bytes:
        base = None
        if base_id is not None and self.settings.max_delta_depth > 0 and Encoding.DELTA in self.settings.allowed:
            base = self._delta_base(base_id, len(raw))
        return encode_chunk(
            raw,
            self.settings.zstd_level,
            width,
            base_id if base is not None else None,
            base,
            allowed=self.settings.allowed,
        )

    def _delta_base(self, base_id: str, size: int) -> bytes | None:
        """The base's raw bytes when a delta against it stays within max_delta_depth, else None.

        A base that is missing or damaged only costs compression: the chunk is stored whole;
        so does one that only a remote holds (``has_durable``).
        """
        if not self.has_durable(base_id):
            return None
        try:
            depth = self.chain_depth(base_id)
            if depth + 1 > self.settings.max_delta_depth:
                return None
            return self.get_chunk(base_id, size)
        except CkstoreError:
            return None

    def chain_depth(self, oid: str) -> int:
        """Delta links between an object and whole ones: 0 when whole, else 1 + the deepest of
        its bases (read from headers). A cycle or a chain longer than MAX_CHAIN_DEPTH is an
        IntegrityError (an explicit walk: no recursion limit, no assert)."""
        known: dict[str, int] = {}
        stack: list[tuple[str, tuple[ObjectId, ...]]] = []
        on_path: set[str] = set()
        current: str | None = oid
        while True:
            if current is not None:
                if current in on_path:
                    raise IntegrityError(f"object {current} is corrupt: its delta chain is a cycle")
                if len(stack) > MAX_CHAIN_DEPTH:
                    raise IntegrityError(f"delta chain through object {oid} is longer than {MAX_CHAIN_DEPTH}")
                stack.append((current, self.bases_of(current)))
                on_path.add(current)
                current = None
            top, bases = stack[-1]
            pending = next((b for b in bases if b not in known), None)
            if pending is not None:
                current = pending
                continue
            known[top] = 1 + max(known[b] for b in bases) if bases else 0
            stack.pop()
            on_path.discard(top)
            if not stack:
                return known[oid]

    def bases_of(self, oid: str) -> tuple[ObjectId, ...]:
        """The bases a stored object is a delta of (empty when it is whole); reads only its header."""
        bases = bases_in(oid, self._read_prefix(oid, _PREFIX))
        if isinstance(bases, IntegrityError):
            raise bases
        return bases

    def bases_of_many(self, oids: list[str]) -> Iterator[tuple[str, tuple[ObjectId, ...]]]:
        """``(oid, bases_of(oid))`` for each of ``oids`` in order, empty for a missing one (fsck
        reports those); a header that cannot be read raises, as ``bases_of`` does."""
        for oid, bases in self.bases_or_errors(oids):
            if isinstance(bases, ObjectMissingError):
                yield oid, ()
            elif isinstance(bases, CkstoreError):
                raise bases
            else:
                yield oid, bases

    def bases_or_errors(self, oids: list[str]) -> Iterator[tuple[str, tuple[ObjectId, ...] | CkstoreError]]:
        """``(oid, bases_of(oid) or the error it raises)`` for each of ``oids``, in order.

        Headers the backend reads together (a local repository's packed objects, each pack once)
        come from ``Backend.object_prefixes``; the rest are read ``HEADER_READERS`` at a time: on a
        disk whose cache is cold (a large repository not touched lately) the reads overlap; one
        at a time, each waited for the disk in turn (10^5 objects, cold: 128 s against 4 s; 10^4,
        warm: 3.9 s against 0.8-1.5 s with 4 threads, 1.5-2.9 s with 8; load 16-20)."""
        together = self.backend.object_prefixes(oids, _PREFIX)
        rest = [oid for oid in oids if oid not in together]
        one_by_one = dict(zip(rest, self._read_bases(rest)))
        for oid in oids:
            prefix = together.get(oid)
            yield oid, one_by_one[oid] if prefix is None else bases_in(oid, prefix)

    def _read_bases(self, oids: list[str]) -> list[tuple[ObjectId, ...] | CkstoreError]:
        def read(oid: str) -> tuple[ObjectId, ...] | CkstoreError:
            try:
                return self.bases_of(oid)
            except CkstoreError as exc:
                return exc

        if len(oids) < 2 * HEADER_BATCH:
            return [read(oid) for oid in oids]
        batches = [oids[i : i + HEADER_BATCH] for i in range(0, len(oids), HEADER_BATCH)]
        from concurrent.futures import ThreadPoolExecutor  # only batched header reads: log/status start without

        with ThreadPoolExecutor(HEADER_READERS, thread_name_prefix="headers") as pool:
            return [r for batch in pool.map(lambda batch: [read(oid) for oid in batch], batches) for r in batch]

    def commits_among(self, oids: list[ObjectId]) -> set[ObjectId]:
        """Those of ``oids`` that are commits (an object whose header cannot be read is not one:
        nobody can restore it as a commit). Headers read together where the backend can (gc's
        victims: 10^6 of them one read each cost more than the rest of gc)."""
        together = self.backend.object_prefixes(oids, HEADER_SIZE)
        out: set[ObjectId] = set()
        for oid in oids:
            try:
                prefix = together.get(oid) or self._read_prefix(oid, HEADER_SIZE)
                if parse_header(prefix).kind == Kind.COMMIT:
                    out.add(oid)
            except CkstoreError:
                continue
        return out

    def stored_sizes(self) -> dict[ObjectId, int]:
        """Every object of this repository (not a base's) with its stored size, in one pass."""
        # A backend knows keys, not ids: ``object_sizes`` keeps only names that are object ids.
        return cast(dict[ObjectId, int], self.backend.object_sizes())

    def with_delta_bases(self, chunks: Iterable[str]) -> set[str]:
        """``chunks`` plus every delta base they need, transitively (reads object headers only)."""
        return delta_closure_many(chunks, self.bases_of_many)

    @contextmanager
    def batch(self, expected_bytes: int = 0, expected_objects: int = 0) -> Iterator[ObjectStore]:
        """A view of this store whose writes become durable together when the block ends
        (``Backend.batch``): a commit's chunks go through it, its manifest after it."""
        with self.backend.batch(expected_bytes, expected_objects) as staged:
            view = ObjectStore(staged, settings=self.settings)
            view.sources = self.sources
            yield view

    def put_commit(self, manifest: bytes) -> PutResult:
        return self._put(commit_id(manifest), manifest, Kind.COMMIT)

    def replace_chunk(self, oid: str, data: bytes) -> None:
        """Atomically swap a chunk object for another encoding of the same bytes (repack)."""
        self.backend.replace(object_key(oid), data)

    def read_raw(self, oid: str) -> bytes:
        """The stored (encoded) bytes of an object."""
        return self._read(oid, "")

    def _read(self, oid: str, context: str) -> bytes:
        return self.read_stored(oid, None, context)

    def _read_prefix(self, oid: str, n: int) -> bytes:
        """The first ``n`` stored bytes of an object (its header), here or in a base repository."""
        return self.read_stored(oid, n, "")

    def read_stored(self, oid: str, n: int | None, context: str) -> bytes:
        """The stored bytes (all, or the first ``n``) of an object, here or in a source
        (``sources.ObjectSource``: an object store is the source of its overlays)."""
        key = object_key(oid)
        try:
            return self.backend.get(key) if n is None else self.backend.get_prefix(key, n)
        except KeyError:
            for source in self.sources:
                try:
                    return source.read_stored(oid, n, context)
                except ObjectMissingError:
                    continue
            raise ObjectMissingError(f"object {oid} is missing{context}{self.missing_hint}") from None

    def reader(self) -> VerifiedReader:
        """The verified reader over this store's objects (and its base repositories')."""
        return VerifiedReader(self._read)

    def get_chunk(self, oid: str, size: int, context: str = "") -> bytes:
        """Decoded, verified bytes of a chunk; ``context`` names its file and tensor in errors."""
        raw = self.chunk_view(oid, size, context)
        return raw if isinstance(raw, bytes) else raw.tobytes()

    def chunk_view(self, oid: str, size: int, context: str = "", out: np.ndarray | None = None) -> bytes | memoryview:
        """``get_chunk`` without its last copy: a byte-grouped or delta chunk comes back as a view
        of the array it was decoded into, for readers that write or copy it on anyway (checkout,
        load_state), where copying it into bytes first cost as much as interleaving its planes.
        That array is ``out`` when given (``size`` bytes, uint8, reused by the caller)."""
        return self.reader().chunk(oid, size, context, self._read(oid, context), out)

    def read_local(self, oid: str) -> bytes | None:
        """The stored bytes of an object of this repository (not a base's), None when absent."""
        try:
            return self.backend.get(object_key(oid))
        except KeyError:
            return None

    def forget_cached(self, oid: str) -> None:
        """Advice: this repository's object ``oid`` will not be read again soon (``Backend.forget_cached``)."""
        self.backend.forget_cached(object_key(oid))

    def header_local(self, oid: str) -> bytes | None:
        """The header and delta-bases prefix of an object of this repository, None when absent."""
        try:
            return self.backend.get_prefix(object_key(oid), _PREFIX)
        except KeyError:
            return None

    def stage_replace(self, oid: str, data: bytes, cached: bool = True) -> None:
        """Swap a chunk object for another encoding of the same bytes; in a batch, applied when it
        ends (compaction). ``cached`` False: nothing reads the new bytes soon (``Backend.replace_object``)."""
        self.backend.replace_object(object_key(oid), data, cached=cached)

    def get_commit(self, oid: str) -> bytes:
        data = self._read(oid, " (a commit)")
        try:
            return verified_commit(oid, data)
        except IntegrityError as exc:
            raise IntegrityError(f"commit {oid} is corrupt: {exc}") from None

    def kind(self, oid: str) -> Kind:
        return parse_header(self._read_prefix(oid, HEADER_SIZE)).kind

    def verify(self, oid: str) -> None:
        """Decode and re-hash any object, whatever its kind (fsck --read-data)."""
        try:
            header = parse_header(self._read_prefix(oid, HEADER_SIZE))
        except IntegrityError as exc:
            raise IntegrityError(f"object {oid} is corrupt: {exc}") from None
        if header.kind == Kind.COMMIT:
            self.get_commit(oid)
        else:
            self.get_chunk(oid, header.raw_len)

    def iter_ids(self, prefix: str = "") -> Iterator[ObjectId]:
        """Names of the stored objects (optionally those starting with ``prefix``, 2+ digits)."""
        folder = f"objects/{prefix[:2]}/" if len(prefix) >= 2 else "objects/"
        for key in self.backend.list(folder):
            parts = key.split("/")
            if len(parts) == 3 and len(parts[1]) == 2 and is_object_id(parts[1] + parts[2]):
                oid = parts[1] + parts[2]
                if oid.startswith(prefix):
                    yield ObjectId(oid)

    def delete(self, oid: str) -> bool:
        return self.backend.delete(object_key(oid))


def _raw_object(kind: Kind, raw: bytes | memoryview) -> bytes:
    """An object of ``kind`` stored uncompressed (encoding raw): readable by every reader."""
    return HEADER.pack(MAGIC, OBJECT_VERSION, kind, Encoding.RAW, 0, len(raw)) + bytes(raw)
