"""The object store: chunks and commit manifests by name, over a storage backend.

Objects live under ``objects/<first two hex digits>/<remaining 62>``. Writes are put-if-absent
(an object that exists is never rewritten: same name, same content). Every read decodes within
the size the caller expects and re-hashes the result against the name, so corrupt data raises
IntegrityError instead of flowing on.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from .backend.base import Backend
from .codec import Kind, decode, encode, parse_header
from .errors import IntegrityError, ObjectMissingError
from .ids import ObjectId, chunk_id, commit_id, is_object_id

MAX_CHUNK_SIZE = 1 << 28
MAX_COMMIT_SIZE = 1 << 30


def object_key(oid: str) -> str:
    return f"objects/{oid[:2]}/{oid[2:]}"


@dataclass(frozen=True)
class PutResult:
    id: ObjectId
    stored: int  # bytes this put added to the store (0 when the object existed)


class ObjectStore:
    def __init__(self, backend: Backend, zstd_level: int = 3) -> None:
        self.backend = backend
        self.zstd_level = zstd_level
        # Base repositories' stores (overlays): reads fall through to them, and an object one of
        # them holds is referenced, never copied. Writes and deletes stay local.
        self.alternates: list[ObjectStore] = []

    def has_local(self, oid: str) -> bool:
        return self.backend.exists(object_key(oid))

    def has(self, oid: str) -> bool:
        return self.has_local(oid) or any(alt.has(oid) for alt in self.alternates)

    def stored_size(self, oid: str) -> int | None:
        return self.backend.size(object_key(oid))

    def _put(self, oid: ObjectId, raw: bytes | memoryview, kind: Kind) -> PutResult:
        key = object_key(oid)
        if self.has(oid):
            return PutResult(oid, 0)
        data = encode(raw, kind, self.zstd_level)
        return PutResult(oid, len(data) if self.backend.put_if_absent(key, data) else 0)

    def put_chunk(self, raw: bytes | memoryview) -> PutResult:
        return self._put(chunk_id(raw), raw, Kind.CHUNK)

    def put_commit(self, manifest: bytes) -> PutResult:
        return self._put(commit_id(manifest), manifest, Kind.COMMIT)

    def _read(self, oid: str, context: str) -> bytes:
        try:
            return self.backend.get(object_key(oid))
        except KeyError:
            for alt in self.alternates:
                try:
                    return alt._read(oid, context)
                except ObjectMissingError:
                    continue
            raise ObjectMissingError(f"object {oid} is missing{context}") from None

    def get_chunk(self, oid: str, size: int, context: str = "") -> bytes:
        """Decoded, verified bytes of a chunk; ``context`` names its file and tensor in errors."""
        data = self._read(oid, context)
        try:
            raw = decode(data, Kind.CHUNK, MAX_CHUNK_SIZE, expected_len=size)
        except IntegrityError as exc:
            raise IntegrityError(f"object {oid}{context} is corrupt: {exc}") from None
        if chunk_id(raw) != oid:
            raise IntegrityError(f"object {oid}{context} is corrupt: its bytes do not hash to its name")
        return raw

    def get_commit(self, oid: str) -> bytes:
        data = self._read(oid, " (a commit)")
        try:
            raw = decode(data, Kind.COMMIT, MAX_COMMIT_SIZE)
        except IntegrityError as exc:
            raise IntegrityError(f"commit {oid} is corrupt: {exc}") from None
        if commit_id(raw) != oid:
            raise IntegrityError(f"commit {oid} is corrupt: its bytes do not hash to its name")
        return raw

    def kind(self, oid: str) -> Kind:
        return parse_header(self._read(oid, "")).kind

    def verify(self, oid: str) -> None:
        """Decode and re-hash any object, whatever its kind (fsck --read-data)."""
        data = self._read(oid, "")
        try:
            header = parse_header(data)
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
