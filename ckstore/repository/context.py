"""An open repository as the operations see it: backend, settings, object store, refs, graph.

Every operation (commit, checkout, gc, fsck, …) takes a ``RepoContext`` rather than the ``Repo``
façade, so the façade can delegate to them without an import cycle. Opening a repository also
opens its base repositories (``alternates``): their object stores become sources this one reads
through and their graphs resolve names this one does not know (sources.py).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from ckstore.backend.base import Backend
from ckstore.backend.local import LocalBackend
from ckstore.backend.local_location import find_repository, locate_repository, prepare_new_repository
from ckstore.backend.memory import MemoryBackend
from ckstore.errors import (
    CkstoreError,
    InvalidInputError,
    RefExistsError,
    RepoNotFoundError,
    RepoReplacedError,
    UnsupportedFormatError,
)
from ckstore.format.settings import CONFIG_KEY, PACKS_VERSION, RepoConfig
from ckstore.repository.graph import CommitGraph
from ckstore.repository.links import ALTERNATES_KEY, MAX_BASE_DEPTH, Link, read_links
from ckstore.repository.refs import DEFAULT_BRANCH, RefStore
from ckstore.repository.store import ObjectStore

DEFAULT_DIR = ".ckstore"
# How long a change of the settings waits for another one (each holds the lock for one small
# read and one replace).
CONFIG_LOCK_TIMEOUT = 60.0
REPO_ENV = "CKSTORE_REPO"


@dataclass(frozen=True)
class BrokenBase:
    """A base repository named in ``alternates`` that could not be opened."""

    link: Link
    holder: str  # the repository whose ``alternates`` names it: where ``relink`` must run
    reason: str

    def __str__(self) -> str:
        return (
            f"{self.link.entry} ({self.link.location}) cannot be opened: {self.reason}; if it moved, "
            f"run 'ckstore --repo {shlex.quote(self.holder)} relink NEW_LOCATION'"
        )


@dataclass
class RepoContext:
    path: Path | None  # None: not on a local file system (in memory)
    backend: Backend
    config: RepoConfig
    store: ObjectStore
    refs: RefStore
    graph: CommitGraph
    bases: list[RepoContext] = field(default_factory=list)
    broken_alternates: list[BrokenBase] = field(default_factory=list)  # bases that could not be opened

    @property
    def location(self) -> str:
        """This repository's absolute location, as other repositories record it."""
        if self.path is None:
            raise InvalidInputError("an in-memory repository cannot be a base repository")
        return str(Path(self.path).resolve())

    def open_bases(self, depth: int = 0) -> None:
        """(Re)open the base repositories ``alternates`` names; record those that do not open."""
        self.bases, self.broken_alternates = [], []
        self.store.sources, self.graph.name_sources = [], []
        self.store.missing_hint = ""
        if self.path is None:
            return
        here = self.location
        for link in read_links(self.backend, ALTERNATES_KEY, here):
            try:
                if depth >= MAX_BASE_DEPTH:
                    raise UnsupportedFormatError("base repositories nest too deeply")
                base = open_context(link.location, depth=depth + 1)
            except CkstoreError as exc:
                self.broken_alternates.append(BrokenBase(link, here, why_unopened(exc)))
                continue
            self.add_base(base)
        # A missing object is then most likely in the lost base (or a base's): say how to reconnect it.
        hints = [f"; base repository {b}" for b in self.broken_alternates] + [b.store.missing_hint for b in self.bases]
        self.store.missing_hint = next((h for h in hints if h), "")

    def add_base(self, base: RepoContext) -> None:
        self.bases.append(base)
        self.store.sources.append(base.store)
        self.graph.name_sources.append(base.graph)

    def allow_packs(self) -> bool:
        """Whether objects may go into local packs: a repository of format 2 to 4 becomes 5
        first (config.json, durable), so an older ckstore refuses it rather than missing objects;
        a version 1 repository stays readable by the oldest ckstore and keeps objects loose."""
        return self.upgrade(PACKS_VERSION)

    def upgrade(self, version: int) -> bool:
        """Raise a repository of format 2 or newer to at least ``version`` (config.json, durable)
        before something only that version defines is written; whether it is at ``version`` now.
        The version on disk decides, under the settings lock (``update_config``): an upgrade that
        checked a copy read earlier could otherwise land after a higher one and lower the version
        under objects that need it."""
        if self.config.version >= version or self.config.version < 2:
            return self.config.version >= version  # the version never goes down: no need to look
        config = self.update_config(lambda now: replace(now, version=version) if 2 <= now.version < version else now)
        return config.version >= version

    def set_config(self, config: RepoConfig) -> None:
        """Change the repository settings to ``config`` (they apply to objects written from now
        on). Only the settings in which ``config`` differs from this context's copy change: they
        are applied to the settings on disk now, so a setting another process changed since this
        one opened the repository is kept, and the version never goes down."""
        config.validate()
        changed = {
            f.name: getattr(config, f.name)
            for f in fields(config)
            if getattr(config, f.name) != getattr(self.config, f.name)
        }
        self.update_config(lambda now: replace(now, **changed))

    def update_config(self, change: Callable[[RepoConfig], RepoConfig]) -> RepoConfig:
        """Compare-and-swap of config.json: under the settings lock, read the settings on disk,
        apply ``change`` and write the result back unless it is the same; the version is never
        lowered. This context then uses the settings written (or found)."""
        with self.backend.config_lock(CONFIG_LOCK_TIMEOUT):
            now = self.read_config()
            self._check_same(now)
            wanted = change(now)
            wanted = replace(wanted, version=max(wanted.version, now.version))
            wanted.validate()
            if wanted != now:
                self.backend.replace(CONFIG_KEY, wanted.to_json())
        self.config = wanted
        self.store.settings = wanted.encoding
        return wanted

    def refresh(self) -> RepoConfig:
        """Use the settings on disk now (a long run, once it holds its lock: a setting changed
        since it opened the repository applies to what it writes); refused when the repository
        was created again meanwhile (``check_same_repository``)."""
        now = self.read_config()
        self._check_same(now)
        self.config = now
        self.store.settings = now.encoding
        return now

    def check_same_repository(self) -> None:
        """Refuse to go on when the folder now holds another repository than the one this context
        opened (deleted and initialised again at the same path): its settings, version, locks and
        objects are not the ones this process planned with."""
        self._check_same(self.read_config())

    def _check_same(self, now: RepoConfig) -> None:
        if now.repository_id != self.config.repository_id:
            raise RepoReplacedError(
                f"the repository at {self.path if self.path is not None else 'this location'} was deleted"
                " and created again since this process opened it"
            )

    def read_config(self) -> RepoConfig:
        """The settings as config.json holds them now."""
        try:
            data = self.backend.get(CONFIG_KEY)
        except KeyError:
            raise RepoNotFoundError(
                f"{self.backend.describe(CONFIG_KEY)} is gone: the repository was removed"
            ) from None
        return RepoConfig.from_json(data, self.backend.describe(CONFIG_KEY))


