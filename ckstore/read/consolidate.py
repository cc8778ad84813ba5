"""Checkout of a distributed checkpoint: the full tensors as plain safetensors (no torch).

Each global tensor is assembled from its pieces. When the pieces are whole rows laid end to end
(FSDP's and most data-parallel sharding: split on the first dimension only, or not split at all),
the full tensor's bytes are the pieces' stored chunks in row order, streamed and verified like
any checkout. Otherwise (a split on another dimension, tensor parallelism) the tensor is put
together in memory from its pieces, one tensor at a time, when its turn to be written comes.
The output is one ``model.safetensors`` or, with a shard size, Hugging Face shards and their
index (shards.py), tensors under their fully qualified names in name order.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Sequence

from ckstore.errors import InvalidInputError
from ckstore.format.dcp_record import DcpPiece, DcpTensor
from ckstore.format.dtypes import TORCH_DTYPES
from ckstore.format.manifest import ChunkRef, Commit, FileEntry
from ckstore.format.safetensors import emit_header
from ckstore.read.checkout import Output, Piece
from ckstore.read.shards import DEFAULT_METADATA, INDEX_NAME, index_document, shard_names, split_into_shards
from ckstore.repository.filedata import file_context
from ckstore.repository.store import ObjectStore

Stored = dict[tuple[str, str], tuple[FileEntry, tuple[ChunkRef, ...]]]  # (file, tensor) -> its chunks


def _stored(commit: Commit) -> Stored:
    return {(f.path, t.name): (f, t.chunks) for f in commit.files for t in f.tensors}


def _distinct(t: DcpTensor) -> list[DcpPiece]:
    """One piece per region (a piece several ranks wrote counts once), empty pieces left out."""
    seen: dict[tuple[int, ...], DcpPiece] = {}
    for p in t.pieces:
        if p.numel:
            seen.setdefault(p.offsets, p)
    return sorted(seen.values(), key=lambda p: p.offsets)


def _row_pieces(t: DcpTensor, pieces: list[DcpPiece]) -> bool:
    """True when the pieces are whole rows that tile the tensor in order."""
    if not t.shape:
        return len(pieces) == 1
    row = 0
    for p in pieces:
        if p.offsets[0] != row or tuple(p.offsets[1:]) != (0,) * (len(t.shape) - 1) or p.sizes[1:] != t.shape[1:]:
            return False
        row += p.sizes[0]
    return row == t.shape[0] or math.prod(t.shape) == 0


def _assemble(store: ObjectStore, t: DcpTensor, pieces: list[DcpPiece], stored: Stored) -> Callable[[], bytes]:
    width = TORCH_DTYPES[t.dtype][0] // 8

    def build() -> bytes:
        import numpy as np  # here, not at import: reading commands (show, log) must not load numpy

        # Bytes as a uint8 array whose last dimension is widened by the element size, so any
        # dtype is copied exactly without interpreting it.
        out = np.zeros((*t.shape[:-1], t.shape[-1] * width) if t.shape else (width,), dtype=np.uint8)
        for p in pieces:
            f, chunks = stored[(p.file, p.tensor)]
            context = file_context(f.path, p.tensor)
            raw = b"".join(store.get_chunk(c.id, c.size, context) for c in chunks)
            block = np.frombuffer(raw, dtype=np.uint8).reshape((*p.sizes[:-1], p.sizes[-1] * width))
            index = tuple(slice(o, o + s) for o, s in zip(p.offsets[:-1], p.sizes[:-1]))
            index += (slice(p.offsets[-1] * width, (p.offsets[-1] + p.sizes[-1]) * width),)
            out[index] = block
        return out.tobytes()

    return build


def _tensor_pieces(store: ObjectStore, stored: Stored, t: DcpTensor) -> list[tuple[Piece, str]]:
    pieces = _distinct(t)
    if _row_pieces(t, pieces):
        out: list[tuple[Piece, str]] = []
        for p in pieces:
            f, chunks = stored[(p.file, p.tensor)]
            out.extend((c, file_context(f.path, p.tensor)) for c in chunks)
        return out
    if not t.shape or sum(p.numel for p in pieces) < math.prod(t.shape):
        raise InvalidInputError(f"tensor {t.fqn!r}: its pieces do not cover it")
    return [(_assemble(store, t, pieces, stored), "")]


def plan_consolidated(
    store: ObjectStore,
    commit: Commit,
    only: Sequence[str] | None = None,
    shard_size: int | None = None,
) -> list[Output]:
    """Outputs for a checkout of a DCP commit (see the module docstring)."""
    assert commit.dcp is not None
    tensors = [t for t in commit.dcp.tensors if not only or any(fnmatch.fnmatchcase(t.fqn, p) for p in only)]
    if not tensors:
        raise InvalidInputError("no tensor of the checkpoint matches" if only else "the checkpoint holds no tensors")
    codes: dict[str, str] = {}
    for t in tensors:
        code = TORCH_DTYPES[t.dtype][1]
        if code is None:
            raise InvalidInputError(
                f"tensor {t.fqn!r} has dtype {t.dtype}, which safetensors cannot store; leave it out with --only"
            )
        codes[t.dtype] = code
    groups = (
        split_into_shards([(t.fqn, t.nbytes) for t in tensors], shard_size)
        if shard_size
        else [[t.fqn for t in tensors]]
    )
    by_name = {t.fqn: t for t in tensors}
    stored = _stored(commit)
    outputs = []
    weight_map: dict[str, str] = {}
    for name, group in zip(shard_names(len(groups)), groups):
        entries = [by_name[n] for n in group]
        header, _ = emit_header([(t.fqn, codes[t.dtype], t.shape) for t in entries], DEFAULT_METADATA)
        pieces: list[tuple[Piece, str]] = [(header, "")]
        for t in entries:
            pieces.extend(_tensor_pieces(store, stored, t))
            weight_map[t.fqn] = name
        outputs.append(Output(name, tuple(pieces), len(header) + sum(t.nbytes for t in entries)))
    if len(groups) > 1:
        index = index_document(dict(sorted(weight_map.items())), sum(t.nbytes for t in tensors))
        outputs.append(Output(INDEX_NAME, ((index, ""),), len(index)))
    return outputs
