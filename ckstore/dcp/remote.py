"""DCP saves and loads straight to a remote (``s3://bucket/prefix`` or ``file:///folder``): ranks
on machines that share no folder save one checkpoint as one commit there.

The protocol is a push split over the ranks (docs/format.md 16.1 states it normatively):

1. The coordinator, while planning, finds the remote (the longest prefix of the URL that holds
   one, else the whole URL, created there), refuses a server that ignores conditional writes,
   and decides the branch (and the tag, for ``<remote>/<name>``); the plan carries both to
   every rank.
2. Each rank learns what the remote holds (its indexes, ``RemoteRepo.holdings``), cuts, hashes
   and encodes its pieces through the normal ingest path, and uploads the chunks the remote
   lacks as they are encoded, in packs each followed by its index, several at once (upload.py:
   nothing is staged on local disk; the packs it relies on are rescued from a remote gc's
   condemned list). Only then does it report its chunk lists.
3. Once DCP has gathered every rank's report, the coordinator checks that every object the
   reports name is in an indexed pack no gc has claimed (rescuing condemned ones), uploads the
   commit in a pack of its own, and moves the branch by compare-and-swap against the value it
   read when building the commit, re-parenting and retrying when another writer moved it.

A rank that fails or dies leaves packs that no ref names: remote gc condemns them once they are
older than its grace period and deletes them a grace period later (docs/format.md 15.9).

The cache folder (``cache_dir=``, or ``CKSTORE_CACHE_DIR``) keeps the remote's index files and
lazily read objects across saves and loads (its layout and bounds: cache.py); without one they
are kept in memory (indexes) or in a private temporary folder (objects). Nothing in it is ever
trusted: indexes are checksummed, objects decoded and re-hashed against their names on every read.
"""

from __future__ import annotations

import os
import shutil
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ckstore.backend.base import Backend
from ckstore.backend.fsio import private_folder
from ckstore.backend.local import LocalBackend
from ckstore.backend.memory import MemoryBackend
from ckstore.dcp.cache import remote_folder
from ckstore.errors import (
    ConflictError,
    IntegrityError,
    RefChangedError,
    RefNotFoundError,
    StorageError,
)
from ckstore.format.dcp_record import DcpRecord
from ckstore.format.ids import ObjectId, is_object_id
from ckstore.format.manifest import FileEntry, encode_commit_parts
from ckstore.remote.layout import RemoteRepo
from ckstore.remote.lazy import RemoteObjects
from ckstore.remote.names import RemoteSpec, open_spec
from ckstore.remote.push import send_objects
from ckstore.repository.graph import CommitGraph
from ckstore.repository.refs import DEFAULT_BRANCH, HEADS, TAGS, RefStore
from ckstore.repository.store import ObjectStore
from ckstore.transport import parse_url
from ckstore.write import provenance
from ckstore.write.commit import MAX_CAS_ATTEMPTS, CommitRequest

CACHE_ENV = "CKSTORE_CACHE_DIR"
# Keys for the conditional-write probe: nothing in the remote layout reads them.
PROBE_PREFIX = "dcp-probe/"
# Remotes (with their endpoints) whose server was seen to honour conditional writes.
_honouring: set[str] = set()
# Remote URL -> this process's copies of its index files.
_memory_caches: dict[str, Backend] = {}


def is_remote_url(target: object) -> bool:
    """Whether a Writer's or Reader's target is a remote URL rather than a repository path."""
    return isinstance(target, (str, os.PathLike)) and "://" in os.fspath(target)


def cache_folder(cache_dir: str | os.PathLike[str] | None) -> Path | None:
    """The node-local cache folder: the parameter, else ``CKSTORE_CACHE_DIR``, else none."""
    chosen = cache_dir if cache_dir is not None else os.environ.get(CACHE_ENV) or None
    return None if chosen is None else Path(chosen)


