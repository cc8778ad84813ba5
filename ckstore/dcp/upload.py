"""A rank's part of a save to a remote: its chunks hashed, encoded and uploaded in one pass.

A rank used to stage its file in a private store on local disk (every new chunk hashed, encoded
and written there), and only then push that store: read every object back, decode and re-hash it
to prove the disk had not damaged it, and upload it. The upload, which is most of a save's wall
time, started only once the whole file was staged, and each byte was written, read, decoded
and hashed again on the way (2 ranks, 126 MB each: staging 0.3-0.6 s before the first byte went
out, 0.6-1.4 s of verification beside the uploads).

Here the rank's file goes through the normal ingest path (ingest.py: cut, hashed and encoded on
the pipeline's workers, exactly as a local commit stores it, so the objects are the ones staging
stored) into a store whose backend keeps nothing: each new object goes straight into the pack
being uploaded (``PackUploads``: packs under fresh random names, each followed by its index,
a few in flight, the workers blocked while the uploads are behind, so memory stays a few packs).
Nothing touches a disk between encoding and upload; each object is still decoded and re-hashed
from the bytes that go up (an encoder fault stops the save), the pack index records their
BLAKE3, and every reader decodes and re-hashes what it reads.

The chunks the remote already holds (its indexes, ``RemoteRepo.holdings``) are not sent. Every
pack the rank relies on, those found and those sent, is then rescued from a remote gc's
condemned list; if a sweep has claimed one meanwhile, its objects are sent again from the
rank's state, which is still in memory (no save fails for that).
"""

from __future__ import annotations

import threading

import blake3

from ckstore.backend.memory import MemoryBackend
from ckstore.errors import ObjectMissingError
from ckstore.format.ids import key_object_id
from ckstore.format.manifest import FileEntry
from ckstore.format.pack import DEFAULT_TARGET_SIZE
from ckstore.format.settings import RepoConfig
from ckstore.remote.layout import Holdings, RemoteRepo
from ckstore.remote.uploads import PackUploads
from ckstore.repository.reader import VerifiedReader
from ckstore.repository.store import ObjectStore
from ckstore.write.ingest import MemoryFile, ingest

# Packs in flight per rank (each streams its parts as it fills; the workers wait beyond).
UPLOAD_WORKERS = 4


class _Held:
    """An object source that reports what the remote holds as durable, so that the store
    encodes (and the rank uploads) only what the remote lacks; it reads nothing."""

    def __init__(self, where: Holdings) -> None:
        self.where = where

    def has(self, oid: str) -> bool:
        return oid in self.where

    def has_durable(self, oid: str) -> bool:
        return oid in self.where

    def read_stored(self, oid: str, n: int | None, context: str) -> bytes:
        raise ObjectMissingError(f"object {oid} is missing{context} (it is on the remote, not here)")


class _Streaming(MemoryBackend):
    """A backend that keeps no object: each new one goes into the rank's uploads as it is
    written (``put_new``, on the pipeline's workers), each once per save."""

    def __init__(self, uploads: PackUploads) -> None:
        super().__init__()
        self.uploads = uploads
        self.sent: set[str] = set()
        self._lock = threading.Lock()  # the sent set, and the uploads (not thread-safe)
        self.checker = VerifiedReader(_no_base)

    def exists(self, key: str) -> bool:
        oid = key_object_id(key)
        return (oid is not None and oid in self.sent) or super().exists(key)

    def put_new(self, key: str, data: bytes | memoryview) -> bool:
        oid = key_object_id(key)
        if oid is None:
            return super().put_new(key, data)
        # Decoded and re-hashed from the very bytes that go up (format.md 15.4), as a push
        # checks what it reads from disk: readers trust the index's digest of these bytes, so
        # an encoder fault must stop here, not reach the remote vouched for. Whole objects
        # (a save encodes no deltas), so nothing else is read.
        self.checker.verify(oid, data)
        digest = blake3.blake3(data).digest()  # outside the lock: it releases the GIL
        with self._lock:
            if oid in self.sent:  # two workers stored the same chunk at once
                return False
            self.sent.add(oid)
            self.uploads.add(oid, data, digest)  # blocks while the uploads are behind
        return True


def _no_base(oid: str, context: str) -> bytes:
    raise KeyError(oid)  # a delta's base is never read here: the save stores whole objects


def _send_once(
    remote: RemoteRepo, where: Holdings, source: MemoryFile, chunk_size: int
) -> tuple[FileEntry, int, set[str]]:
    """One pass over the rank's file: what the remote lacks uploaded; the file's entry, the
    bytes sent as stored, and every pack its chunks are in (found or sent)."""
    with PackUploads(remote, DEFAULT_TARGET_SIZE, UPLOAD_WORKERS) as uploads:
        backend = _Streaming(uploads)
        store = ObjectStore(backend, RepoConfig(chunk_size=chunk_size).encoding)
        store.sources.append(_Held(where))
        files, added = ingest(store, [source], chunk_size, fast=True)
    entry = files[0]
    relied = {where[c.id].pack_id for c in entry.all_chunks() if c.id not in backend.sent}
    return entry, added, relied | {index.pack_id for index in uploads.sent}


def save_rank(remote: RemoteRepo, source: MemoryFile, chunk_size: int) -> tuple[FileEntry, int]:
    """Upload one rank's file's chunks that the remote lacks; its manifest entry and the bytes
    it added (as stored). Returns once every object it names is in an indexed pack there that
    no remote gc has claimed, every such pack off the condemned list."""
    forget: set[str] = set()
    added = 0
    while True:
        entry, sent, relied = _send_once(remote, remote.holdings(forget), source, chunk_size)
        added += sent
        lost = remote.rescue(relied)
        if not lost:
            return entry, added
        forget |= lost  # a sweep claimed them: what they held goes up again, in new packs


__all__ = ["UPLOAD_WORKERS", "save_rank"]
