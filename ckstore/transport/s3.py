"""A remote on S3-compatible object storage, through obstore (the Rust object_store crate).

Everything a hand-written client gets wrong is the library's: request signing, retries with
exponential backoff and jitter on throttling, 5xx answers and dropped connections (bounded by
``max_retries`` and ``retry_timeout``), multipart uploads for large puts, connection reuse.
Conditional writes are S3's own: ``If-None-Match: *`` for put_if_absent and ``If-Match: <ETag>``
for put_if_match (AWS S3 since 2024, SeaweedFS, MinIO, Ceph RGW, R2). A server that ignores
these headers would make every conditional put "win"; ``Transport.honours_conditional_writes``
detects one, so the remote protocol can refuse it or fall back to a lock protocol.

One thing here is not the library's: ``get_ranges`` merges nearby ranges itself and asks obstore
for the merged ranges without its own merging, because obstore 0.12's merging panics (a Rust
panic surfacing as pyo3's PanicException, with a backtrace on stderr) when a merged read comes
back shorter than a range inside it starts, which a truncated object makes happen; a short read
must be an answer the caller can judge, not a crash. obstore still fetches the merged ranges in
parallel.

Errors: obstore's exceptions carry the HTTP status and the S3 error document in their text; they
become one-line StorageErrors naming the remote, the cause (missing bucket, denied access,
unreachable endpoint, server failure) and the retries spent.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from obstore.store import ClientConfig, RetryConfig, S3Config

from ckstore.errors import CkstoreError, MissingDependencyError, StorageError
from ckstore.transport import awsconfig
from ckstore.transport.base import (
    NotFound,
    ObjectInfo,
    RemoteOptions,
    Transport,
    check_range,
    check_remote_key,
    check_remote_prefix,
    is_remote_key,
)

_STATUS = re.compile(r"status code: (\d{3})( [A-Za-z ]+)?")
_RETRIES = re.compile(r"after (\d+) retries")
_OS_MESSAGE = re.compile(r'message: "([^"]+)"')
_BULK_CODE = re.compile(r"request failed for key [^:]*: ([^(]*)\(code: (\w+)\)")
_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"}
_CUSTOM_ERROR = re.compile(r'error: "([^"]+)"')


def _xml(text: str, tag: str) -> str | None:
    m = re.search(f"<{tag}>([^<]*)</{tag}>", text)
    return m.group(1).strip() if m else None


def _load_obstore() -> Any:
    try:
        import obstore
    except ImportError:
        raise MissingDependencyError("s3:// remotes need obstore: pip install 'ckstore[remote]'") from None
    return obstore


def _seconds(s: float) -> timedelta:
    return timedelta(seconds=s)


class S3Transport(Transport):
    def __init__(
        self, bucket: str, prefix: str, options: RemoteOptions | None = None, env: dict[str, str] | None = None
    ) -> None:
        self._obs = _load_obstore()
        from obstore.store import S3Store

        self.options = options or RemoteOptions()
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        try:
            settings = awsconfig.resolve(self.options.endpoint_url, self.options.region, self.options.profile, env)
        except StorageError as exc:
            raise StorageError(f"remote {self.url}: {exc}") from None
        self.settings = settings
        self.endpoint = settings.endpoint or f"https://s3.{settings.region or 'us-east-1'}.amazonaws.com"
        o = self.options
        config: S3Config = {}
        if settings.endpoint:
            config["endpoint"] = settings.endpoint
        if settings.region:
            config["region"] = settings.region
        if settings.access_key_id:
            config["access_key_id"] = settings.access_key_id
            config["secret_access_key"] = settings.secret_access_key or ""
            if settings.session_token:
                config["session_token"] = settings.session_token
        client: ClientConfig = {
            "connect_timeout": _seconds(o.connect_timeout),
            "timeout": _seconds(o.request_timeout),
            # Plain HTTP only when the user wrote http:// themselves (a local test server).
            "allow_http": self.endpoint.startswith("http://"),
        }
        retry: RetryConfig = {
            "max_retries": o.max_retries,
            "retry_timeout": _seconds(o.retry_timeout),
            "backoff": {"init_backoff": _seconds(o.backoff_initial), "max_backoff": _seconds(o.backoff_max), "base": 2},
        }
        self._bucket_seen = False
        provider = awsconfig.boto3_provider(settings.boto3_profile) if settings.boto3_profile else None
        try:
            self._store = S3Store(
                bucket,
                prefix=self.prefix or None,
                config=config,
                client_options=client,
                retry_config=retry,
                credential_provider=provider,
            )
        except Exception as exc:  # obstore's configuration errors (bad endpoint URL, unknown key)
            raise StorageError(f"remote {self.url}: invalid S3 settings: {_first_line(exc)}") from None

    # ---- errors --------------------------------------------------------------------------------

    def _error(self, exc: BaseException, doing: str, key: str = "") -> CkstoreError:
        """One line for any obstore failure: what failed, where, why, after how many retries."""
        ex = self._obs.exceptions
        text = str(exc)
        code, message = _xml(text, "Code"), _xml(text, "Message")
        if code is None and (bulk := _BULK_CODE.search(text)):  # DeleteObjects reports per key
            code, message = bulk.group(2), bulk.group(1).strip()
        status = _STATUS.search(text)
        retries = _RETRIES.search(text)
        spent = f" (gave up after {retries.group(1)} retries)" if retries and retries.group(1) != "0" else ""
        where = f"remote {self.url}"
        what = f"{doing} {key}".rstrip()
        detail = f"{code}: {message}" if code and message else code or message or ""
        if code == "NoSuchBucket":
            return StorageError(f"{where}: bucket {self.bucket!r} does not exist at {self.endpoint}")
        if (
            isinstance(exc, (ex.PermissionDeniedError, ex.UnauthenticatedError))
            or code in _DENIED
            or (status and status.group(1) in ("401", "403"))
        ):
            return StorageError(
                f"{where}: access denied while {what} ({detail or _status_text(status) or 'forbidden'}); "
                f"check the credentials (from {self.settings.source}) and the bucket's permissions"
            )
        if status is not None:
            return StorageError(
                f"{where}: the server answered {_status_text(status)} while {what}"
                f"{': ' + detail if detail else ''}{spent}"
            )
        if "error sending request" in text or "TimedOut" in text or "timed out" in text:
            return StorageError(
                f"{where}: cannot reach {self.endpoint} while {what}: {_connection_reason(text)}{spent}"
            )
        return StorageError(f"{where}: {what} failed: {_first_line(exc)}")

    def _not_found(self, exc: BaseException, doing: str, key: str) -> CkstoreError | NotFound:
        """A 404 is a missing key, unless the bucket itself is what is missing."""
        if _xml(str(exc), "Code") == "NoSuchBucket":
            return self._error(exc, doing, key)
        return NotFound(key)

    def _call(self, doing: str, key: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self._store, *args, **kwargs)
        except (FileNotFoundError, self._obs.exceptions.NotFoundError) as exc:
            raise self._not_found(exc, doing, key) from None
        except self._obs.exceptions.BaseError as exc:
            raise self._error(exc, doing, key) from None
        except BaseException as exc:
            # pyo3's PanicException (a BaseException, not importable by name): the Rust client
            # panicked, on input awsconfig.endpoint_problem did not foresee. One line, exit 7.
            if type(exc).__name__ != "PanicException":
                raise
            first = (str(exc).splitlines() or ["panic"])[0]
            raise StorageError(f"remote {self.url}: the S3 client failed while {doing} {key}: {first}") from None

    # ---- reads ---------------------------------------------------------------------------------

    def get(self, key: str, limit: int | None = None) -> bytes:
        return self._get(key, limit)[0]

    def _get(self, key: str, limit: int | None) -> tuple[bytes, Any]:
        """The body of a get, at most ``limit + 1`` bytes of it (an endless one is cut there),
        and the response (its metadata)."""
        result = self._call("reading", key, self._obs.get, check_remote_key(key))
        return self._body(result, key, limit), result

    def _body(self, result: Any, key: str, limit: int | None) -> bytes:
        try:
            if limit is None:
                return bytes(result.bytes())
            parts, got = [], 0
            for part in result.stream(min_chunk_size=min(limit + 1, 8 << 20)):
                parts.append(bytes(part))
                got += len(parts[-1])
                if got > limit:
                    break
            return b"".join(parts)[: limit + 1]
        except (FileNotFoundError, self._obs.exceptions.BaseError) as exc:  # the body failed midway
            raise self._error(exc, "reading", key) from None

    def get_range(self, key: str, start: int, length: int) -> bytes:
        return bytes(self.get_ranges(key, [(start, length)])[0])

    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes | memoryview]:
        check_remote_key(key)
        for start, length in ranges:
            check_range(start, length)
        wanted = [(i, s, n) for i, (s, n) in enumerate(ranges) if n > 0]
        out: list[bytes | memoryview] = [b""] * len(ranges)
        if not wanted:
            return out
        groups: list[list[int]] = []  # merged [start, end) reads
        member: dict[int, int] = {}
        for i, s, n in sorted(wanted, key=lambda r: r[1]):
            if groups and s <= groups[-1][1] + self.options.coalesce:
                groups[-1][1] = max(groups[-1][1], s + n)
            else:
                groups.append([s, s + n])
            member[i] = len(groups) - 1
        try:
            datas = self._fetch(key, groups)
        except _RangeNotSatisfiable:
            # A read starts at or past the end: learn the size and read only what exists.
            info = self.head(key)
            if info is None:
                raise NotFound(key) from None
            live = [g for g in groups if g[0] < info.size]
            fetched = iter(self._fetch(key, live)) if live else iter(())
            datas = [next(fetched) if g[0] < info.size else b"" for g in groups]
        for i, s, n in wanted:
            g = groups[member[i]]
            # A view, not a copy: copying each object out of its merged read was a tenth of a
            # clone's CPU. The view keeps the merged buffer alive until its last object is used.
            out[i] = memoryview(datas[member[i]])[s - g[0] : s - g[0] + n]
        return out

    def _fetch(self, key: str, groups: Sequence[Sequence[int]]) -> list[Any]:
        try:
            return list(
                self._obs.get_ranges(
                    self._store, key, starts=[g[0] for g in groups], ends=[g[1] for g in groups], coalesce=0
                )
            )
        except (FileNotFoundError, self._obs.exceptions.NotFoundError) as exc:
            raise self._not_found(exc, "reading", key) from None
        except self._obs.exceptions.BaseError as exc:
            status = _STATUS.search(str(exc))
            if status and status.group(1) == "416":
                raise _RangeNotSatisfiable() from None
            raise self._error(exc, "reading", key) from None

    def get_versioned(self, key: str, limit: int | None = None) -> tuple[bytes, str]:
        data, result = self._get(key, limit)
        etag = result.meta.get("e_tag")
        if not etag:
            raise StorageError(f"remote {self.url}: the server sent no ETag for {key}, so compare-and-swap cannot work")
        return data, etag

    def head(self, key: str) -> ObjectInfo | None:
        try:
            meta = self._call("reading", key, self._obs.head, check_remote_key(key))
        except NotFound:
            self._confirm_bucket()
            return None
        return ObjectInfo(key, meta["size"], meta["last_modified"])

    def _confirm_bucket(self) -> None:
        """Before the first "absent" answer that carries no S3 error document (a HEAD's 404, a
        failed If-Match), make sure it is the key that is absent and not the bucket."""
        if not self._bucket_seen:
            self.check()
            self._bucket_seen = True

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        folder = check_remote_prefix(prefix)
        stream = self._call("listing", folder, self._obs.list, folder.rstrip("/") or None, chunk_size=1000)
        while True:
            try:
                batch = next(stream)
            except StopIteration:
                return
            except (FileNotFoundError, self._obs.exceptions.BaseError) as exc:
                raise self._error(exc, "listing", folder) from None
            for meta in batch:
                if is_remote_key(meta["path"]):
                    yield ObjectInfo(meta["path"], meta["size"], meta["last_modified"])

    def check(self) -> None:
        for _ in self.list(""):
            break

    # ---- writes --------------------------------------------------------------------------------

    def put(self, key: str, data: bytes | memoryview) -> None:
        part = self.options.multipart_part_size
        self._call(
            "writing",
            key,
            self._obs.put,
            check_remote_key(key),
            data,
            use_multipart=len(data) > part,
            chunk_size=part,
            max_concurrency=self.options.multipart_concurrency,
        )

    def put_parts(self, key: str, parts: Iterable[bytes | memoryview]) -> None:
        # obstore streams an iterable as a multipart upload, part by part as the iterable yields,
        # and completes the upload only after the iterable ends: an exception from it aborts the
        # upload and propagates here unchanged (it is not an obstore error), storing nothing.
        part = self.options.multipart_part_size
        self._call(
            "writing",
            key,
            self._obs.put,
            check_remote_key(key),
            parts,
            chunk_size=part,
            max_concurrency=self.options.multipart_concurrency,
        )

    def _put_conditional(self, key: str, data: bytes | memoryview, mode: Any) -> bool:
        ex = self._obs.exceptions
        try:
            self._store_put(key, data, mode)
        except (ex.AlreadyExistsError, ex.PreconditionError):
            self._confirm_bucket()
            return False
        except (FileNotFoundError, ex.NotFoundError) as exc:
            # If-Match on a key that is gone: the precondition failed (unless the bucket is gone).
            if isinstance(self._not_found(exc, "writing", key), NotFound):
                self._confirm_bucket()
                return False
            raise self._error(exc, "writing", key) from None
        except ex.BaseError as exc:
            raise self._error(exc, "writing", key) from None
        return True

    def _store_put(self, key: str, data: bytes | memoryview, mode: Any) -> None:
        # Conditional puts are single requests (S3 evaluates the precondition on one PUT).
        self._obs.put(self._store, check_remote_key(key), data, mode=mode, use_multipart=False)

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        return self._put_conditional(key, data, "create")

    def put_if_match(self, key: str, data: bytes | memoryview, token: str | None) -> bool:
        return self._put_conditional(key, data, "create" if token is None else {"e_tag": token})

    def delete(self, key: str) -> None:
        try:
            self._call("deleting", key, self._obs.delete, check_remote_key(key))
        except NotFound:
            pass


class _RangeNotSatisfiable(Exception):
    pass


def _status_text(status: re.Match[str] | None) -> str:
    return f"{status.group(1)}{status.group(2) or ''}".strip() if status else ""


def _connection_reason(text: str) -> str:
    """Why no answer came, from the reqwest/hyper error chain in obstore's message."""
    if "dns error" in text:
        detail = _CUSTOM_ERROR.search(text)
        return "cannot resolve the host name" + (f" ({detail.group(1)})" if detail else "")
    if "IncompleteMessage" in text or "connection closed" in text:
        return "the connection closed before an answer came"
    if "TimedOut" in text or "timed out" in text:
        return "timed out"
    os_msg = _OS_MESSAGE.search(text)
    return os_msg.group(1).lower() if os_msg else "connection failed"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]
