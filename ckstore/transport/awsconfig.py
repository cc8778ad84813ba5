"""Where an S3 remote's endpoint, region and credentials come from.

obstore reads the AWS environment variables itself but not the shared files (``~/.aws/config``,
``~/.aws/credentials``), which is where most users keep their keys and their endpoint for a
non-AWS store. This module reads those files with the precedence the AWS SDKs use:

* credentials: an explicitly chosen profile (``--profile``, RemoteOptions.profile) wins; else
  ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``; else the profile named by ``AWS_PROFILE`` (or
  ``default``) from the credentials file, then the config file. A profile that gets its keys
  from ``credential_process``, SSO or an assumed role is handed to boto3 when it is installed
  (obstore's Boto3CredentialProvider), since re-implementing those flows is out of scope here.
  Web-identity and container credentials (their environment variables) are obstore's own.
* region: the option, ``AWS_REGION``, ``AWS_DEFAULT_REGION``, the profile's ``region``.
* endpoint: the option, ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, the profile's
  ``endpoint_url`` (top level or in its ``s3 =`` sub-section).

When nothing supplies credentials the AWS SDKs fall back to the EC2 instance metadata service;
so does this, unless ``AWS_EC2_METADATA_DISABLED=true``, in which case the missing credentials
are a clear StorageError instead of a request to an address that is not there.
"""

from __future__ import annotations

import configparser
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ckstore.errors import MissingDependencyError, StorageError

# Profile keys that mean "credentials come from a flow, not from the file".
_FLOW_KEYS = ("credential_process", "sso_session", "sso_start_url", "role_arn", "credential_source")