def open_context(
    path: str | os.PathLike[str] | None = None,
    *,
    backend: Backend | None = None,
    open_alternates: bool = True,
    depth: int = 0,
) -> RepoContext:
    """Open the repository at ``path`` (or its ``.ckstore`` child), or on ``backend``."""
    root: Path | None
    if backend is None:
        if path is None:
            raise RepoNotFoundError("no repository path given")
        root = locate_repository(path, CONFIG_KEY, DEFAULT_DIR)
        if root is None:
            raise RepoNotFoundError(f"no ckstore repository at {path} (run 'ckstore init')")
        backend = LocalBackend(root)
    else:
        root = Path(path) if path is not None else None
    try:
        config_bytes = backend.get(CONFIG_KEY)
    except KeyError:
        raise RepoNotFoundError(f"no ckstore repository at {path}") from None
    config = RepoConfig.from_json(config_bytes, backend.describe(CONFIG_KEY))
    store = ObjectStore(backend, settings=config.encoding)
    refs = RefStore(backend)
    ctx = RepoContext(root, backend, config, store, refs, CommitGraph(backend, store, refs))
    if isinstance(backend, LocalBackend):
        backend.allow_packs = ctx.allow_packs
    if open_alternates:
        ctx.open_bases(depth)
    return ctx


def why_unopened(exc: CkstoreError) -> str:
    """Why a linked repository could not be opened, without advice meant for other situations."""
    return "no repository there" if isinstance(exc, RepoNotFoundError) else str(exc)


def init_context(
    path: str | os.PathLike[str],
    config: RepoConfig,
    backend: Backend | None = None,
) -> RepoContext:
    """Create a repository with ``config`` (on a new local folder unless ``backend`` is given)."""
    import secrets  # only a new repository needs it: reading commands start lighter

    config = replace(config, repository_id=secrets.token_hex(16))  # never another repository's
    config.validate()
    if backend is None:
        backend = LocalBackend(prepare_new_repository(path, CONFIG_KEY))
    if not backend.put_if_absent(CONFIG_KEY, config.to_json()):
        raise RefExistsError(f"a repository already exists at {path}")
    RefStore(backend).set_head_branch(DEFAULT_BRANCH)
    backend.keep_reserve()  # gc's room to start on a full disk
    return open_context(path, backend=backend)


def open_or_init_context(
    path: str | os.PathLike[str],
    config: RepoConfig,
    backend: Backend | None = None,
    check: Iterable[str] = (),
) -> RepoContext:
    """The repository at ``path``, created with ``config`` if there is none (a training script
    that runs twice). A setting named in ``check`` that the existing repository has with another
    value is refused: the caller asked for it explicitly and would silently not get it."""
    try:
        return init_context(path, config, backend)
    except RefExistsError:  # there already, or created meanwhile by another process
        ctx = open_context(path, backend=backend)
    for name in check:
        have, want = getattr(ctx.config, name), getattr(config, name)
        if have != want:
            raise InvalidInputError(f"the repository at {path} exists with {name} {have}, not {want}")
    return ctx


def memory_context(config: RepoConfig) -> RepoContext:
    ctx = init_context("<memory>", config, backend=MemoryBackend())
    ctx.path = None  # no location: it can be neither a base nor an overlay of another repository
    return ctx


def find_context(
    explicit: str | os.PathLike[str] | None = None, start: str | os.PathLike[str] | None = None
) -> RepoContext:
    """``explicit``, else $CKSTORE_REPO, else the nearest .ckstore at or above ``start``."""
    if explicit:
        return open_context(explicit)
    env = os.environ.get(REPO_ENV)
    if env:
        return open_context(env)
    found = find_repository(start or Path.cwd(), CONFIG_KEY, DEFAULT_DIR)
    if found is None:
        raise RepoNotFoundError(
            "no ckstore repository here or in any parent directory (use --repo, set CKSTORE_REPO, or run 'ckstore init')"
        )
    return open_context(found)
