"""The interface to one object-storage location (a remote): bytes by key, nothing more.

A transport knows nothing about packs, refs or repositories; the remote protocol above it
(push, fetch, gc) is built from these operations alone, so it runs unchanged on S3-compatible
storage and on a plain folder of a shared drive. Keys are relative POSIX paths made of
``[A-Za-z0-9._@+-]`` parts that do not start with a dot (dot names are the implementations'
own: temporary and lock files). Every implementation must satisfy these obligations
(``tests/transport/test_base.py`` is the conformance suite that runs against each one):

* ``get(key)`` returns the whole value; ``NotFound`` (a ``KeyError``) when the key is absent.
  With ``limit``, it reads at most ``limit + 1`` bytes: a longer value comes back cut there,
  for the caller to refuse, so a huge, sparse or endless value is never read whole (the
  caller's bound comes from what a real value of that key can be). ``get_versioned`` likewise.
* ``get_range(key, start, length)`` returns ``length`` bytes from ``start``, fewer only when the
  value ends first (``b""`` when ``start`` is at or past its end): a short read is the caller's
  to judge (a truncated pack). ``NotFound`` when absent. ``get_ranges`` does the same for many
  ranges of one value, in the order given, and may merge nearby ranges into one request
  (``RemoteOptions.coalesce``).
* ``put(key, data)`` stores unconditionally. It is atomic (a reader sees the old value or the
  new one, never part of one) and durable once it returns. Meant for immutable,
  content-addressed values (packs, indexes), where two writers of a key write the same bytes.
* ``put_parts(key, parts)`` stores the concatenation of an iterable of buffers as ``put`` does
  (atomic, durable once it returns), consuming the iterable once and sending as it goes, so the
  caller can still be producing later parts while earlier ones travel. An exception raised by
  the iterable propagates unchanged and stores nothing (the key keeps its old value or stays
  absent).
* ``put_if_absent(key, data)`` stores only when the key is absent and says whether it did; of
  several concurrent callers exactly one gets True.
* ``get_versioned(key)`` returns ``(value, token)``; ``put_if_match(key, data, token)`` stores
  only when the key's current value still has that token (``None``: only when the key is
  absent) and says whether it did: a compare-and-swap. Of concurrent callers holding the same
  token, at most one wins. Tokens are opaque strings (an S3 ETag; a content hash for folders):
  a value rewritten with the same bytes may keep its token (a swap back to an earlier value can
  go unnoticed, which refs do not mind), and callers must not rely on either outcome. A failed
  precondition is the False return, never an error. Caveat: when a request
  that did succeed is retried after its answer was lost (a dropped connection), the retry finds
  the new value and reports False; callers that get False re-read the value and may find their
  own write there.
* ``head(key)`` returns ``ObjectInfo`` or None when absent; ``list(prefix)`` yields
  ``ObjectInfo`` for every key under a folder-like prefix (``""``: all), in no set order, never
  temporary or lock files, and skips names that are not valid keys (written by other tools).
* ``delete(key)`` removes a key; deleting an absent key is not an error. It is unconditional:
  the protocol above must not delete a key that writers may compare-and-swap at the same time.
* ``check()`` makes one cheap request and raises when the location is unusable.
* Every failure of the storage itself (unreachable endpoint, wrong credentials, missing bucket
  or folder, permission denied, no space, retries exhausted) is ``StorageError`` with a one-line
  message naming the remote URL and the cause. Transient faults (throttling, 5xx, dropped
  connections) are retried with backoff first, by the client library where there is one.
* Transports are safe to use from many threads at once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime

from ckstore.backend.base import check_key, check_prefix
from ckstore.errors import InvalidPathError

# The largest value a compare-and-swap ever targets (refs, gc's lists; layout.py bounds each
# below this): a folder remote's put_if_match never reads more of the current value.
MAX_SWAPPED = 64 << 20


class NotFound(KeyError):
    """The key is absent from the remote (a KeyError, like Backend.get's)."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    last_modified: datetime


@dataclass(frozen=True)
class RemoteOptions:
    """How to reach a remote; every field has a default that suits real use.

    S3 settings not given here come from the standard AWS environment variables and shared
    config files (``awsconfig.py``).
    """

    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    connect_timeout: float = 5.0  # seconds to establish a connection
    request_timeout: float = 300.0  # seconds for one whole request, body included
    max_retries: int = 5
    retry_timeout: float = 60.0  # no retry starts this long after the first attempt
    backoff_initial: float = 0.1
    backoff_max: float = 5.0
    multipart_part_size: int = 8 << 20  # a put larger than this is a multipart upload (S3)
    multipart_concurrency: int = 8
    coalesce: int = 64 << 10  # get_ranges merges ranges at most this far apart
    lock_timeout: float = 10.0  # folder remotes: how long put_if_match waits for its lock


def check_remote_key(key: str) -> str:
    """A valid backend key whose parts do not start with a dot (reserved for the transport)."""
    check_key(key)
    if any(part.startswith(".") for part in key.split("/")):
        raise InvalidPathError(f"invalid remote key {key!r}: a part starts with a dot")
    return key


def check_remote_prefix(prefix: str) -> str:
    folder = check_prefix(prefix)
    if folder:
        check_remote_key(folder[:-1])
    return folder


def is_remote_key(key: str) -> bool:
    try:
        check_remote_key(key)
    except InvalidPathError:
        return False
    return True


def check_range(start: int, length: int) -> None:
    if start < 0 or length < 0:
        raise ValueError(f"invalid range: start {start}, length {length}")


class Transport(ABC):
    """One remote location; see the module docstring for the obligations."""

    url: str

    @abstractmethod
    def get(self, key: str, limit: int | None = None) -> bytes: ...

    @abstractmethod
    def get_range(self, key: str, start: int, length: int) -> bytes: ...

    @abstractmethod
    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes | memoryview]:
        """Each ``(start, length)`` range of one value, in the order given (bytes, or read-only
        views into a larger read: not copied)."""

    @abstractmethod
    def put(self, key: str, data: bytes | memoryview) -> None: ...

    @abstractmethod
    def put_parts(self, key: str, parts: Iterable[bytes | memoryview]) -> None:
        """Store the concatenation of ``parts``, sending each as it is produced."""

    @abstractmethod
    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool: ...

    @abstractmethod
    def get_versioned(self, key: str, limit: int | None = None) -> tuple[bytes, str]: ...

    @abstractmethod
    def put_if_match(self, key: str, data: bytes | memoryview, token: str | None) -> bool: ...

    @abstractmethod
    def head(self, key: str) -> ObjectInfo | None: ...

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]: ...

    @abstractmethod
    def delete(self, key: str) -> None: ...

    @abstractmethod
    def check(self) -> None:
        """Raise StorageError unless the location answers and can be listed."""

    def create_location(self) -> None:
        """Make the location exist if the transport can (a folder whose parent exists); S3
        buckets are the user's to create, so the default does nothing."""

    def location_exists(self) -> bool:
        """False when the location itself is missing (a folder remote's folder); a transport
        that cannot tell says True and lets its reads fail."""
        return True

    def honours_conditional_writes(self, key: str) -> bool:
        """Whether put_if_absent and put_if_match really are conditional here.

        Some S3-compatible servers ignore If-None-Match and If-Match and store anyway, which would
        make every writer "win" a compare-and-swap; the remote protocol asks once (when a remote
        is added) and falls back to a lock protocol on such servers. Writes, then deletes, ``key``
        (which must not be in use).
        """
        self.put(key, b"probe 1")
        try:
            if self.put_if_absent(key, b"probe 2"):
                return False
            _, token = self.get_versioned(key)
            if self.put_if_match(key, b"probe 3", token + "x"):  # a token no value can have
                return False
            return self.get(key) == b"probe 1"
        finally:
            self.delete(key)

    def describe(self, key: str = "") -> str:
        """A key's full address, for messages."""
        return f"{self.url.rstrip('/')}/{key}" if key else self.url

    def close(self) -> None:
        """Release connections; the default holds none."""
