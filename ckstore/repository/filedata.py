"""Reading a committed file's bytes and its safetensors header back from the object store."""

from __future__ import annotations

from typing import Any

from ckstore.errors import IntegrityError, InvalidInputError
from ckstore.format.manifest import Commit, FileEntry, parse_json
from ckstore.format.safetensors import parse_header
from ckstore.repository.store import ObjectStore


def file_context(path: str, tensor: str | None = None) -> str:
    """How errors name where a chunk is used."""
    return f" (file {path!r}, tensor {tensor!r})" if tensor else f" (file {path!r})"


def read_file_bytes(store: ObjectStore, f: FileEntry) -> bytes:
    """The whole file, every chunk verified: for small files (configs, state documents)."""
    context = file_context(f.path)
    return b"".join(store.get_chunk(c.id, c.size, context) for c in f.all_chunks())


def header_metadata(store: ObjectStore, f: FileEntry) -> dict[str, str] | None:
    """The ``__metadata__`` of a committed safetensors file (None when it has none)."""
    context = file_context(f.path)
    header = b"".join(store.get_chunk(c.id, c.size, context) for c in f.header)
    metadata: Any = parse_header(header, f.size).metadata
    return metadata


def state_document(store: ObjectStore, commit: Commit) -> Any:
    """The parsed typed-JSON document of a training-state commit (None for a commit of files)."""
    if commit.state is None:
        return None
    entry = next(f for f in commit.files if f.path == commit.state.values)
    return parse_json(read_file_bytes(store, entry))


def state_values(store: ObjectStore, oid: str, commit: Commit) -> Any:
    """The encoded value of a training-state commit's document (tensors appear as $tensor)."""
    if commit.state is None:
        raise InvalidInputError(f"commit {oid[:12]} holds files, not a training state")
    doc = state_document(store, commit)
    if not isinstance(doc, dict) or "value" not in doc:
        raise IntegrityError(f"commit {oid[:12]}: malformed state document")
    return doc["value"]
