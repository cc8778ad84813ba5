"""``Repo``: the API every caller uses (the CLI is a thin layer over it).

Write order for a commit, under the shared repository lock: chunks, then the manifest, then the
branch ref by compare-and-swap. A crash at any point leaves the refs as they were plus, at worst,
unreferenced objects, which gc removes under the exclusive lock.
"""

from __future__ import annotations

import heapq
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

from . import provenance
from .backend.base import Backend
from .backend.local import LocalBackend
from .backend.memory import MemoryBackend
from .checkout import CheckoutResult, plan_outputs, total_size, write_outputs
from .codec import Kind
from .errors import (
    AmbiguousRefError,
    IntegrityError,
    InvalidInputError,
    RefChangedError,
    RefExistsError,
    RefNotFoundError,
    RepoNotFoundError,
    UnsupportedFormatError,
)
from .ids import ObjectId, is_id_prefix, is_object_id
from .ingest import ParentChunks, collect_sources, ingest, parent_chunks
from .manifest import Commit, FileEntry, decode_commit, encode_commit
from .refs import HEADS, TAGS, RefStore, check_ref_name
from .store import EncodingSettings, ObjectStore
from .values import encode_value

CONFIG_KEY = "config.json"
PRUNED_KEY = "pruned"
REPO_FORMAT_VERSION = 2  # 2: byte-grouped and delta chunk encodings (docs/format.md)
DEFAULT_DIR = ".ckstore"
DEFAULT_CHUNK_SIZE = 1 << 20
DEFAULT_ZSTD_LEVEL = 3
DEFAULT_MAX_DELTA_DEPTH = 4  # measured trade-off: docs/benchmarks.md
MAX_DELTA_DEPTH_LIMIT = 16
LOCK_TIMEOUT = 600.0
_SUFFIX = re.compile(r"~(\d*)$|\^$")


class ProgressBar(Protocol):
    def update(self, n: int) -> Any: ...

    def close(self) -> Any: ...


ProgressFactory = Callable[[int, str], ProgressBar]


@dataclass(frozen=True)
class RepoConfig:
    chunk_size: int = DEFAULT_CHUNK_SIZE
    zstd_level: int = DEFAULT_ZSTD_LEVEL
    max_delta_depth: int = DEFAULT_MAX_DELTA_DEPTH
    # A version-1 repository stays version 1 (raw and zstd objects only, so older ckstore can
    # still read it) until repack upgrades it.
    version: int = REPO_FORMAT_VERSION

    def to_json(self) -> bytes:
        doc: dict[str, Any] = {"ckstore": "repository", "version": self.version,
                               "chunk_size": self.chunk_size, "zstd_level": self.zstd_level}
        if self.version >= 2:
            doc["max_delta_depth"] = self.max_delta_depth
        return (json.dumps(doc, indent=2) + "\n").encode()

    @property
    def encoding(self) -> EncodingSettings:
        return EncodingSettings(self.zstd_level, self.max_delta_depth if self.version >= 2 else 0, self.version)

    @classmethod
    def from_json(cls, data: bytes, where: str) -> RepoConfig:
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            raise IntegrityError(f"{where} is not valid JSON") from None
        if not isinstance(doc, dict) or doc.get("ckstore") != "repository":
            raise UnsupportedFormatError(f"{where} is not a ckstore repository configuration")
        version = doc.get("version")
        if not isinstance(version, int) or version > REPO_FORMAT_VERSION:
            raise UnsupportedFormatError(
                f"repository format version {version} is newer than this ckstore supports ({REPO_FORMAT_VERSION});"
                " upgrade ckstore"
            )
        depth = doc.get("max_delta_depth", 0 if version == 1 else DEFAULT_MAX_DELTA_DEPTH)
        config = cls(doc.get("chunk_size"), doc.get("zstd_level"), depth, version)  # type: ignore[arg-type]
        config.validate(where)
        return config

    def validate(self, where: str = "configuration") -> None:
        if not isinstance(self.chunk_size, int) or not 4096 <= self.chunk_size <= 1 << 28:
            raise InvalidInputError(f"{where}: chunk_size must be between 4 KiB and 256 MiB")
        if not isinstance(self.zstd_level, int) or not 1 <= self.zstd_level <= 22:
            raise InvalidInputError(f"{where}: zstd_level must be between 1 and 22")
        if not isinstance(self.max_delta_depth, int) or not 0 <= self.max_delta_depth <= MAX_DELTA_DEPTH_LIMIT:
            raise InvalidInputError(f"{where}: max_delta_depth must be between 0 and {MAX_DELTA_DEPTH_LIMIT}")
        if self.version not in (1, 2):
            raise UnsupportedFormatError(f"{where}: unknown repository format version {self.version}")


