"""DCP's ``Metadata`` <-> the manifest's ``dcp`` record (typed JSON, never pickle).

The writer's results say where each piece went (``StoredItem``); the coordinator turns DCP's
global ``Metadata`` plus those results into a ``DcpRecord``. A load rebuilds an equal
``Metadata`` from the record, so ``FileSystemReader``'s ``pickle.load`` of a ``.metadata`` file
has no counterpart here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ckstore.errors import IntegrityError, UnencodableValueError
from ckstore.format.dcp_record import DcpObject, DcpPiece, DcpRecord, DcpTensor
from ckstore.format.dtypes import TORCH_DTYPES
from ckstore.format.manifest import ChunkRef, TensorEntry
from ckstore.format.values import decode_value, encode_value


@dataclass(frozen=True)
class StoredItem:
    """What a rank reports for one written item (DCP gathers these to the coordinator)."""

    rank: int
    file: str
    entry: TensorEntry  # the item as stored in ``file``: chunks, safetensors dtype and shape
    encoding: str | None  # None: a tensor piece; else how a non-tensor item's bytes are encoded
    header: tuple[ChunkRef, ...]  # the header chunks of ``file`` (the same on every item of a rank)
    added: int  # bytes the rank added to the store (on its first item only, 0 on the others)


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in TORCH_DTYPES:
        raise UnencodableValueError(f"cannot store tensors of dtype {dtype} in a distributed checkpoint")
    return name


def _torch_attr(name: str, kind: type, what: str) -> Any:
    value = getattr(torch, name, None)
    if not isinstance(value, kind):
        raise IntegrityError(f"manifest: unknown {what} {name!r}")
    return value


def _memory_format_name(fmt: torch.memory_format) -> str:
    for name in ("contiguous_format", "channels_last", "preserve_format"):
        if fmt == getattr(torch, name):
            return name
    raise UnencodableValueError(f"cannot record memory format {fmt}")


def _extra(metadata: Metadata) -> Any:
    meta = metadata.storage_meta
    doc: dict[str, Any] = {
        "planner_data": metadata.planner_data,
        "storage_meta": None
        if meta is None
        else {
            "checkpoint_id": None if meta.checkpoint_id is None else str(meta.checkpoint_id),
            "save_id": meta.save_id,
            "load_id": meta.load_id,
            "modules": list(meta.modules),
        },
        "version": metadata.version,
    }
    try:
        return encode_value(doc)
    except UnencodableValueError as exc:
        raise UnencodableValueError(f"the planner's data cannot be recorded without pickle: {exc}") from None


def build_record(metadata: Metadata, results: Iterable[Iterable[Any]], world_size: int) -> DcpRecord:
    """The manifest record of a save: DCP's global metadata plus where every rank put what."""
    where: dict[MetadataIndex, StoredItem] = {}
    for rank_results in results:
        for result in rank_results:
            item = result.storage_data
            if not isinstance(item, StoredItem):
                raise IntegrityError(f"write result for {result.index.fqn!r} did not come from ckstore's Writer")
            where.setdefault(result.index, item)  # a piece several ranks wrote: any copy will do
    tensors, objects = [], []
    for fqn, entry in sorted(metadata.state_dict_metadata.items()):
        if isinstance(entry, BytesStorageMetadata):
            item = where[MetadataIndex(fqn)]
            objects.append(DcpObject(fqn, item.rank, item.file, item.entry.name, item.encoding or "opaque"))
            continue
        props = entry.properties
        pieces = []
        for chunk in entry.chunks:
            item = where[MetadataIndex(fqn, chunk.offsets)]
            pieces.append(DcpPiece(tuple(chunk.offsets), tuple(chunk.sizes), item.rank, item.file, item.entry.name))
        tensors.append(
            DcpTensor(
                fqn,
                dtype_name(props.dtype),
                tuple(entry.size),
                bool(props.requires_grad),
                str(props.layout).removeprefix("torch."),
                _memory_format_name(props.memory_format),
                tuple(pieces),
            )
        )
    return DcpRecord(world_size, tuple(tensors), tuple(objects), _extra(metadata))


@dataclass(frozen=True)
class Location:
    """Where a load finds one stored item."""

    file: str
    tensor: str
    kind: str  # a tensor piece's torch dtype name, or a non-tensor item's encoding
    sizes: tuple[int, ...] = ()  # a piece's extent


def build_metadata(record: DcpRecord) -> tuple[Metadata, dict[MetadataIndex, Location]]:
    """DCP's ``Metadata`` of a commit and where each storage index is stored."""
    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, Location] = {}
    for t in record.tensors:
        props = TensorProperties(
            dtype=_torch_attr(t.dtype, torch.dtype, "dtype"),
            layout=_torch_attr(t.layout, torch.layout, "layout"),
            requires_grad=t.requires_grad,
            memory_format=_torch_attr(t.memory_format, torch.memory_format, "memory format"),
        )
        chunks = [ChunkStorageMetadata(torch.Size(p.offsets), torch.Size(p.sizes)) for p in t.pieces]
        state[t.fqn] = TensorStorageMetadata(props, torch.Size(t.shape), chunks)
        for i, p in enumerate(t.pieces):
            storage.setdefault(MetadataIndex(t.fqn, p.offsets, i), Location(p.file, p.tensor, t.dtype, p.sizes))
    for o in record.objects:
        state[o.fqn] = BytesStorageMetadata()
        storage[MetadataIndex(o.fqn)] = Location(o.file, o.tensor, o.encoding)
    extra = record.decoded_extra()
    meta = extra.get("storage_meta")
    storage_meta = None
    if isinstance(meta, Mapping):
        storage_meta = StorageMeta(
            meta.get("checkpoint_id"), meta.get("save_id"), meta.get("load_id"), list(meta.get("modules") or [])
        )
    metadata = Metadata(
        state,
        planner_data=extra.get("planner_data"),
        storage_data=storage,
        storage_meta=storage_meta,
        version=extra.get("version"),
    )
    return metadata, storage


def decode_object(data: bytes, fqn: str) -> Any:
    """A non-tensor item stored as typed JSON (encoding "value")."""
    from ckstore.format.manifest import parse_json

    try:
        return decode_value(parse_json(data))
    except IntegrityError as exc:
        raise IntegrityError(f"non-tensor item {fqn!r} is corrupt: {exc}") from None
