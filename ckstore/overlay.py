"""Overlays: commits recorded on top of a base commit, in this repository or in another one.

An overlay manifest is complete (every file, every tensor), so checkout needs nothing special;
what makes it cheap is content addressing: a tensor identical to the base has the base's chunk
names and costs nothing, and with ``--base-repo`` those chunks stay in the base repository, whose
store this one reads through (``alternates``, as git's objects/info/alternates). The base
repository lists its overlays in ``dependents`` so its gc keeps what they need.
"""

from __future__ import annotations

import os

from .context import RepoContext, open_context
from .errors import CkstoreError, InvalidInputError, InvalidPathError
from .ids import ObjectId
from .links import ALTERNATES_KEY, DEPENDENTS_KEY, MAX_BASE_DEPTH, add_path, read_paths
from .manifest import BaseRef, Commit, FileEntry
from .positions import position_chunks


def link_base_repo(ctx: RepoContext, base: RepoContext) -> None:
    """Record ``base`` as an alternate of ``ctx`` and ``ctx`` as a dependent of ``base``."""
    here, there = ctx.location, base.location
    if here == there:
        return
    if here in _all_alternates(base):
        raise InvalidInputError(f"{there} already uses {here} as a base: overlays cannot form a cycle")
    add_path(base.backend, DEPENDENTS_KEY, here)
    add_path(ctx.backend, ALTERNATES_KEY, there)
    ctx.add_base(base)


def resolve_base(ctx: RepoContext, base: str | None, base_repo: str | os.PathLike[str] | None) -> BaseRef | None:
    """An overlay's base commit; a base in another repository becomes an alternate of this one."""
    if base_repo is None:
        return None if base is None else BaseRef(ctx.graph.resolve(base), None)
    other = open_context(base_repo)
    oid = other.graph.resolve(base or "HEAD")
    link_base_repo(ctx, other)
    return BaseRef(oid, other.location)


def _all_alternates(ctx: RepoContext, depth: int = 0) -> set[str]:
    if depth > MAX_BASE_DEPTH:
        return set()
    out = set()
    for path in read_paths(ctx.backend, ALTERNATES_KEY):
        out.add(path)
        try:
            out |= _all_alternates(open_context(path, open_alternates=False), depth + 1)
        except CkstoreError:
            continue
    return out


def merge_files(base: Commit, new: list[FileEntry]) -> list[FileEntry]:
    """The overlay's complete file list: the new files, plus every base file they do not replace."""
    by_path = {f.path: f for f in base.files}
    for f in new:
        by_path[f.path] = f
    merged = sorted(by_path.values(), key=lambda f: f.path)
    paths = {f.path for f in merged}
    for path in paths:
        parts = path.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in paths:
                raise InvalidPathError(f"overlay file {path!r} lies below the base's file {'/'.join(parts[:i])!r}")
    return merged


def from_base(commit: Commit, base: Commit) -> set[tuple[str, str | None]]:
    """(path, tensor) pairs of ``commit`` that are byte-identical to the base's (None: whole file)."""
    old = {(f.path, None): tuple(c.id for c in f.all_chunks()) for f in base.files}
    old.update((pos, tuple(c.id for c in chunks)) for pos, chunks in position_chunks(base.files, header=False).items()
               if pos[1] is not None)
    same = set()
    for f in commit.files:
        if old.get((f.path, None)) == tuple(c.id for c in f.all_chunks()):
            same.add((f.path, None))
        for t in f.tensors:
            if old.get((f.path, t.name)) == tuple(c.id for c in t.chunks):
                same.add((f.path, t.name))
    return same


def external_needs(ctx: RepoContext, seen: set[str] | None = None) -> tuple[set[ObjectId], set[str]]:
    """Commits and objects that overlay repositories (dependents, recursively) need from ``ctx``."""
    seen = seen if seen is not None else {ctx.location} if ctx.path else set()
    commits: set[ObjectId] = set()
    chunks: set[str] = set()
    for path in read_paths(ctx.backend, DEPENDENTS_KEY):
        if path in seen:
            continue
        seen.add(path)
        try:
            dependent = open_context(path)
        except CkstoreError:
            continue  # a deleted overlay repository needs nothing any more
        # What the dependent's own gc may keep: commits its refs or reflogs reach plus,
        # transitively, the in-repository bases of its overlays ...
        mine: set[str] = set()
        for oid in dependent.graph.with_overlay_bases(dependent.graph.live_commits()):
            commit = dependent.graph.read_commit(oid)
            mine.update(c.id for c in commit.all_chunks())
            if commit.base is not None and commit.base.repo is not None:
                commits.add(commit.base.commit)
        # ... and the delta bases of its chunks, followed through its alternates: a chunk of a
        # plain commit may be a delta of a pruned overlay's chunk, itself a delta of ours.
        chunks |= dependent.store.with_delta_bases(mine)
        more_commits, more_chunks = external_needs(dependent, seen)
        commits |= more_commits
        chunks |= more_chunks
    return commits, chunks
