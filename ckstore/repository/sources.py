"""What a repository reads through when it lacks something itself: sources of objects and of names.

An object store reads its own backend first; an object it lacks is read from its sources in
order (``ObjectStore.sources``): a base repository's object store (an overlay reads its base's
chunks) or a remote's lazily read packs (``remote/lazy.py``). Likewise the commit graph resolves
a name it does not know through its name sources: a base repository's graph, a remote's refs.
These two protocols are the whole seam: a source is found by its methods, never by overriding
a private method of the store or the graph, so a new kind of source (a read-only mirror, a
cache tier) is a class that implements them.

Reads through a source are never trusted: the store that asked decodes and re-hashes every
object against its name (``reader.VerifiedReader``) before anything uses it.
"""

from __future__ import annotations

from typing import Protocol

from ckstore.format.ids import ObjectId


class ObjectSource(Protocol):
    """A read-only place objects can be read from by id."""

    def has(self, oid: str) -> bool:
        """Whether ``read_stored(oid)`` would find the object (here or in its own sources)."""
        ...

    def has_durable(self, oid: str) -> bool:
        """Whether the object is durably stored where writes may rely on it: a commit may
        deduplicate against it. A cache of a remote answers False (the remote may delete it,
        and it is not the repository's own)."""
        ...

    def read_stored(self, oid: str, n: int | None, context: str) -> bytes:
        """The stored (encoded) bytes of an object: all of them, or the first ``n`` (its header).

        Raises ``ObjectMissingError`` (its message naming ``context``, e.g. " (file f, tensor t)")
        when neither this source nor its own sources hold it, so the caller can try the next
        source. The bytes are unverified: the caller decodes and re-hashes them."""
        ...


class NameSource(Protocol):
    """A place branch and tag names (and commit ids) are resolved when a repository does not
    know them itself."""

    def resolve_name(self, name: str) -> ObjectId:
        """The commit ``name`` names here or in this source's own name sources; raises
        ``RefNotFoundError`` when none knows it."""
        ...


__all__ = ["NameSource", "ObjectSource"]