@dataclass(frozen=True)
class LogEntry:
    id: ObjectId
    commit: Commit
    pruned_parents: tuple[ObjectId, ...]


@dataclass(frozen=True)
class TensorChange:
    path: str
    name: str | None  # None: a whole non-safetensors file
    status: str  # "added", "removed", "changed" or "unchanged"
    stored_bytes: int  # what B's version costs beyond what A already stores


@dataclass(frozen=True)
class Stats:
    logical_bytes: int
    stored_bytes: int
    commits: int
    objects: int

    @property
    def ratio(self) -> float:
        return self.stored_bytes / self.logical_bytes if self.logical_bytes else 0.0


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


class Repo:
    """A ckstore repository. ``Repo(path)`` opens one; ``Repo.init(path)`` creates one."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *, backend: Backend | None = None) -> None:
        if backend is None:
            if path is None:
                raise RepoNotFoundError("no repository path given")
            root = Path(path)
            if not (root / CONFIG_KEY).is_file() and (root / DEFAULT_DIR / CONFIG_KEY).is_file():
                root = root / DEFAULT_DIR
            if not (root / CONFIG_KEY).is_file():
                raise RepoNotFoundError(f"no ckstore repository at {path} (run 'ckstore init')")
            backend = LocalBackend(root)
            self.path: Path | None = root
        else:
            self.path = Path(path) if path is not None else None
        self.backend = backend
        try:
            config_bytes = backend.get(CONFIG_KEY)
        except KeyError:
            raise RepoNotFoundError(f"no ckstore repository at {path}") from None
        self.config = RepoConfig.from_json(config_bytes, backend.describe(CONFIG_KEY))
        self.store = ObjectStore(backend, settings=self.config.encoding)
        self.refs = RefStore(backend)
        self._commits: dict[str, Commit] = {}

    # ---- creating and finding ----------------------------------------------------------------

    @classmethod
    def init(
        cls, path: str | os.PathLike[str] = DEFAULT_DIR, *, chunk_size: int | None = None,
        zstd_level: int | None = None, max_delta_depth: int | None = None, backend: Backend | None = None,
    ) -> Repo:
        config = RepoConfig(
            chunk_size or DEFAULT_CHUNK_SIZE, zstd_level or DEFAULT_ZSTD_LEVEL,
            DEFAULT_MAX_DELTA_DEPTH if max_delta_depth is None else max_delta_depth,
        )
        config.validate()
        if backend is None:
            root = Path(path)
            if (root / CONFIG_KEY).exists():
                raise RefExistsError(f"a repository already exists at {root}")
            if root.exists() and (not root.is_dir() or any(root.iterdir())):
                raise InvalidInputError(f"{root} exists and is not an empty directory")
            root.mkdir(parents=True, exist_ok=True)
            backend = LocalBackend(root)
        if not backend.put_if_absent(CONFIG_KEY, config.to_json()):
            raise RefExistsError(f"a repository already exists at {path}")
        RefStore(backend).set_head_branch("main")
        return cls(path, backend=backend)

    @classmethod
    def memory(cls, **config: int) -> Repo:
        """A repository held in memory (tests, experiments)."""
        return cls.init("<memory>", backend=MemoryBackend(), **config)

    @classmethod
    def find(cls, explicit: str | os.PathLike[str] | None = None, start: str | os.PathLike[str] | None = None) -> Repo:
        """``explicit``, else $CKSTORE_REPO, else the nearest .ckstore at or above ``start``."""
        if explicit:
            return cls(explicit)
        env = os.environ.get("CKSTORE_REPO")
        if env:
            return cls(env)
        here = Path(start or Path.cwd()).resolve()
        for folder in (here, *here.parents):
            if (folder / DEFAULT_DIR / CONFIG_KEY).is_file():
                return cls(folder / DEFAULT_DIR)
        raise RepoNotFoundError(
            "no ckstore repository here or in any parent directory (use --repo, set CKSTORE_REPO, or run 'ckstore init')"
        )

    # ---- refs ----------------------------------------------------------------------------------

    @property
    def head_branch(self) -> str:
        return self.refs.head_branch()

    def branches(self) -> dict[str, ObjectId]:
        return self.refs.list(HEADS)

    def tags(self) -> dict[str, ObjectId]:
        return self.refs.list(TAGS)

    def create_branch(self, name: str, ref: str = "HEAD") -> ObjectId:
        oid = self.resolve(ref)
        self.refs.update(HEADS + check_ref_name(name, "branch name"), oid, expected=None)
        return oid

    def create_tag(self, name: str, ref: str = "HEAD") -> ObjectId:
        oid = self.resolve(ref)
        self.refs.update(TAGS + check_ref_name(name, "tag name"), oid, expected=None)
        return oid

    def delete_branch(self, name: str) -> None:
        if not self.refs.delete(HEADS + check_ref_name(name, "branch name")):
            raise RefNotFoundError(f"no branch {name!r}")

    def delete_tag(self, name: str) -> None:
        if not self.refs.delete(TAGS + check_ref_name(name, "tag name")):
            raise RefNotFoundError(f"no tag {name!r}")

    def pruned(self) -> set[ObjectId]:
        """Commits that gc deleted on purpose; history shows them as pruned, fsck accepts them."""
        try:
            text = self.backend.get(PRUNED_KEY).decode("ascii", "replace")
        except KeyError:
            return set()
        ids = text.split()
        if not all(is_object_id(i) for i in ids):
            raise IntegrityError(f"{self.backend.describe(PRUNED_KEY)} is corrupt")
        return {ObjectId(i) for i in ids}

    def write_pruned(self, ids: Iterable[str]) -> None:
        self.backend.replace(PRUNED_KEY, "".join(f"{i}\n" for i in sorted(set(ids))).encode())

    def resolve(self, spec: str) -> ObjectId:
        """A commit id from a full id, unique prefix (6+), branch, tag, HEAD, or any of these + ``~N``/``^``."""
        if not isinstance(spec, str) or not spec:
            raise InvalidInputError("empty revision")
        base, steps = spec, 0
        while (m := _SUFFIX.search(base)) and m.start() > 0:
            steps += int(m.group(1)) if m.group(1) else 1
            base = base[: m.start()]
        oid = self._resolve_name(base)
        for _ in range(steps):
            parents = self.read_commit(oid).parents
            if not parents:
                raise RefNotFoundError(f"{spec}: history of {base!r} is shorter than that")
            if parents[0] in self.pruned():
                raise RefNotFoundError(f"{spec}: commit {parents[0][:12]} was pruned by gc")
            oid = parents[0]
        return oid

    def _resolve_name(self, name: str) -> ObjectId:
        if name == "HEAD":
            branch = self.head_branch
            oid = self.refs.read(HEADS + branch)
            if oid is None:
                raise RefNotFoundError(f"HEAD: branch {branch!r} has no commits yet")
            return oid
        if is_object_id(name) and self.store.has(name):
            return ObjectId(name)
        if name.startswith(("refs/heads/", "refs/tags/")):
            check_ref_name(name[len("refs/"):])
            candidates = [name]
        else:
            check_ref_name(name, "revision")
            candidates = [HEADS + name, TAGS + name]
        for ref in candidates:
            oid = self.refs.read(ref)
            if oid is not None:
                return oid
        if is_id_prefix(name):
            matches = [oid for oid in self.store.iter_ids(name) if self._is_commit(oid)]
            if len(matches) > 1:
                raise AmbiguousRefError(f"commit id prefix {name!r} matches {len(matches)} commits; give more digits")
            if matches:
                return matches[0]
        raise RefNotFoundError(f"unknown revision {name!r} (not a branch, tag or commit id)")

    def _is_commit(self, oid: str) -> bool:
        try:
            return self.store.kind(oid) == Kind.COMMIT
        except IntegrityError:
            return False

    # ---- commits -------------------------------------------------------------------------------

    def read_commit(self, oid: str) -> Commit:
        commit = self._commits.get(oid)
        if commit is None:
            try:
                commit = decode_commit(self.store.get_commit(oid))
            except IntegrityError as exc:
                raise IntegrityError(f"commit {oid}: {exc}") from None
            self._commits[oid] = commit
        return commit

    def commit(
        self, paths: Sequence[str | os.PathLike[str]] | str | os.PathLike[str], message: str = "",
        branch: str | None = None, metadata: Mapping[str, Any] | None = None,
        progress: ProgressFactory | None = None,
    ) -> str:
        """Record files and directories as one commit on ``branch``; return the commit id."""
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        branch = check_ref_name(branch or self.head_branch, "branch name")
        meta = self.encode_metadata(metadata)
        sources = collect_sources(paths, exclude=self.path or Path("/nonexistent"))
        with self.backend.repo_lock(exclusive=False, timeout=LOCK_TIMEOUT):
            bar = progress(sum(s.size for s in sources), "commit") if progress else None
            try:
                files, added = ingest(
                    self.store, sources, self.config.chunk_size, bar.update if bar else None,
                    parent=self._parent_chunks(branch),
                )
            finally:
                if bar:
                    bar.close()
            return self.record_commit(files, added, message, branch, meta)

    def _parent_chunks(self, branch: str) -> ParentChunks | None:
        """The branch tip's chunks by position: delta base candidates for the new commit."""
        tip = self.refs.read(HEADS + branch)
        if tip is None or self.config.encoding.max_delta_depth == 0:
            return None
        try:
            return parent_chunks(self.read_commit(tip).files)
        except IntegrityError:
            return None  # a damaged parent only costs compression

    def set_config(self, config: RepoConfig) -> None:
        """Replace the repository settings (they apply to objects written from now on)."""
        config.validate()
        self.backend.replace(CONFIG_KEY, config.to_json())
        self.config = config
        self.store.settings = config.encoding
        self.store.zstd_level = config.zstd_level

    def repack(self, **kwargs: Any) -> Any:
        from .repack import repack

        return repack(self, **kwargs)

    @staticmethod
    def encode_metadata(metadata: Mapping[str, Any] | None) -> Any:
        metadata = dict(metadata or {})
        for key in metadata:
            if not isinstance(key, str):
                raise InvalidInputError(f"metadata keys must be strings, not {key!r}")
        return encode_value(metadata)

    def record_commit(self, files: Sequence[FileEntry], added: int, message: str, branch: str, metadata: Any) -> str:
        """Write the manifest and move ``branch`` to it (objects must be stored already)."""
        ref = HEADS + branch
        for _ in range(20):
            parent = self.refs.read(ref)
            commit = Commit(
                parents=(parent,) if parent else (), time=_now(), message=message, branch=branch,
                files=tuple(files), metadata=metadata, provenance=provenance.collect(),
                logical_bytes=sum(f.size for f in files), added_bytes=added,
            )
            oid = self.store.put_commit(encode_commit(commit)).id
            try:
                self.refs.update(ref, oid, expected=parent)
            except RefChangedError:
                continue  # another writer advanced the branch: re-parent onto its commit, as documented
            if self.refs.read(HEADS + self.head_branch) is None and branch != self.head_branch:
                self.refs.set_head_branch(branch)
            self._commits[oid] = commit
            return oid
        raise RefChangedError(f"branch {branch!r} kept moving; commit not recorded")

    def checkout(
        self, ref: str, out_dir: str | os.PathLike[str], *, force: bool = False,
        only: Sequence[str] | None = None, progress: ProgressFactory | None = None,
    ) -> CheckoutResult:
        """Write the files of ``ref`` into ``out_dir``, byte-identical (or only matching tensors)."""
        commit = self.read_commit(self.resolve(ref))
        outputs = plan_outputs(self.store, commit, only)
        bar = progress(total_size(outputs), "checkout") if progress else None
        try:
            return write_outputs(self.store, outputs, Path(out_dir), force, bar.update if bar else None)
        finally:
            if bar:
                bar.close()

    # ---- history and inspection ----------------------------------------------------------------

    def log(self, ref: str | None = None) -> list[LogEntry]:
        """Commits reachable from ``ref`` (default HEAD), newest first."""
        start = self.resolve(ref or "HEAD")
        pruned = self.pruned()
        seen = {start}
        heap = [(_neg_time(self.read_commit(start).time), start)]
        out = []
        while heap:
            _, oid = heapq.heappop(heap)
            commit = self.read_commit(oid)
            gone = []
            for parent in commit.parents:
                if parent in pruned or not self.store.has(parent):
                    gone.append(parent)
                elif parent not in seen:
                    seen.add(parent)
                    heapq.heappush(heap, (_neg_time(self.read_commit(parent).time), parent))
            out.append(LogEntry(oid, commit, tuple(gone)))
        return out

    def show(self, ref: str = "HEAD") -> tuple[ObjectId, Commit]:
        oid = self.resolve(ref)
        return oid, self.read_commit(oid)

    def diff(self, a: str, b: str) -> list[TensorChange]:
        """Per tensor (and per plain file): added, removed, changed or unchanged from ``a`` to ``b``."""
        old, new = self.read_commit(self.resolve(a)), self.read_commit(self.resolve(b))
        old_items, new_items = _items(old), _items(new)
        have = {c.id for c in old.all_chunks()}
        out = []
        for key, chunks in new_items.items():
            if key not in old_items:
                status = "added"
            else:
                status = "unchanged" if old_items[key] == chunks else "changed"
            cost = sum(self.store.stored_size(c) or 0 for c in dict.fromkeys(chunks) if c not in have)
            out.append(TensorChange(key[0], key[1], status, cost))
        out.extend(TensorChange(k[0], k[1], "removed", 0) for k in old_items if k not in new_items)
        return out

    def reachable_commits(self) -> list[ObjectId]:
        """Every commit reachable from a branch or tag (pruned ancestors excluded)."""
        pruned = self.pruned()
        todo = [*self.branches().values(), *self.tags().values()]
        seen: set[ObjectId] = set()
        while todo:
            oid = todo.pop()
            if oid in seen or oid in pruned:
                continue
            seen.add(oid)
            todo.extend(p for p in self.read_commit(oid).parents if p not in pruned)
        return sorted(seen)

    def stats(self) -> Stats:
        commits = self.reachable_commits()
        stored = objects = 0
        for oid in self.store.iter_ids():
            stored += self.store.stored_size(oid) or 0
            objects += 1
        logical = sum(self.read_commit(c).logical_bytes for c in commits)
        return Stats(logical, stored, len(commits), objects)

    def gc(self, **kwargs: Any) -> Any:
        from .gc import collect_garbage

        return collect_garbage(self, **kwargs)

    def fsck(self, read_data: bool = False) -> list[str]:
        from .fsck import check

        return check(self, read_data=read_data)


def _neg_time(time: str) -> float:
    return -datetime.fromisoformat(time).timestamp()


def _items(commit: Commit) -> dict[tuple[str, str | None], list[str]]:
    out: dict[tuple[str, str | None], list[str]] = {}
    for f in commit.files:
        if f.kind == "safetensors":
            for t in f.tensors:
                out[(f.path, t.name)] = [c.id for c in t.chunks]
        else:
            out[(f.path, None)] = [c.id for c in f.chunks]
    return out
