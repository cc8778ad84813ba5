"""Named remotes of a local repository: the ``remotes`` file, and opening one.

``remotes`` (docs/format.md section 15.8) maps a name to a URL and, optionally, an S3 endpoint
URL. Credentials are never stored: they come from the standard AWS environment variables and
config files each time (transport/awsconfig.py). Opening a remote gives a ``RemoteRepo`` whose
index files are cached under ``remote-cache/<name>/`` in the repository, so each immutable
index is downloaded once.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from ckstore.backend.base import Backend
from ckstore.backend.local import LocalBackend
from ckstore.backend.memory import MemoryBackend
from ckstore.errors import IntegrityError, InvalidInputError, NotFoundError, RefExistsError
from ckstore.remote.layout import IndexCache, RemoteRepo
from ckstore.repository.context import RepoContext
from ckstore.repository.refs import HEADS, REMOTES, decode_ref, encode_ref
from ckstore.transport import RemoteOptions, open_transport, parse_url
from ckstore.transport.awsconfig import endpoint_problem

REMOTES_KEY = "remotes"
CACHE_DIR = "remote-cache"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclass(frozen=True)
class RemoteSpec:
    name: str
    url: str
    endpoint_url: str | None = None

    def options(self) -> RemoteOptions:
        return RemoteOptions(endpoint_url=self.endpoint_url)


def check_remote_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name.endswith(".lock") or ".." in name:
        raise InvalidInputError(
            f"invalid remote name {name!r}: use letters, digits, '.', '_' and '-' (starting with a letter or digit)"
        )
    return name


def read_remotes(backend: Backend) -> dict[str, RemoteSpec]:
    try:
        data = backend.get(REMOTES_KEY)
    except KeyError:
        return {}
    try:
        doc = json.loads(data)
        if doc.get("version") != 1:
            raise ValueError
        return {name: RemoteSpec(name, v["url"], v.get("endpoint_url")) for name, v in doc["remotes"].items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        raise IntegrityError(f"{backend.describe(REMOTES_KEY)} is corrupt") from None


def _write(backend: Backend, remotes: dict[str, RemoteSpec]) -> None:
    doc = {
        "version": 1,
        "remotes": {
            s.name: {"url": s.url, **({"endpoint_url": s.endpoint_url} if s.endpoint_url else {})}
            for s in sorted(remotes.values(), key=lambda s: s.name)
        },
    }
    backend.replace(REMOTES_KEY, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())


def add(ctx: RepoContext, name: str, url: str, endpoint_url: str | None = None) -> RemoteSpec:
    check_remote_name(name)
    kind, where, _ = parse_url(url)  # refuses a malformed URL before anything is stored
    if endpoint_url is not None and kind != "s3":
        raise InvalidInputError("--endpoint-url applies to s3:// remotes only")
    problem = endpoint_problem(endpoint_url) if endpoint_url is not None else None
    if problem:
        raise InvalidInputError(problem)
    with ctx.backend.exclusive_lock():
        remotes = read_remotes(ctx.backend)
        if name in remotes:
            raise RefExistsError(f"remote {name!r} already exists ({remotes[name].url})")
        spec = RemoteSpec(name, url if kind == "s3" else where, endpoint_url)
        remotes[name] = spec
        _write(ctx.backend, remotes)
    return spec


def remove(ctx: RepoContext, name: str) -> RemoteSpec:
    """Forget a remote, its remote-tracking refs and its cache (the remote itself is untouched)."""
    with ctx.backend.exclusive_lock():
        remotes = read_remotes(ctx.backend)
        spec = get(ctx, name, remotes)
        del remotes[name]
        _write(ctx.backend, remotes)
    for ref in list(ctx.refs.list(f"{REMOTES}{name}/")):
        ctx.refs.delete(f"{REMOTES}{name}/{ref}", reason=f"remote remove {name}")
    if ctx.path is not None:
        shutil.rmtree(Path(ctx.path) / CACHE_DIR / name, ignore_errors=True)
    return spec


def get(ctx: RepoContext, name: str, remotes: dict[str, RemoteSpec] | None = None) -> RemoteSpec:
    remotes = read_remotes(ctx.backend) if remotes is None else remotes
    if name not in remotes:
        known = ", ".join(sorted(remotes)) or "none; add one with 'ckstore remote add NAME URL'"
        raise NotFoundError(f"no remote named {name!r} (remotes: {known})")
    return remotes[name]


def default_name(ctx: RepoContext) -> str:
    """ "origin" if there is one, else the only remote."""
    remotes = read_remotes(ctx.backend)
    if "origin" in remotes or not remotes:
        return "origin"
    if len(remotes) == 1:
        return next(iter(remotes))
    raise InvalidInputError(f"name a remote: this repository has {len(remotes)} ({', '.join(sorted(remotes))})")


def cache_backend(ctx: RepoContext, name: str) -> Backend:
    """The local folder for what is cached from remote ``name`` (indexes, lazily read objects)."""
    if ctx.path is None:
        return MemoryBackend()
    folder = Path(ctx.path) / CACHE_DIR / name
    folder.mkdir(parents=True, exist_ok=True)
    return LocalBackend(folder)


def open_remote(ctx: RepoContext, name: str | None = None) -> RemoteRepo:
    name = default_name(ctx) if name is None else name
    spec = get(ctx, name)
    return open_spec(spec, cache_backend(ctx, name))


def open_spec(spec: RemoteSpec, cache: Backend | None = None) -> RemoteRepo:
    transport = open_transport(spec.url, spec.options())
    return RemoteRepo(
        transport, encode_ref, decode_ref, spec.name, IndexCache(cache, "indexes") if cache is not None else None
    )


def tracking_ref(name: str, ref: str) -> str | None:
    """refs/remotes/NAME/BRANCH for a remote branch (tags are fetched as tags: None)."""
    return f"{REMOTES}{name}/{ref[len(HEADS) :]}" if ref.startswith(HEADS) else None
