"""The pruned-commits record (pure): commits gc deleted on purpose, each with its parents.

One line per pruned commit, ``<commit id> <parent id>...`` (docs/format.md, "pruned"), sorted
by commit id, ASCII. The same text is kept by a local repository (``pruned``) and by a remote
(``gc/pruned``), so history stays connected through a pruned commit to older kept ones on both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ckstore.errors import IntegrityError
from ckstore.format.ids import ObjectId, is_object_id

Pruned = dict[ObjectId, tuple[ObjectId, ...]]


def parse_pruned(data: bytes, where: str) -> Pruned:
    """The record's commits and their parents; IntegrityError naming ``where`` on any line that
    is not ids separated by single spaces."""
    out: Pruned = {}
    for line in data.decode("ascii", "replace").splitlines():
        ids = line.split(" ")
        if not all(is_object_id(i) for i in ids):
            raise IntegrityError(f"{where} is corrupt")
        out[ObjectId(ids[0])] = tuple(ObjectId(i) for i in ids[1:])
    return out


def encode_pruned(pruned: Mapping[ObjectId, Sequence[str]]) -> bytes:
    """The record's text, one sorted line per commit."""
    return "".join(" ".join([oid, *pruned[oid]]) + "\n" for oid in sorted(pruned)).encode()


__all__ = ["Pruned", "encode_pruned", "parse_pruned"]
