"""The change record: a commit's relative change against its first parent, per tensor, kept in
an optional cache file beside the objects (format.md 5.2).

A manifest is immutable and commit does not read the parent's bytes, so it records no change
for a changed tensor. Compaction decodes the parent's and the child's chunk of most changed
pairs anyway, and adds up ‖new − old‖² and ‖old‖² for them; readers (diff, report) that find a
tensor here skip reading it, and write back what they had to compute. Every entry names the
chunks it was computed from (a digest of both tensors' chunk ids), so an entry is used only
for the very bytes it describes: a stale, foreign or damaged record costs a recomputation,
never a wrong figure.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Container, Mapping

from ckstore.backend.base import Backend
from ckstore.errors import CkstoreError
from ckstore.format.manifest import Commit, TensorEntry

FOLDER = "cache/change"
MARK = "change record"
VERSION = 1

TensorKey = tuple[str, str]  # (file path, tensor name)
Sums = tuple[float, float]  # (‖new − old‖², ‖old‖²)


def record_key(commit_id: str, parent_id: str) -> str:
    return f"{FOLDER}/{commit_id}-{parent_id}.json"


def chunks_digest(new: TensorEntry, old: TensorEntry) -> str:
    """What an entry was computed from: both tensors' dtype, shape and chunk ids."""
    text = "\n".join(
        [
            new.dtype,
            repr(tuple(new.shape)),
            *(c.id for c in new.chunks),
            "",
            old.dtype,
            repr(tuple(old.shape)),
            *(c.id for c in old.chunks),
        ]
    )
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def comparable(commit: Commit, parent: Commit) -> dict[TensorKey, tuple[TensorEntry, TensorEntry]]:
    """The tensors whose change the record may hold: same path and name in both commits, same
    dtype and shape, and not all of their chunks shared (the manifest records those as 0)."""
    from ckstore.format.tensor_stats import NUMERIC_DTYPES

    before = {(f.path, t.name): t for f in parent.files for t in f.tensors}
    out = {}
    for f in commit.files:
        for t in f.tensors:
            old = before.get((f.path, t.name))
            if (
                old is not None
                and old.dtype == t.dtype
                and tuple(old.shape) == tuple(t.shape)
                and t.dtype in NUMERIC_DTYPES
                and [c.id for c in old.chunks] != [c.id for c in t.chunks]
            ):
                out[(f.path, t.name)] = (t, old)
    return out


def read_changes(
    backend: Backend, commit_id: str, commit: Commit, parent_id: str, parent: Commit
) -> dict[TensorKey, Sums]:
    """The record's sums for the tensors it describes correctly; empty when there is no record
    or it cannot be read. Entries that disagree with the two manifests are left out."""
    try:
        document = json.loads(backend.get(record_key(commit_id, parent_id)))
    except (KeyError, CkstoreError, OSError, ValueError):
        return {}
    if (
        not isinstance(document, dict)
        or document.get("ckstore") != MARK
        or document.get("version") != VERSION
        or document.get("commit") != commit_id
        or document.get("parent") != parent_id
        or not isinstance(document.get("tensors"), list)
    ):
        return {}
    pairs = comparable(commit, parent)
    out: dict[TensorKey, Sums] = {}
    for entry in document["tensors"]:
        try:
            key = (entry["path"], entry["name"])
            sums = (entry["diff_sq"], entry["base_sq"])
            digest = entry["chunks"]
        except (KeyError, TypeError):
            continue
        if (
            key in pairs
            and digest == chunks_digest(*pairs[key])
            and all(isinstance(x, float) and math.isfinite(x) and x >= 0 for x in sums)
        ):
            out[key] = (float(sums[0]), float(sums[1]))
    return out


def write_changes(
    backend: Backend, commit_id: str, commit: Commit, parent_id: str, parent: Commit, sums: Mapping[TensorKey, Sums]
) -> None:
    """Add ``sums`` (finite ones, for tensors ``comparable`` names) to the record, keeping the
    valid entries it has; written whole and atomically. A cache: failing to write it is not an
    error (a read-only repository, a full disk), the figures are computed again next time."""
    pairs = comparable(commit, parent)
    fresh = {k: s for k, s in sums.items() if k in pairs and all(math.isfinite(x) and x >= 0 for x in s)}
    known = read_changes(backend, commit_id, commit, parent_id, parent)
    if not fresh or all(known.get(k) == s for k, s in fresh.items()):
        return
    merged = {**known, **fresh}
    document = {
        "ckstore": MARK,
        "version": VERSION,
        "commit": commit_id,
        "parent": parent_id,
        "tensors": [
            {
                "path": k[0],
                "name": k[1],
                "chunks": chunks_digest(*pairs[k]),
                "diff_sq": float(s[0]),
                "base_sq": float(s[1]),
            }
            for k, s in sorted(merged.items())
        ],
    }
    try:
        backend.replace(record_key(commit_id, parent_id), json.dumps(document, separators=(",", ":")).encode())
    except (CkstoreError, OSError):
        pass


def change_from_sums(sums: Sums) -> float:
    """‖new − old‖ / ‖old‖ as relative_l2 computes it (inf when the parent is all zeros)."""
    diff_sq, base_sq = sums
    if base_sq == 0.0:
        return 0.0 if diff_sq == 0.0 else math.inf
    return math.sqrt(diff_sq / base_sq)


def prune_records(backend: Backend, kept: Container[str]) -> int:
    """Delete the records of commits not in ``kept`` (gc, after deleting them); how many."""
    gone = 0
    for key in list(backend.list(FOLDER + "/")):
        commit = key.rsplit("/", 1)[-1].split("-", 1)[0]
        if commit not in kept and backend.delete(key):
            gone += 1
    return gone
