"""Transports: object-storage locations (an S3 bucket, a folder), bytes by key.

``open_transport(url)`` turns a remote URL into a Transport (base.py states what every
transport guarantees): ``s3://bucket[/prefix]`` is S3-compatible storage (s3.py), a path or
``file:///path`` a plain folder (directory.py).
"""

from __future__ import annotations

import os
import re
from urllib.parse import unquote, urlsplit

from ckstore.errors import InvalidInputError
from ckstore.transport.awsconfig import CREDENTIALS_HINT, redact
from ckstore.transport.base import NotFound, ObjectInfo, RemoteOptions, Transport, check_remote_key

__all__ = ["NotFound", "ObjectInfo", "RemoteOptions", "Transport", "open_transport", "parse_url"]


# S3's bucket naming rules (3-63 characters; lowercase letters, digits, '.' and '-'; a letter
# or digit at each end; no '..'): anything else is a typing mistake or something else in that place.
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def parse_url(url: str) -> tuple[str, str, str]:
    """``("s3", bucket, prefix)`` or ``("dir", absolute path, "")``; InvalidInputError otherwise.
    A URL holding credentials is refused, and no message shows them."""
    shown = redact(url)
    if not url or "\0" in url:
        raise InvalidInputError(f"invalid remote URL {shown!r}")
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # "http://[x": an unclosed IPv6 address
        raise InvalidInputError(f"invalid remote URL {shown!r}: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme in ("s3", "file") and "@" in parts.netloc:
        raise InvalidInputError(f"remote URL {shown!r} holds credentials; {CREDENTIALS_HINT}")
    if scheme == "s3":
        bucket, prefix = parts.netloc, parts.path.strip("/")
        if not bucket:
            raise InvalidInputError(f"remote URL {shown!r} names no bucket (s3://bucket/prefix)")
        if parts.query or parts.fragment:
            raise InvalidInputError(f"remote URL {shown!r} has a query or fragment")
        if prefix:
            try:
                check_remote_key(prefix)
            except InvalidInputError:
                raise InvalidInputError(f"remote URL {shown!r} has an invalid prefix {prefix!r}") from None
        if not _BUCKET.fullmatch(bucket) or ".." in bucket:
            raise InvalidInputError(
                f"remote URL {shown!r}: {bucket!r} is no valid S3 bucket name (3-63 characters: "
                "lowercase letters, digits, '.' and '-')"
            )
        return "s3", bucket, prefix
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise InvalidInputError(f"remote URL {shown!r} names another host; mount the share and give its path")
        return "dir", os.path.abspath(unquote(parts.path)), ""
    # One letter is a Windows drive, not a scheme.
    if scheme and len(scheme) > 1:
        raise InvalidInputError(
            f"unsupported remote URL {shown!r}: use s3://bucket/prefix, a folder path, or file:///folder"
        )
    return "dir", os.path.abspath(url), ""


def open_transport(url: str, options: RemoteOptions | None = None) -> Transport:
    """The transport for a remote URL; makes no request (``Transport.check`` does one)."""
    kind, where, prefix = parse_url(url)
    if kind == "s3":
        from ckstore.transport.s3 import S3Transport

        return S3Transport(where, prefix, options)
    from ckstore.transport.directory import DirectoryTransport

    return DirectoryTransport(where, url=where, options=options)