@dataclass(frozen=True)
class S3Settings:
    endpoint: str | None
    region: str | None
    access_key_id: str | None = None
    secret_access_key: str | None = None
    session_token: str | None = None
    # A profile whose credentials only boto3 can produce (credential_process, SSO, roles).
    boto3_profile: str | None = None
    source: str = "environment"  # where the credentials came from, for error messages


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _read_ini(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read(path, encoding="utf-8")
    except (configparser.Error, UnicodeDecodeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise StorageError(f"cannot read AWS settings from {path}: {first}") from None
    except OSError as exc:
        raise StorageError(f"cannot read AWS settings from {path}: {exc.strerror}") from None
    return parser


def _section(parser: configparser.ConfigParser, names: tuple[str, ...]) -> dict[str, str] | None:
    for name in names:
        if parser.has_section(name):
            return {k: v.strip() for k, v in parser.items(name, raw=True)}
    return None


def _nested(value: str) -> dict[str, str]:
    """An indented sub-section (``s3 =`` followed by ``  endpoint_url = …`` lines)."""
    out = {}
    for line in value.splitlines():
        key, sep, val = line.partition("=")
        if sep:
            out[key.strip()] = val.strip()
    return out


def read_profile(name: str, env: Mapping[str, str]) -> dict[str, str] | None:
    """The merged settings of one profile (credentials file over config file), or None."""
    home = Path(env.get("HOME") or Path.home())
    config_path = Path(env.get("AWS_CONFIG_FILE") or home / ".aws" / "config")
    creds_path = Path(env.get("AWS_SHARED_CREDENTIALS_FILE") or home / ".aws" / "credentials")
    merged: dict[str, str] | None = None
    if config_path.is_file():
        names = ("default",) if name == "default" else (f"profile {name}",)
        found = _section(_read_ini(config_path), names + ((name,) if name != "default" else ()))
        if found is not None:
            merged = dict(found)
            merged.update({f"s3.{k}": v for k, v in _nested(found.get("s3", "")).items()})
    if creds_path.is_file():
        found = _section(_read_ini(creds_path), (name,))
        if found is not None:
            merged = {**(merged or {}), **found}
    return merged


CREDENTIALS_HINT = (
    "ckstore never stores credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
    "use a profile in ~/.aws/credentials (AWS_PROFILE)"
)


def redact(url: str) -> str:
    """``url`` with any user name and password before its host replaced by ``***``."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, path = rest.partition("/")
    return f"{scheme}://***@{netloc.rpartition('@')[2]}{slash}{path}" if "@" in netloc else url


def endpoint_problem(url: str) -> str | None:
    """Why ``url`` is no usable S3 endpoint (http or https, a host, a port in range, nothing
    else in front of the path), or None. The message never shows a password written into it."""
    shown = redact(url)
    if not url or url != url.strip() or any(c.isspace() or ord(c) < 32 for c in url):
        return f"invalid S3 endpoint URL {shown!r}: it has spaces or control characters"
    try:
        parts = urlsplit(url)
        port = parts.port  # raises for a port out of range or not a number
    except ValueError as exc:
        return f"invalid S3 endpoint URL {shown!r}: {exc}"
    if parts.scheme.lower() not in ("http", "https"):
        return f"invalid S3 endpoint URL {shown!r}: use http://HOST[:PORT] or https://HOST[:PORT]"
    if "@" in parts.netloc:
        return f"S3 endpoint URL {shown!r} holds credentials; {CREDENTIALS_HINT}"
    if not parts.hostname:
        return f"invalid S3 endpoint URL {shown!r}: it names no host"
    if port == 0:
        return f"invalid S3 endpoint URL {shown!r}: port 0"
    if parts.query or parts.fragment:
        return f"invalid S3 endpoint URL {shown!r}: it has a query or fragment"
    return None


def resolve(
    endpoint_url: str | None = None,
    region: str | None = None,
    profile: str | None = None,
    env: Mapping[str, str] | None = None,
) -> S3Settings:
    """The effective S3 settings for a remote; raises StorageError when no credentials exist
    and instance metadata is disabled, or when an explicitly named profile does not exist."""
    env = os.environ if env is None else env
    name = profile or env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE") or "default"
    named = bool(profile or env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE"))
    prof = read_profile(name, env)
    if prof is None and named:
        raise StorageError(f"AWS profile {name!r} is not in the AWS config or credentials file")
    prof = prof or {}
    region = region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or prof.get("region") or None
    endpoint = (
        endpoint_url
        or env.get("AWS_ENDPOINT_URL_S3")
        or env.get("AWS_ENDPOINT_URL")
        or prof.get("s3.endpoint_url")
        or prof.get("endpoint_url")
        or None
    )
    # The S3 client panics on some malformed endpoints: refuse them in one line first.
    problem = endpoint_problem(endpoint) if endpoint is not None else None
    if problem:
        raise StorageError(problem)

    def from_profile() -> S3Settings | None:
        if prof.get("aws_access_key_id") and prof.get("aws_secret_access_key"):
            return S3Settings(
                endpoint,
                region,
                prof["aws_access_key_id"],
                prof["aws_secret_access_key"],
                prof.get("aws_session_token") or None,
                source=f"profile {name!r}",
            )
        if any(prof.get(k) for k in _FLOW_KEYS):
            return S3Settings(endpoint, region, boto3_profile=name, source=f"profile {name!r}")
        return None

    def from_env() -> S3Settings | None:
        if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
            return S3Settings(
                endpoint,
                region,
                env["AWS_ACCESS_KEY_ID"],
                env["AWS_SECRET_ACCESS_KEY"],
                env.get("AWS_SESSION_TOKEN") or None,
                source="the environment (AWS_ACCESS_KEY_ID)",
            )
        return None

    found = (from_profile() or from_env()) if profile else (from_env() or from_profile())
    if found is not None:
        return found
    if _truthy(env.get("AWS_SKIP_SIGNATURE")):
        return S3Settings(endpoint, region, source="anonymous (AWS_SKIP_SIGNATURE)")
    if (
        env.get("AWS_WEB_IDENTITY_TOKEN_FILE")
        or env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")
        or env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI")
    ):
        return S3Settings(endpoint, region, source="web identity or container credentials")
    if _truthy(env.get("AWS_EC2_METADATA_DISABLED")):
        raise StorageError(
            "no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or a profile in "
            "~/.aws/credentials (instance metadata is disabled by AWS_EC2_METADATA_DISABLED)"
        )
    return S3Settings(endpoint, region, source="instance metadata")


def boto3_provider(profile: str) -> Any:
    """obstore's credential provider over a boto3 session of ``profile`` (credential_process,
    SSO, assumed roles); MissingDependencyError when boto3 is absent."""
    try:
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        raise MissingDependencyError(
            f"AWS profile {profile!r} gets its credentials from a process, SSO or a role, which needs "
            "boto3 (pip install boto3), or export the keys as AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
        ) from None
    try:
        return Boto3CredentialProvider(boto3.Session(profile_name=profile))
    except Exception as exc:  # botocore's many error classes; all mean "no credentials from it"
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise StorageError(f"AWS profile {profile!r} gave no credentials: {first}") from None
