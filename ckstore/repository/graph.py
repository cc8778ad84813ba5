"""The commit graph: reading commits, resolving revisions, walking history, the pruned set.

Every operation (log, gc, fsck, repack, checkout…) needs these; they sit here, on top of the
object store and refs and below every operation, so no operation has to reach up into the
``Repo`` façade for them.

History through pruned commits: gc deletes commits that retention drops but records each one
that kept commits still reach in ``pruned``, with its own parents (docs/format.md). Every walk
of history goes through ``kept_parents``, which steps over those records to the older commits gc
kept, so log, reachability and fsck agree on what history is.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence

from ckstore.backend.base import Backend
from ckstore.codecs.objects import Kind
from ckstore.errors import (
    AmbiguousRefError,
    CkstoreError,
    IntegrityError,
    InvalidInputError,
    RefNotFoundError,
)
from ckstore.format.ids import ObjectId, is_id_prefix, is_object_id
from ckstore.format.manifest import ChunkReader, Commit, ManifestFiles, decode_commit
from ckstore.format.pruned import encode_pruned, parse_pruned
from ckstore.repository.reader import bounded_file_list_reader
from ckstore.repository.reflog import HEAD_LOG, Entry, head_view, nth_value
from ckstore.repository.refs import HEAD, HEADS, REFS, REMOTES, TAGS, RefStore, ref_candidates
from ckstore.repository.sources import NameSource
from ckstore.repository.store import ObjectStore

PRUNED_KEY = "pruned"
ROOT_PREFIXES = (HEADS, TAGS, REMOTES)  # the refs whose commits gc keeps and fsck walks
_SUFFIX = re.compile(r"~(\d*)$|\^1?$")  # "^1": the first parent, as "^"
_REFLOG_SUFFIX = re.compile(r"(.*)@\{(\d+)\}")

Pruned = Mapping[ObjectId, tuple[ObjectId, ...]]


def kept_parents(parents: Iterable[ObjectId], pruned: Pruned) -> Iterator[ObjectId]:
    """``parents`` with every pruned commit replaced, recursively, by its own parents: the
    commits that history continues with. Each is yielded once."""
    todo = list(parents)
    seen: set[ObjectId] = set()
    while todo:
        oid = todo.pop(0)
        if oid in seen:
            continue
        seen.add(oid)
        if oid in pruned:
            todo.extend(pruned[oid])
        else:
            yield oid


def _check_suffix(spec: str, base: str) -> None:
    """Refuse what is left of a ``~``/``^`` suffix that did not parse, saying what is wrong with
    it (no name may hold either character, so it can only be a suffix)."""
    at = min((i for i in (base.find("~"), base.find("^")) if i >= 0), default=-1)
    if at < 0:
        return
    if re.fullmatch(r"\^\d+", base[at:]):
        raise InvalidInputError(
            f"invalid revision {spec!r}: '^N' (a merge's N-th parent) is not supported; ckstore records no"
            " merges, and '~N' goes N first parents back"
        )
    raise InvalidInputError(
        f"invalid revision {spec!r}: '~' and '^' take a number of commits ('HEAD~3', 'HEAD^', 'HEAD~')"
    )


class CommitGraph:
    """Commits of one repository (and, for resolving names, of its base repositories)."""

    def __init__(self, backend: Backend, store: ObjectStore, refs: RefStore) -> None:
        self.backend = backend
        self.store = store
        self.refs = refs
        # Asked in order for names this graph does not know (sources.py: base repositories' graphs,
        # so an overlay names its base's commits; a remote's refs).
        self.name_sources: list[NameSource] = []
        self.cache: dict[str, Commit] = {}

    # ---- commits ---------------------------------------------------------------------------

    def read_commit(self, oid: str, files: bool = True) -> Commit:
        """The commit ``oid``, every field validated. ``files=False``: its file entries are
        validated on first use instead (log, status: they read the header of big manifests)."""
        commit = self.cache.get(oid)
        if commit is None:
            data = self.store.get_commit(oid)  # its errors already name the commit
            try:
                commit = decode_commit(
                    data, lazy_files=None if files else f"commit {oid}", read=self.file_list_reader(oid)
                )
            except IntegrityError as exc:
                raise IntegrityError(f"commit {oid}: {exc}") from None
            self.cache[oid] = commit
        if files and isinstance(commit.files, ManifestFiles):
            commit.files.load()  # a damaged entry is refused here, as if parsed whole
        return commit

    def file_list_reader(self, oid: str) -> ChunkReader:
        """How commit ``oid``'s file list is read when stored apart (format.md 5.3): verified
        chunks of this store (or a base repository's)."""
        context = f" (file list of commit {oid})"
        return bounded_file_list_reader(
            lambda piece: self.store.read_stored(piece, None, context), self.store.reader(), context
        )

    def remember(self, oid: str, commit: Commit) -> None:
        self.cache[oid] = commit

    def is_commit(self, oid: str) -> bool:
        try:
            return self.store.kind(oid) == Kind.COMMIT
        except IntegrityError:
            return False

    # ---- names -----------------------------------------------------------------------------

    def head_branch(self) -> str:
        return self.refs.head_branch()

    def resolve(self, spec: str) -> ObjectId:
        """A commit id from a full id, unique prefix (6+), branch, tag, HEAD, ``NAME@{n}`` (the
        value NAME had n changes ago, by its reflog; ``@{n}``: the current branch's), or any of
        these + ``~N``/``^``."""
        if not isinstance(spec, str) or not spec:
            raise InvalidInputError("empty revision")
        base, steps = spec, 0
        while (m := _SUFFIX.search(base)) and m.start() > 0:
            steps += int(m.group(1)) if m.group(1) else 1
            base = base[: m.start()]
        _check_suffix(spec, base)
        at = _REFLOG_SUFFIX.fullmatch(base)
        oid = self._resolve_reflog(spec, at.group(1), int(at.group(2))) if at else self.resolve_name(base)
        for _ in range(steps):
            parents = self.read_commit(oid, files=False).parents
            if not parents:
                raise RefNotFoundError(f"{spec}: history of {base!r} is shorter than that")
            if parents[0] in self.pruned():
                raise RefNotFoundError(f"{spec}: commit {parents[0][:12]} was pruned by gc")
            oid = parents[0]
        return oid

    def resolve_name(self, name: str) -> ObjectId:
        """Resolve here first, then through the name sources (an overlay may name its base's
        commits); a ``sources.NameSource`` itself, so a graph is its overlays' source."""
        try:
            return self._resolve_name(name)
        except RefNotFoundError:
            if name == "HEAD":
                raise
            for source in self.name_sources:
                try:
                    return source.resolve_name(name)
                except RefNotFoundError:
                    continue
            raise

    def _resolve_name(self, name: str) -> ObjectId:
        if name == "HEAD":
            branch = self.head_branch()
            oid = self.refs.read(HEADS + branch)
            if oid is None:
                raise RefNotFoundError(f"HEAD: branch {branch!r} has no commits yet")
            return oid
        if is_object_id(name) and self.store.has(name) and self.is_commit(name):
            return ObjectId(name)
        for ref in ref_candidates(name):
            oid = self.refs.read(ref)
            if oid is not None:
                return oid
        if "/" in name and not name.startswith(REFS):  # NAME/BRANCH: a remote-tracking ref
            oid = self.refs.read(REMOTES + name)
            if oid is not None:
                return oid
        if is_id_prefix(name):
            matches = [oid for oid in self.store.iter_ids(name) if self.is_commit(oid)]
            if len(matches) > 1:
                raise AmbiguousRefError(f"commit id prefix {name!r} matches {len(matches)} commits; give more digits")
            if matches:
                return matches[0]
        raise RefNotFoundError(f"unknown revision {name!r} (not a branch, tag or commit id)")

    # ---- reflogs ----------------------------------------------------------------------------

    def reflog(self, name: str) -> tuple[str, list[Entry]]:
        """The reflog ``name`` means (a branch, tag — deleted ones too —, full ref name or HEAD)
        as (its short name, entries newest first)."""
        if name == HEAD:
            logs = self.refs.logs
            branches = {ref[len(HEADS) :]: logs.read(ref) for ref in logs.refs() if ref.startswith(HEADS)}
            return HEAD, head_view(logs.read(HEAD_LOG), branches, self.head_branch())
        candidates = ref_candidates(name)
        for ref in candidates:
            entries = self.refs.logs.read(ref)
            if entries:
                return _short_name(ref), entries[::-1]
        for ref in candidates:
            if self.refs.read(ref) is not None:
                return _short_name(ref), []  # made before the reflog, or its entries expired
        raise RefNotFoundError(f"no reflog for {name!r} (not a branch or tag that ever changed here)")

    def reflog_all(self) -> list[tuple[str, Entry]]:
        """Every ref's entries with their ``name@{n}`` selector, newest first."""
        out: list[tuple[str, Entry]] = []
        for ref in self.refs.logs.refs():
            name, entries = self.reflog(HEAD if ref == HEAD_LOG else ref)
            # HEAD's view also holds branch entries: each is listed once, under its own ref.
            out.extend((f"{name}@{{{n}}}", e) for n, e in enumerate(entries) if e.ref == ref)
        return sorted(out, key=lambda pair: -pair[1].time)

    def _resolve_reflog(self, spec: str, name: str, n: int) -> ObjectId:
        short, entries = self.reflog(name or self.head_branch())
        oid = nth_value(entries, n, spec, short)
        if not (self.store.has(oid) and self.is_commit(oid)):
            raise RefNotFoundError(f"{spec}: commit {oid[:12]} no longer exists (gc deleted it)")
        return oid

    # ---- pruned history --------------------------------------------------------------------

    def pruned(self) -> dict[ObjectId, tuple[ObjectId, ...]]:
        """Commits gc deleted on purpose, each with its parents (so history stays connected
        through it to older kept commits); log shows them as pruned and fsck accepts them."""
        try:
            data = self.backend.get(PRUNED_KEY)
        except KeyError:
            return {}
        return parse_pruned(data, self.backend.describe(PRUNED_KEY))

    def write_pruned(self, pruned: Mapping[ObjectId, Sequence[str]]) -> None:
        self.backend.replace(PRUNED_KEY, encode_pruned(pruned))

    def pruned_after(self, keep: set[ObjectId], reachable: set[ObjectId]) -> dict[ObjectId, tuple[ObjectId, ...]]:
        """The ``pruned`` record once every reachable commit outside ``keep`` is deleted: each
        deleted commit that a kept commit still reaches, with its own parents."""
        graph = dict(self.pruned())
        for oid in reachable - keep:
            graph[oid] = self.read_commit(oid, files=False).parents
        out: dict[ObjectId, tuple[ObjectId, ...]] = {}
        todo = [p for oid in keep for p in self.read_commit(oid, files=False).parents]
        while todo:
            oid = todo.pop()
            if oid in graph and oid not in out:
                out[oid] = graph[oid]
                todo.extend(graph[oid])
        return out

    # ---- reachability ----------------------------------------------------------------------

    def tips(self) -> list[ObjectId]:
        """What gc and fsck start from: branches, tags and, as in git, remote-tracking refs (the
        local copy of a fetched commit is kept until the remote branch is gone or moved on)."""
        return [oid for prefix in ROOT_PREFIXES for oid in self.refs.list(prefix).values()]

    def reachable_commits(self) -> list[ObjectId]:
        """Every commit reachable from a ref (``tips``), walking through pruned commits' parents."""
        return sorted(self.reachable_from(self.tips()))

    def reflog_commits(self) -> set[ObjectId]:
        """Every commit that some reflog entry names and that still exists (expired or not)."""
        named = {i for entries in self.refs.logs.read_all().values() for e in entries for i in e.ids}
        return {oid for oid in named if self.store.has(oid)}

    def live_commits(self) -> set[ObjectId]:
        """What this repository's gc may keep: commits reachable from a ref or a reflog entry."""
        return self.reachable_from([*self.tips(), *self.reflog_commits()])

    def reachable_from(self, starts: Iterable[ObjectId]) -> set[ObjectId]:
        """``starts`` and their history, walking through pruned commits' parents. A start that
        is here is never "pruned" (a ref's value: a remote's pruned record may list a commit that
        a push named again after that remote's gc pruned it, docs/format.md 15.6)."""
        return set(self.walk(starts))

    def walk(self, starts: Iterable[ObjectId]) -> Iterator[ObjectId]:
        """``reachable_from``, one commit at a time (each once, nearest to ``starts`` first
        along each line), so a caller may stop early."""
        pruned = self.pruned()
        starts = list(starts)
        todo = [s for s in starts if s not in pruned or self.store.has(s)]
        todo += kept_parents([s for s in starts if s in pruned and not self.store.has(s)], pruned)
        seen: set[ObjectId] = set()
        while todo:
            oid = todo.pop()
            if oid in seen:
                continue
            seen.add(oid)
            yield oid
            todo.extend(kept_parents(self.read_commit(oid, files=False).parents, pruned))

    def reaches(self, start: ObjectId, target: ObjectId) -> bool:
        """Whether ``target`` is ``start`` or in its history, pruned commits included: a commit
        that gc deleted here still counts as an ancestor through the pruned record, so a remote
        branch left at it (a push killed before its tracking ref moved) still fast-forwards. The
        walk stops where it finds ``target``, so a fast-forward check costs the commits between."""
        pruned = self.pruned()
        todo, seen = [start], set()
        while todo:
            oid = todo.pop()
            if oid == target:
                return True
            if oid in seen:
                continue
            seen.add(oid)
            if oid in pruned and not self.store.has(oid):
                todo.extend(pruned[oid])
            elif self.store.has(oid):
                todo.extend(self.read_commit(oid, files=False).parents)
        return False

    def with_overlay_bases(self, keep: Iterable[ObjectId]) -> set[ObjectId]:
        """``keep`` plus the base commit (in this repository) of every kept overlay, transitively."""
        out = set(keep)
        todo = list(out)
        while todo:
            base = self.read_commit(todo.pop(), files=False).base
            if base is not None and base.repo is None and base.commit not in out:
                out.add(base.commit)
                todo.append(base.commit)
        return out

    def first_parents(self, start: ObjectId | None, limit: int) -> list[Commit]:
        """Up to ``limit`` commits from ``start`` back along first parents; stops early at a
        commit that cannot be read (pruned or damaged)."""
        out: list[Commit] = []
        oid = start
        while oid is not None and len(out) < limit:
            try:
                commit = self.read_commit(oid)
            except CkstoreError:
                break
            out.append(commit)
            oid = commit.parents[0] if commit.parents else None
        return out


def _short_name(ref: str) -> str:
    for prefix in (HEADS, TAGS):
        if ref.startswith(prefix):
            return ref[len(prefix) :]
    return ref
