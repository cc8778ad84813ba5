"""``ckstore diff REF FOLDER``: a commit against files on disk (git's ``diff COMMIT -- PATH``).

The folder is described the way commit would record it (write/ingest.py, same chunk size), but
its chunks are only hashed, never stored; history's diff then compares the two manifests. The
relative change of a changed tensor reads the folder's bytes back from the files.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ckstore.errors import InvalidInputError, StorageError
from ckstore.format.ids import ObjectId, chunk_id
from ckstore.format.manifest import Commit, FileEntry
from ckstore.history.log import Diff, diff_commits
from ckstore.repository.context import RepoContext
from ckstore.repository.store import PutResult
from ckstore.write.ingest import SourceFile, collect_sources, ingest


class _HashingStore:
    """What ingest writes to: names each chunk and keeps nothing."""

    def put_chunk(
        self,
        raw: bytes | memoryview,
        width: int = 1,
        base_id: str | None = None,
        fast: bool = False,
        oid: str | None = None,
    ) -> PutResult:
        return PutResult(ObjectId(oid) if oid else chunk_id(raw), 0)


class _FolderChunks:
    """The repository's store, plus the folder's chunks read back from their files by position."""

    def __init__(self, ctx: RepoContext, where: dict[str, tuple[Path, int]]) -> None:
        self._store = ctx.store
        self._where = where

    def get_chunk(self, oid: str, size: int, context: str = "") -> bytes:
        if oid not in self._where:
            return self._store.get_chunk(oid, size, context)
        path, offset = self._where[oid]
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read(size)
        except OSError as exc:
            raise StorageError(f"cannot read {path}: {exc.strerror}") from None
        if chunk_id(data) != oid:
            raise InvalidInputError(f"{path} changed while being compared")
        return data

    def stored_size(self, oid: str) -> int | None:
        return None if oid in self._where else self._store.stored_size(oid)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def _positions(files: list[FileEntry], sources: dict[str, Path]) -> dict[str, tuple[Path, int]]:
    """Each chunk's file and offset: a file is its header's chunks, then its tensors' (format.md 5)."""
    out: dict[str, tuple[Path, int]] = {}
    for f in files:
        offset = 0
        for c in f.all_chunks():
            out.setdefault(c.id, (sources[f.path], offset))
            offset += c.size
    return out


FOLDER = ObjectId("0" * 64)  # the id a diff reports for the folder side


def diff_folder(ctx: RepoContext, ref: str, folder: str | os.PathLike[str]) -> Diff:
    """Per tensor and file: what changed from commit ``ref`` to the files under ``folder``, as a
    commit of that folder would record them (its "new" bytes are 0: nothing of it is stored)."""
    root = Path(folder)
    if not root.is_dir():
        raise InvalidInputError(f"{root} is not a directory: diff REF FOLDER compares a commit with a folder")
    a_id = ctx.graph.resolve(ref)
    old = ctx.graph.read_commit(a_id)
    sources: list[SourceFile] = collect_sources([root], ctx.path or Path("/nonexistent"), raw=True)
    # Stand-ins with the one method each caller uses: hashing without storing (put), chunks
    # from the folder or the repository (get_chunk).
    files, _ = ingest(_HashingStore(), sources, ctx.config.chunk_size)  # type: ignore[arg-type]
    new = Commit(parents=(a_id,), time=old.time, message="", branch="", files=tuple(files))
    chunks = _FolderChunks(ctx, _positions(files, {s.path: s.source for s in sources}))
    return diff_commits(chunks, a_id, old, FOLDER, new)  # type: ignore[arg-type]  # the folder stand-in