@dataclass(frozen=True)
class RemoteTarget:
    """Where a save or load goes: the remote repository's URL and the name after it."""

    url: str
    name: str | None
    endpoint_url: str | None = None
    cache_dir: str | None = None

    def open(self) -> RemoteRepo:
        """The remote, its index files cached in the cache folder, else in this process's memory
        (so a training loop that makes a Writer per step downloads each index once)."""
        cache = self.cache_backend()
        if cache is None:
            cache = _memory_caches.setdefault(self.url, MemoryBackend())
        return open_spec(RemoteSpec("", self.url, self.endpoint_url), cache)

    def cache_path(self) -> Path | None:
        """This remote's folder in the cache folder (cache.py), touched; None without one."""
        folder = cache_folder(self.cache_dir)
        return None if folder is None else remote_folder(folder, self.url)

    def cache_backend(self) -> Backend | None:
        folder = self.cache_path()
        return None if folder is None else LocalBackend(folder)


def find_target(
    url: str, endpoint_url: str | None = None, cache_dir: str | os.PathLike[str] | None = None
) -> RemoteTarget:
    """``url`` as ``<remote>`` or ``<remote>/<name>``: the longest prefix of it that holds a
    ckstore remote is the remote (the rest, which may hold ``/``, the name); when none does,
    the whole URL is the remote (a first save creates it there)."""
    kind, where, prefix = parse_url(url)
    cache = None if cache_dir is None else os.fspath(cache_dir)
    if kind == "s3":
        root, parts = f"s3://{where}", [p for p in prefix.split("/") if p]
        cuts = range(len(parts), -1, -1)
    else:
        root, parts = "", list(Path(where).parts)
        cuts = range(len(parts), 1, -1)  # never the file system root
    for cut in cuts:
        head = "/".join(parts[:cut]) if kind == "s3" else str(Path(*parts[:cut]))
        candidate = f"{root}/{head}" if kind == "s3" and head else (root if kind == "s3" else head)
        remote = RemoteTarget(candidate, None, endpoint_url, cache).open()
        if remote.transport.location_exists() and remote.check_format():
            rest = parts[cut:]
            return RemoteTarget(candidate, "/".join(rest) or None, endpoint_url, cache)
    whole = f"{root}/{'/'.join(parts)}".rstrip("/") if kind == "s3" else where
    return RemoteTarget(whole, None, endpoint_url, cache)


def prepare_remote(remote: RemoteRepo, target: RemoteTarget) -> None:
    """The coordinator's checks before a save: the server honours conditional writes, without
    which two writers could both "win" a compare-and-swap of a branch and one save would vanish
    unseen (asked once per process, remote and endpoint; a refused server is left without a
    remote marker), and the remote exists (created on a first save)."""
    key = f"{target.url} {target.endpoint_url}"
    if key not in _honouring:
        remote.transport.create_location()
        if not remote.transport.honours_conditional_writes(PROBE_PREFIX + uuid.uuid4().hex):
            raise StorageError(
                f"remote {remote.name}: the server ignores conditional writes (If-None-Match / If-Match), so "
                "concurrent saves could overwrite each other's branch unseen; use a server that honours them"
            )
        _honouring.add(key)
    remote.check_format(create=True)


def save_branch(remote: RemoteRepo, request: CommitRequest, name: str | None) -> tuple[str, str | None]:
    """(branch, tag) a save commits on: ``name`` when it is the requested branch or a branch
    on the remote, else the requested branch (default ``main``) and tag ``name``."""
    branch = request.branch or DEFAULT_BRANCH
    if name is not None and (name == request.branch or remote.read_ref(HEADS + name)[0] is not None):
        return name, None
    return branch, name


READ_PREFIX = "ckstore-dcp-read-"


def check_held(remote: RemoteRepo, named: Sequence[str]) -> None:
    """Refuse unless every object in ``named`` is in an indexed pack no remote gc has claimed;
    take the packs they are in off the condemned list (a gc then deletes none of them before
    the ref that names them has moved and a grace period has passed)."""
    where = remote.holdings()
    missing = [oid for oid in dict.fromkeys(named) if oid not in where]
    if missing:
        raise IntegrityError(
            f"remote {remote.name}: {len(missing)} object(s) the ranks reported are not there (first: "
            f"{missing[0]}); nothing was committed"
        )
    if remote.rescue({where[oid].pack_id for oid in named}):
        raise ConflictError(
            f"remote {remote.name}: a remote gc is deleting packs this save relies on; nothing was committed, save again"
        )


