"""Overlays: commits recorded on top of a base commit, in this repository or in another one.

An overlay manifest is complete (every file, every tensor), so checkout needs nothing special;
what makes it cheap is content addressing: a tensor identical to the base has the base's chunk
names and costs nothing, and with ``--base-repo`` those chunks stay in the base repository, whose
store this one reads through (``alternates``, as git's objects/info/alternates). The base
repository lists its overlays in ``dependents`` so its gc keeps what they need.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .errors import CkstoreError, InvalidInputError, InvalidPathError
from .ids import ObjectId
from .manifest import Commit, FileEntry, TensorEntry

if TYPE_CHECKING:
    from .repo import Repo
    from .store import ObjectStore

ALTERNATES_KEY = "alternates"
DEPENDENTS_KEY = "dependents"
MAX_BASE_DEPTH = 16


def read_paths(repo: Repo, key: str) -> list[str]:
    try:
        text = repo.backend.get(key).decode("utf-8")
    except KeyError:
        return []
    except UnicodeDecodeError:
        return []
    return [line for line in text.splitlines() if line.strip()]


def _add_path(repo: Repo, key: str, path: str) -> None:
    paths = read_paths(repo, key)
    if path not in paths:
        repo.backend.replace(key, "".join(f"{p}\n" for p in [*paths, path]).encode())


def repo_location(repo: Repo) -> str:
    if repo.path is None:
        raise InvalidInputError("an in-memory repository cannot be a base repository")
    return str(Path(repo.path).resolve())


def link_base_repo(repo: Repo, base: Repo) -> None:
    """Record ``base`` as an alternate of ``repo`` and ``repo`` as a dependent of ``base``."""
    here, there = repo_location(repo), repo_location(base)
    if here == there:
        return
    if here in _all_alternates(base):
        raise InvalidInputError(f"{there} already uses {here} as a base: overlays cannot form a cycle")
    _add_path(base, DEPENDENTS_KEY, here)
    _add_path(repo, ALTERNATES_KEY, there)
    repo.store.alternates.append(base.store)


def _all_alternates(repo: Repo, depth: int = 0) -> set[str]:
    if depth > MAX_BASE_DEPTH:
        return set()
    out = set()
    for path in read_paths(repo, ALTERNATES_KEY):
        out.add(path)
        try:
            from .repo import Repo as _Repo

            out |= _all_alternates(_Repo(path, _open_alternates=False), depth + 1)
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
    old: dict[tuple[str, str | None], tuple[str, ...]] = {}
    for f in base.files:
        old[(f.path, None)] = tuple(c.id for c in f.all_chunks())
        for t in f.tensors:
            old[(f.path, t.name)] = tuple(c.id for c in t.chunks)
    same = set()
    for f in commit.files:
        if old.get((f.path, None)) == tuple(c.id for c in f.all_chunks()):
            same.add((f.path, None))
        for t in f.tensors:
            if old.get((f.path, t.name)) == tuple(c.id for c in t.chunks):
                same.add((f.path, t.name))
    return same


def delta_hints(base: Commit) -> dict[tuple[str, str], tuple[ObjectId, ...]]:
    """For each base tensor, its chunks: the delta-base candidates of the overlay's same tensor."""
    return {(f.path, t.name): tuple(c.id for c in t.chunks) for f in base.files for t in f.tensors}


def external_needs(repo: Repo, seen: set[str] | None = None) -> tuple[set[ObjectId], set[str]]:
    """Commits and objects that overlay repositories (dependents, recursively) need from ``repo``."""
    from .gc import _with_bases, with_bases
    from .repo import Repo as _Repo

    seen = seen if seen is not None else {repo_location(repo)} if repo.path else set()
    commits: set[ObjectId] = set()
    chunks: set[str] = set()
    for path in read_paths(repo, DEPENDENTS_KEY):
        if path in seen or not os.path.isdir(path):
            continue  # a deleted overlay repository needs nothing any more
        seen.add(path)
        try:
            dependent = _Repo(path)
        except CkstoreError:
            continue
        # What the dependent's own gc keeps: its reachable commits plus, transitively, the
        # in-repository bases of its overlays ...
        mine: set[str] = set()
        for oid in _with_bases(dependent, set(dependent.reachable_commits())):
            commit = dependent.read_commit(oid)
            mine.update(c.id for c in commit.all_chunks())
            if commit.base is not None and commit.base["repo"] is not None:
                commits.add(ObjectId(commit.base["commit"]))
        # ... and the delta bases of its chunks, followed through its alternates: a chunk of a
        # plain commit may be a delta of a pruned overlay's chunk, itself a delta of ours.
        chunks |= with_bases(dependent.store, mine)
        more_commits, more_chunks = external_needs(dependent, seen)
        commits |= more_commits
        chunks |= more_chunks
    return commits, chunks


# ---- change magnitude --------------------------------------------------------------------------

_FLOAT_VIEWS = {"F64": np.float64, "F32": np.float32, "F16": np.float16}
_INT_VIEWS = {"I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
              "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8}


def _as_float64(data: bytes, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return (np.frombuffer(data, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    view = _FLOAT_VIEWS.get(dtype) or _INT_VIEWS[dtype]
    return np.frombuffer(data, dtype=view).astype(np.float64)


def _aligned_pairs(store: ObjectStore, a: TensorEntry, b: TensorEntry, item: int) -> Iterator[tuple[bytes, bytes]]:
    """Equal-length, element-aligned byte blocks of two same-size tensors, one chunk at a time."""
    ia = (store.get_chunk(c.id, c.size) for c in a.chunks)
    ib = (store.get_chunk(c.id, c.size) for c in b.chunks)
    buf_a = buf_b = b""
    while True:
        if not buf_a:
            buf_a = next(ia, b"")
        if not buf_b:
            buf_b = next(ib, b"")
        if not buf_a or not buf_b:
            return
        n = min(len(buf_a), len(buf_b))
        n -= n % item
        if n == 0:  # a chunk boundary splits an element: join with the next chunk
            buf_a += next(ia, b"") if len(buf_a) < item else b""
            buf_b += next(ib, b"") if len(buf_b) < item else b""
            continue
        yield buf_a[:n], buf_b[:n]
        buf_a, buf_b = buf_a[n:], buf_b[n:]


def relative_l2(store: ObjectStore, a: TensorEntry, b: TensorEntry) -> float | None:
    """||b − a|| / ||a|| computed chunk by chunk; None where it is not defined for the dtype."""
    if a.dtype != b.dtype or a.shape != b.shape or (a.dtype not in _FLOAT_VIEWS and a.dtype not in _INT_VIEWS
                                                    and a.dtype != "BF16"):
        return None
    item = 2 if a.dtype == "BF16" else np.dtype(_FLOAT_VIEWS.get(a.dtype) or _INT_VIEWS[a.dtype]).itemsize
    diff_sq = base_sq = 0.0
    for block_a, block_b in _aligned_pairs(store, a, b, item):
        va, vb = _as_float64(block_a, a.dtype), _as_float64(block_b, b.dtype)
        diff_sq += float(np.sum((vb - va) ** 2))
        base_sq += float(np.sum(va**2))
    if base_sq == 0.0:
        return 0.0 if diff_sq == 0.0 else math.inf
    return math.sqrt(diff_sq / base_sq)
