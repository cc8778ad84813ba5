"""Object names: hex blake3 digests, and the hashing that produces them.

A chunk's name is blake3 of its raw (uncompressed, unencoded) bytes. A commit's name is blake3 of
its manifest bytes behind a type prefix (``b"ckstore commit <len>\\0"``, as git prefixes its
objects), so no chunk can ever share a name with a commit, whatever bytes a user commits.
"""

from __future__ import annotations

import os
import re
from typing import NewType

import blake3

from ckstore.errors import InvalidInputError

ObjectId = NewType("ObjectId", str)

_ID_RE = re.compile(r"[0-9a-f]{64}")
_PREFIX_RE = re.compile(r"[0-9a-f]{6,64}")

# blake3's own threading pays off only on large inputs: commit and checkout already hash one chunk
# per core, and on a 1 MiB chunk its thread pool was slower than one thread (0.50 vs 0.41 ms).
_MULTITHREAD_MIN = 1 << 26


def _hash_alone_after_fork() -> None:
    """blake3's thread pool, once started, is not in a forked child (a detached compaction:
    compaction/detached.py): hashing there would wait for threads that do not exist."""
    global _MULTITHREAD_MIN
    _MULTITHREAD_MIN = 1 << 62


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_hash_alone_after_fork)


def chunk_id(data: bytes | memoryview) -> ObjectId:
    """Name of a chunk: blake3 of its raw bytes."""
    threads = blake3.blake3.AUTO if len(data) >= _MULTITHREAD_MIN else 1
    return ObjectId(blake3.blake3(data, max_threads=threads).hexdigest())


def commit_id(manifest: bytes) -> ObjectId:
    """Name of a commit: blake3 of the type-prefixed manifest bytes."""
    h = blake3.blake3(b"ckstore commit %d\0" % len(manifest))
    h.update(manifest)
    return ObjectId(h.hexdigest())


def is_object_id(text: str) -> bool:
    return bool(_ID_RE.fullmatch(text))


def is_id_prefix(text: str) -> bool:
    return bool(_PREFIX_RE.fullmatch(text))


def parse_object_id(text: object, what: str = "object id") -> ObjectId:
    if not isinstance(text, str) or not is_object_id(text):
        raise InvalidInputError(f"invalid {what}: {text!r}")
    return ObjectId(text)


OBJECTS_PREFIX = "objects/"


def object_key(oid: str) -> str:
    """Where an object is stored: ``objects/`` + its name split after two digits."""
    return f"{OBJECTS_PREFIX}{oid[:2]}/{oid[2:]}"


def key_object_id(key: str) -> str | None:
    """The object name an ``object_key`` holds, or None for any other key."""
    if len(key) == 73 and key.startswith(OBJECTS_PREFIX) and key[10] == "/":
        return key[8:10] + key[11:]
    return None