def land_save(
    remote: RemoteRepo,
    files: Sequence[FileEntry],
    added: int,
    request: CommitRequest,
    branch: str,
    record: DcpRecord,
) -> ObjectId:
    """The coordinator's part once every rank reported: check the objects, upload the commit,
    move ``branch`` by compare-and-swap (re-parenting onto a commit another writer landed)."""
    check_held(remote, [c.id for f in files for c in f.all_chunks()])
    ref = HEADS + branch
    recorded = {**provenance.collect(), **request.links}
    for _ in range(MAX_CAS_ATTEMPTS):
        parent, token = remote.read_ref(ref)
        parent = parent or request.start
        commit = request.build(parent, branch, files, added, recorded, dcp=record)
        manifest, pieces = encode_commit_parts(commit)
        store = ObjectStore(MemoryBackend())
        for _, piece in pieces:  # a large file list (format.md 5.3): its pieces go up with the commit
            store.put_file_list_piece(piece)
        oid = store.put_commit(manifest).id
        send_objects(store, remote, [str(p.id) for p, _ in pieces] + [oid])
        if remote.swap_ref(ref, oid, token) or remote.read_ref(ref)[0] == oid:
            return oid
    raise RefChangedError(f"remote {remote.name}: branch {branch!r} kept moving; the save was not recorded")


def point_tag(remote: RemoteRepo, tag: str, oid: str) -> None:
    """Point tag ``tag`` at ``oid``, moving it if it exists (saving to the same name again
    replaces what was there, as for a folder); compare-and-swap, so a concurrent move is seen."""
    for _ in range(MAX_CAS_ATTEMPTS):
        old, token = remote.read_ref(TAGS + tag)
        if old == oid or remote.swap_ref(TAGS + tag, oid, token):
            return
    raise RefChangedError(f"remote {remote.name}: tag {tag!r} kept moving; it was not set")


class RemoteView:
    """A remote's commits read lazily: a commit graph whose store reads each object it lacks
    from the remote's packs (one ranged read, then decoded and re-hashed against its name) and
    keeps it in the cache folder, or in a private temporary folder deleted with the view."""

    def __init__(self, target: RemoteTarget) -> None:
        self.remote = target.open()
        self.remote.require_format()
        cache = target.cache_backend()
        folder = None if cache is not None else private_folder(None, READ_PREFIX)
        self.objects = RemoteObjects(self.remote, ObjectStore(cache or LocalBackend(Path(str(folder)))))
        store = ObjectStore(MemoryBackend())
        store.sources.append(self.objects)
        refs = MemoryBackend()
        self.graph = CommitGraph(refs, store, RefStore(refs))
        if folder is not None:  # the readers hold the graph, not the view: the folder lives as long
            weakref.finalize(self.graph, shutil.rmtree, folder, True)

    def resolve(self, name: str) -> ObjectId:
        found = resolve_name(self.remote, name)
        if found is None:
            raise RefNotFoundError(f"remote {self.remote.name} has no branch or tag {name!r}")
        return found


def resolve_name(remote: RemoteRepo, name: str) -> ObjectId | None:
    """A branch, tag or commit id on the remote (``HEAD``: branch ``main``); None when the
    remote has no such branch or tag."""
    name = DEFAULT_BRANCH if name == "HEAD" else name
    for ref in (HEADS + name, TAGS + name):
        oid, _ = remote.read_ref(ref)
        if oid is not None:
            return oid
    return ObjectId(name) if is_object_id(name) else None


def latest(url: str, ref: str = "HEAD", endpoint_url: str | None = None) -> str | None:
    """The commit a ``Reader`` of ``url`` (with ``ref``) would load, or None when there is none
    yet (no remote there, or no such branch or tag): where a training script resumes from."""
    target = find_target(url, endpoint_url)
    remote = target.open()
    if not (remote.transport.location_exists() and remote.check_format()):
        return None
    return resolve_name(remote, target.name if target.name is not None else ref)


__all__ = [
    "CACHE_ENV",
    "RemoteTarget",
    "RemoteView",
    "find_target",
    "is_remote_url",
    "land_save",
    "latest",
    "point_tag",
    "prepare_remote",
    "save_branch",
]
