"""``Repo``: the API every caller uses (the CLI is a thin layer over it).

Write order for a commit, under the shared repository lock: chunks, then the manifest, then the
branch ref by compare-and-swap. A crash at any point leaves the refs as they were plus, at worst,
unreferenced objects, which gc removes under the exclusive lock.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

from . import history, provenance
from .backend.base import Backend
from .backend.local import LocalBackend
from .backend.memory import MemoryBackend
from .config import CONFIG_KEY, DEFAULT_CHUNK_SIZE, DEFAULT_MAX_DELTA_DEPTH, DEFAULT_ZSTD_LEVEL, RepoConfig
from .checkout import CheckoutResult, plan_outputs, total_size, write_outputs
from .codec import Kind
from .errors import (
    CkstoreError,
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
from .gc import GcReport, collect_garbage
from .history import LogEntry, Stats, TensorChange
from .ingest import MemoryFile, ParentChunks, SourceFile, collect_sources, ingest, parent_chunks
from .manifest import Commit, FileEntry, decode_commit, encode_commit, parse_json
from .refs import HEADS, TAGS, RefStore, check_ref_name, ref_candidates
from .retention import RetentionPolicy, best
from .store import ObjectStore
from .values import encode_value

PRUNED_KEY = "pruned"
DEFAULT_DIR = ".ckstore"
LOCK_TIMEOUT = 600.0
_SUFFIX = re.compile(r"~(\d*)$|\^$")


class ProgressBar(Protocol):
    def update(self, n: int) -> Any: ...

    def close(self) -> Any: ...


ProgressFactory = Callable[[int, str], ProgressBar]


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


class Repo:
    """A ckstore repository. ``Repo(path)`` opens one; ``Repo.init(path)`` creates one."""

    def __init__(
        self, path: str | os.PathLike[str] | None = None, *, backend: Backend | None = None,
        _open_alternates: bool = True, _depth: int = 0,
    ) -> None:
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
        self.base_repos: list[Repo] = []
        self.broken_alternates: list[str] = []  # base repositories that could not be opened (fsck)
        if _open_alternates:
            self._open_base_repos(_depth)

    def _open_base_repos(self, depth: int) -> None:
        from .overlay import ALTERNATES_KEY, MAX_BASE_DEPTH, read_paths

        for location in read_paths(self, ALTERNATES_KEY):
            try:
                if depth >= MAX_BASE_DEPTH:
                    raise UnsupportedFormatError("base repositories nest too deeply")
                base = Repo(location, _depth=depth + 1)
            except CkstoreError as exc:
                self.broken_alternates.append(f"{location}: {exc}")
                continue
            self.base_repos.append(base)
            self.store.alternates.append(base.store)

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

    def pruned(self) -> dict[ObjectId, tuple[ObjectId, ...]]:
        """Commits gc deleted on purpose, each with its parents (so history stays connected
        through it to older kept commits); log shows them as pruned and fsck accepts them."""
        try:
            text = self.backend.get(PRUNED_KEY).decode("ascii", "replace")
        except KeyError:
            return {}
        out: dict[ObjectId, tuple[ObjectId, ...]] = {}
        for line in text.splitlines():
            ids = line.split(" ")
            if not all(is_object_id(i) for i in ids):
                raise IntegrityError(f"{self.backend.describe(PRUNED_KEY)} is corrupt")
            out[ObjectId(ids[0])] = tuple(ObjectId(i) for i in ids[1:])
        return out

    def write_pruned(self, pruned: Mapping[str, Sequence[str]]) -> None:
        lines = "".join(" ".join([oid, *pruned[oid]]) + "\n" for oid in sorted(pruned))
        self.backend.replace(PRUNED_KEY, lines.encode())

    def resolve(self, spec: str) -> ObjectId:
        """A commit id from a full id, unique prefix (6+), branch, tag, HEAD, or any of these + ``~N``/``^``."""
        if not isinstance(spec, str) or not spec:
            raise InvalidInputError("empty revision")
        base, steps = spec, 0
        while (m := _SUFFIX.search(base)) and m.start() > 0:
            steps += int(m.group(1)) if m.group(1) else 1
            base = base[: m.start()]
        oid = self._resolve_with_bases(base)
        for _ in range(steps):
            parents = self.read_commit(oid).parents
            if not parents:
                raise RefNotFoundError(f"{spec}: history of {base!r} is shorter than that")
            if parents[0] in self.pruned():
                raise RefNotFoundError(f"{spec}: commit {parents[0][:12]} was pruned by gc")
            oid = parents[0]
        return oid

    def _resolve_with_bases(self, name: str) -> ObjectId:
        """Resolve here first, then in base repositories (an overlay may name its base's commits)."""
        try:
            return self._resolve_name(name)
        except RefNotFoundError:
            if name == "HEAD":
                raise
            for base in self.base_repos:
                try:
                    return base._resolve_with_bases(name)
                except RefNotFoundError:
                    continue
            raise

    def _resolve_name(self, name: str) -> ObjectId:
        if name == "HEAD":
            branch = self.head_branch
            oid = self.refs.read(HEADS + branch)
            if oid is None:
                raise RefNotFoundError(f"HEAD: branch {branch!r} has no commits yet")
            return oid
        if is_object_id(name) and self.store.has(name) and self._is_commit(name):
            return ObjectId(name)
        for ref in ref_candidates(name):
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
            data = self.store.get_commit(oid)  # its errors already name the commit
            try:
                commit = decode_commit(data)
            except IntegrityError as exc:
                raise IntegrityError(f"commit {oid}: {exc}") from None
            self._commits[oid] = commit
        return commit

    def commit(
        self, paths: Sequence[str | os.PathLike[str]] | str | os.PathLike[str], message: str = "",
        branch: str | None = None, metadata: Mapping[str, Any] | None = None,
        progress: ProgressFactory | None = None, base: str | None = None, base_repo: str | os.PathLike[str] | None = None,
    ) -> str:
        """Record files and directories as one commit on ``branch``; return the commit id.

        With ``base`` (and optionally ``base_repo``) the commit is an overlay: every file of the
        base commit that the given paths do not replace is inherited, and tensors equal to the
        base's cost nothing.
        """
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        branch = check_ref_name(branch or self.head_branch, "branch name")
        meta = self.encode_metadata(metadata)
        sources = collect_sources(paths, exclude=self.path or Path("/nonexistent"))
        return self._commit_sources(sources, message, branch, meta, progress, base=self._base(base, base_repo))

    def _base(self, base: str | None, base_repo: str | os.PathLike[str] | None) -> tuple[ObjectId, str | None] | None:
        """Resolve an overlay's base commit; a base in another repository becomes an alternate."""
        if base_repo is None:
            return None if base is None else (self.resolve(base), None)
        from .overlay import link_base_repo, repo_location

        other = Repo(base_repo)
        oid = other.resolve(base or "HEAD")
        link_base_repo(self, other)
        self.base_repos.append(other)
        return oid, repo_location(other)

    def commit_state(
        self, state: object, message: str = "", branch: str | None = None,
        metadata: Mapping[str, Any] | None = None, progress: ProgressFactory | None = None,
        base: str | None = None, base_repo: str | os.PathLike[str] | None = None,
    ) -> str:
        """Commit a nested training state (tensors, arrays, scalars…) without pickle; return the id."""
        from .state import STATE_TENSORS, STATE_VALUES, state_files

        branch = check_ref_name(branch or self.head_branch, "branch name")
        meta = self.encode_metadata(metadata)
        sources = state_files(state)  # refuses unencodable values before anything is stored
        return self._commit_sources(
            sources, message, branch, meta, progress, state={"values": STATE_VALUES, "tensors": STATE_TENSORS},
            base=self._base(base, base_repo),
        )

    def load_state(
        self, ref: str = "HEAD", *, only: str | Sequence[str] | None = None, device: Any = "cpu", lazy: bool = False
    ) -> Any:
        """The state committed at ``ref``, bit-exact; ``only`` filters by key prefix or glob."""
        from .state import load_state

        return load_state(self, ref, only=only, device=device, lazy=lazy)

    def _commit_sources(
        self, sources: Sequence[SourceFile | MemoryFile], message: str, branch: str, meta: Any,
        progress: ProgressFactory | None, state: Mapping[str, str] | None = None,
        base: tuple[ObjectId, str | None] | None = None,
    ) -> str:
        base_commit = self.read_commit(base[0]) if base is not None else None
        with self.backend.repo_lock(exclusive=False, timeout=LOCK_TIMEOUT):
            bar = progress(sum(s.size for s in sources), "commit") if progress else None
            # An overlay's tensors are forward deltas against its base's (the base may live in
            # another repository and must not change); a branch's new chunks are stored whole and
            # the parent's re-encoded against them, so the branch tip is cheap to read.
            overlay = bool(base_commit and self.config.encoding.max_delta_depth)
            hints = parent_chunks(base_commit.files) if overlay and base_commit else None
            recent = () if overlay else self._recent_chunks(branch)
            try:
                # One durability barrier for all of the commit's chunks; they are durable under
                # their names when the block ends, before the manifest is written (format.md §8).
                with self.store.batch() as staged:
                    files, added = ingest(
                        staged, sources, self.config.chunk_size, bar.update if bar else None, parent=hints,
                        history=recent,
                    )
            finally:
                if bar:
                    bar.close()
            base_record = None
            if base is not None and base_commit is not None:
                from .overlay import merge_files

                files = merge_files(base_commit, files)
                base_record = {"commit": base[0], "repo": base[1]}
            return self.record_commit(files, added, message, branch, meta, state, base_record)

    def _recent_chunks(self, branch: str) -> list[ParentChunks]:
        """The chunks by position of the branch tip and its first parents, newest first, as
        many as a chain can be long: the tip's are re-encoded against the new commit's, the
        older ones tell how long the chain below each of them already is."""
        depth = self.config.encoding.max_delta_depth
        oid = self.refs.read(HEADS + branch)
        out: list[ParentChunks] = []
        while oid is not None and depth and len(out) <= depth:
            try:
                commit = self.read_commit(oid)
            except CkstoreError:
                break  # pruned or damaged: only costs compression
            out.append(parent_chunks(commit.files))
            oid = commit.parents[0] if commit.parents else None
        return out

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

    def record_commit(
        self, files: Sequence[FileEntry], added: int, message: str, branch: str, metadata: Any,
        state: Mapping[str, str] | None = None, base: Mapping[str, str | None] | None = None,
    ) -> str:
        """Write the manifest and move ``branch`` to it (objects must be stored already)."""
        ref = HEADS + branch
        for _ in range(20):
            parent = self.refs.read(ref)
            commit = Commit(
                parents=(parent,) if parent else (), time=_now(), message=message, branch=branch,
                files=tuple(files), metadata=metadata, provenance=provenance.collect(),
                logical_bytes=sum(f.size for f in files), added_bytes=added, state=state, base=base,
            )
            oid = self.store.put_commit(encode_commit(commit)).id
            try:
                self.refs.update(ref, oid, expected=parent)
            except RefChangedError:
                continue  # another writer advanced the branch: re-parent onto its commit, as documented
            except RefExistsError:
                if self.refs.read(ref) is None:
                    raise  # a name conflict ("a" vs "a/b"), not a race
                continue  # another writer created the branch first: re-parent onto its commit
            if self.refs.read(HEADS + self.head_branch) is None and branch != self.head_branch:
                self.refs.set_head_branch(branch)
            self._commits[oid] = commit
            return oid
        raise RefChangedError(f"branch {branch!r} kept moving; commit not recorded")

    def checkout(
        self, ref: str, out_dir: str | os.PathLike[str], *, force: bool = False,
        only: Sequence[str] | None = None, progress: ProgressFactory | None = None,
        shard_size: int | str | None = None, merge_lora: bool = False,
    ) -> CheckoutResult:
        """Write the files of ``ref`` into ``out_dir``, byte-identical (or only matching tensors).

        ``shard_size`` ("500MB", "2GiB", bytes) writes the tensors as Hugging Face shards instead;
        ``merge_lora`` writes the base model with a committed PEFT LoRA adapter merged in.
        """
        commit = self.read_commit(self.resolve(ref))
        if merge_lora:
            if shard_size is not None or only:
                raise InvalidInputError("--merge-lora cannot be combined with --shard-size or --only")
            from .lora import plan_merged

            outputs = plan_merged(self.store, commit)
        elif shard_size is not None:
            from .shards import parse_size, plan_shards

            outputs = plan_shards(self.store, commit, parse_size(shard_size), only)
        else:
            outputs = plan_outputs(self.store, commit, only)
        bar = progress(total_size(outputs), "checkout") if progress else None
        try:
            return write_outputs(self.store, outputs, Path(out_dir), force, bar.update if bar else None)
        finally:
            if bar:
                bar.close()

    def import_checkpoint(
        self, path: str | os.PathLike[str], *, recursive: bool = False, message: str | None = None,
        branch: str | None = None, delete_source: bool = False, metadata: Mapping[str, Any] | None = None,
    ) -> list[Any]:
        """Commit PyTorch pickle checkpoints safely (weights_only), one commit per file; see legacy.py."""
        return list(self.iter_import(path, recursive=recursive, message=message, branch=branch,
                                     delete_source=delete_source, metadata=metadata))

    def iter_import(
        self, path: str | os.PathLike[str], *, recursive: bool = False, message: str | None = None,
        branch: str | None = None, delete_source: bool = False, metadata: Mapping[str, Any] | None = None,
    ) -> Iterator[Any]:
        """Like ``import_checkpoint``, yielding each file's result as its commit lands."""
        from .legacy import import_checkpoints

        yield from import_checkpoints(self, path, recursive=recursive, message=message, branch=branch,
                                      delete_source=delete_source, metadata=metadata)

    def open(self, ref: str = "HEAD", *, path: str | None = None, framework: str | None = None) -> Any:
        """A lazy read-only mapping of the commit's tensors with safe_open-style slices; see partial.py."""
        from .partial import LazyTensors

        return LazyTensors(self, ref, path, framework)

    # ---- history and inspection ----------------------------------------------------------------

    def log(self, ref: str | None = None) -> list[LogEntry]:
        """Commits reachable from ``ref`` (default HEAD), newest first."""
        return history.log(self, ref)

    def show(self, ref: str = "HEAD") -> tuple[ObjectId, Commit]:
        oid = self.resolve(ref)
        return oid, self.read_commit(oid)

    def from_base(self, ref: str) -> set[tuple[str, str | None]]:
        """(path, tensor) pairs of an overlay commit that are identical to its base's; empty otherwise."""
        commit = self.read_commit(self.resolve(ref))
        if commit.base is None:
            return set()
        from .overlay import from_base

        return from_base(commit, self.read_commit(commit.base["commit"]))  # type: ignore[arg-type]

    def read_file(self, oid: str, path: str) -> bytes:
        """The bytes of one (small) committed file, verified; for sidecars and configs."""
        for f in self.read_commit(oid).files:
            if f.path == path:
                return b"".join(self.store.get_chunk(c.id, c.size, f" (file {path!r})") for c in f.all_chunks())
        raise RefNotFoundError(f"commit {oid[:12]} has no file {path!r}")

    def state_document(self, ref: str) -> Any:
        """The typed-JSON non-tensor part of a training-state commit (tensors appear as $tensor)."""
        oid = self.resolve(ref)
        state = self.read_commit(oid).state
        if state is None:
            raise InvalidInputError(f"commit {oid[:12]} holds files, not a training state")
        doc = parse_json(self.read_file(oid, state["values"]))
        if not isinstance(doc, dict) or "value" not in doc:
            raise IntegrityError(f"commit {oid[:12]}: malformed state document")
        return doc["value"]

    def diff(self, a: str, b: str) -> list[TensorChange]:
        """Per tensor (and per plain file): added, removed, changed or unchanged from ``a`` to ``b``."""
        return history.diff(self, a, b)

    def reachable_commits(self) -> list[ObjectId]:
        """Every commit reachable from a branch or tag, walking through pruned commits' parents."""
        pruned = self.pruned()
        todo = [*self.branches().values(), *self.tags().values()]
        seen: set[ObjectId] = set()
        while todo:
            oid = todo.pop()
            if oid in seen:
                continue
            seen.add(oid)
            todo.extend(pruned[oid] if oid in pruned else self.read_commit(oid).parents)
        return sorted(oid for oid in seen if oid not in pruned)

    def stats(self) -> Stats:
        """Logical bytes over all commits, bytes stored, and counts."""
        return history.stats(self)

    def gc(
        self, *, keep_last: int | None = None, keep_best: int | None = None, metric: str | None = None,
        maximize: bool = False, keep_every: int | None = None, dry_run: bool = False, repack: bool = False,
    ) -> GcReport:
        """Delete commits outside the retention policy (if any) and every object no kept commit needs.

        With ``repack``, kept objects are re-encoded first (newest commits whole, older ones deltas).
        """
        policy = RetentionPolicy(keep_last, keep_best, metric, maximize, keep_every)
        return collect_garbage(self, policy, dry_run=dry_run, repack=repack)

    def best(self, metric: str, mode: str = "min", branch: str | None = None) -> ObjectId:
        """The commit with the best ``metric`` in its metadata (``mode`` "min" or "max")."""
        return best(self, metric, mode, branch)

    def fsck(self, read_data: bool = False) -> list[str]:
        from .fsck import check

        return check(self, read_data=read_data)
