"""``Writer`` and ``Reader``: torch.distributed.checkpoint storage over a ckstore repository.

A save is one commit. Every rank stores its own items through the normal ingest path (chunked,
hashed, encoded, put-if-absent in one durability batch, so concurrent ranks writing the same
chunk are safe and replicated bytes are stored once) as one safetensors file of its pieces,
``dcp/rank-NNNNN.safetensors``, and reports the chunk lists in its ``WriteResult``s. Only the
coordinator writes: after DCP has gathered every rank's results (so every rank's batch is
durable), it checks that every named object exists, writes the manifest with its ``dcp`` record
and moves the branch by compare-and-swap (commit.record_commit). A rank that fails or dies
means DCP never calls ``finish``: no manifest, the ref unchanged, and the stored chunks are
unreferenced objects that gc removes.

The coordinator holds the writers' locks (writing.py) from before any rank writes (its global
plan goes out only after it is taken) until the ref has moved, so gc cannot delete a rank's
objects between their write and the manifest that names them. Each rank also holds them while it
writes. DCP has no abort callback, so a failed save never reaches ``finish``: the coordinator
releases the lock as soon as the save has failed on any rank, and in any case ``lock_hold``
seconds after planning (a rank that died), so maintenance waits only while a save can still
land (hold.py). ``finish`` takes the locks again and checks, under them, that every object the
ranks reported is here: a save that outlived the bound and lost objects to gc is refused, never
recorded incomplete.

Pieces are named by fully qualified name and global offsets (``format.dcp_record.piece_name``), not
by rank, so the next save finds each piece's predecessor wherever it was written: unchanged
pieces cost nothing, changed ones are stored the fast way and, once the commit is recorded, the
repository's compaction re-encodes their predecessors as deltas against them (dcp/compaction.py).

A remote URL instead of a repository (``s3://…``, ``file://…``) takes the same path up to the
rank's file: each rank then uploads what the remote lacks as its chunks are encoded (upload.py),
and the coordinator lands the commit there by compare-and-swap (remote.py); no lock is held,
since a remote gc's grace period is what keeps a save's packs until its ref moves.

Non-tensor items: with DCP's default planner (``transform_object`` not overridden) the Writer
looks the value up itself and stores it in ckstore's typed JSON (values.py) when it is
representable there; otherwise it stores the bytes the planner produced (``torch.save`` pickle for
the default planner) as opaque bytes. On load, typed values are decoded by ckstore and put into
the state dict without pickle; opaque bytes go back to the planner's own ``load_bytes`` (DCP's
code path, which unpickles them) — ckstore itself never unpickles anything.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import subprocess
import warnings
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ckstore.dcp import remote_compaction
from ckstore.dcp.compaction import store_pieces
from ckstore.dcp.hold import SaveHold
from ckstore.dcp.location import CheckpointPath, checkpoint_path, repository_location
from ckstore.dcp.metadata import Location, StoredItem, build_metadata, build_record, decode_object, dtype_name
from ckstore.dcp.remote import (
    RemoteTarget,
    RemoteView,
    find_target,
    is_remote_url,
    land_save,
    point_tag,
    prepare_remote,
    save_branch,
)
from ckstore.dcp.remote_compaction import check_mode
from ckstore.dcp.upload import save_rank
from ckstore.errors import CkstoreError, ConflictError, IntegrityError, InvalidInputError, UnencodableValueError
from ckstore.format.dcp_record import piece_name, stored_dtype
from ckstore.format.dtypes import TORCH_DTYPES
from ckstore.format.manifest import FileEntry, canonical_json
from ckstore.format.safetensors import emit_header, parse_header
from ckstore.format.settings import DEFAULT_CHUNK_SIZE
from ckstore.format.torch_dtypes import bytes_of
from ckstore.format.values import encode_value
from ckstore.remote.compaction import RemoteCompactReport
from ckstore.remote.layout import RemoteRepo
from ckstore.repository.branches import create
from ckstore.repository.context import RepoContext, open_context
from ckstore.repository.graph import CommitGraph
from ckstore.repository.refs import HEADS, check_ref_name
from ckstore.repository.writing import writing
from ckstore.training.partial import LazyTensors
from ckstore.write.commit import prepare_commit, record_commit
from ckstore.write.ingest import MemoryFile

FILE_METADATA = {"format": "ckstore-dcp"}
# How long the coordinator holds the lock past planning without reaching ``finish`` (a rank
# failed or died): maintenance waits at most this, well within REPO_LOCK_TIMEOUT.
DEFAULT_LOCK_HOLD = 300.0
COMMIT_KEY = "ckstore_commit"  # in the Metadata dcp.save returns: the commit id, on every rank
# Bytes of a stored piece a load reads and copies into its target at a time.
COPY_BAND = 32 << 20
OBJECT_SUFFIX = "@bytes"  # piece names end in "@" and digits, so an item's name never equals one


def rank_file(rank: int) -> str:
    return f"dcp/rank-{rank:05d}.safetensors"


def _target(checkpoint_id: str | os.PathLike[str], what: str) -> CheckpointPath:
    found = checkpoint_path(checkpoint_id)
    if found is None:
        raise InvalidInputError(
            f"checkpoint path {os.fspath(checkpoint_id)!r} is not in a ckstore repository (run 'ckstore init' "
            f"there, or pass the repository to {what})"
        )
    return found


@dataclasses.dataclass(frozen=True)
class _PlanInfo:
    """What the coordinator's global plan tells every rank."""

    rank: int
    world_size: int
    branch: str
    remote: RemoteTarget | None = None  # a save to a remote: where, as the coordinator found it


class Writer(StorageWriter):
    """Save a DCP checkpoint as one commit on ``branch`` (default: the repository's HEAD branch).

    ``repo`` may be left out when the call site passes ``checkpoint_id`` (``<repo>`` or
    ``<repo>/<name>``, location.py), which also chooses the branch or tag the save names.
    ``repo`` (or ``checkpoint_id``) may be a remote URL instead, ``s3://bucket/prefix[/name]``
    or ``file:///folder[/name]``: ranks on machines that share no folder then save straight to
    that remote (remote.py; branch ``main`` by default). ``cache_dir`` (default: the
    ``CKSTORE_CACHE_DIR`` environment variable, else none) is a node-local folder for what is
    cached from the remote; it is never needed for correctness. S3 endpoint
    and credentials come from the standard AWS variables, or ``endpoint_url``. Once a save has
    landed on a remote, the previous save's chunks are re-encoded there as deltas of the new ones
    (``compact``: ``"background"``, a detached process, the default; ``"inline"``, before
    ``dcp.save`` returns; ``"off"``; remote_compaction.py).
    After ``dcp.save`` returns, ``commit_id`` holds the new commit's id on the coordinator rank;
    every rank finds it in the returned metadata (``saved_commit(dcp.save(...))``).
    """

    def __init__(
        self,
        repo: Any = None,
        branch: str | None = None,
        message: str = "",
        metadata: Mapping[str, Any] | None = None,
        lock_hold: float = DEFAULT_LOCK_HOLD,
        cache_dir: str | os.PathLike[str] | None = None,
        endpoint_url: str | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        compact: str = "background",
    ) -> None:
        super().__init__()
        self.lock_hold = lock_hold
        self.compact = check_mode(compact)
        # After a save to a remote, on the coordinator: the detached compaction's process
        # (``compact="background"``) or the report of the one that ran (``"inline"``).
        self.compaction: subprocess.Popen[bytes] | RemoteCompactReport | None = None
        self.cache_dir, self.endpoint_url, self.chunk_size = cache_dir, endpoint_url, chunk_size
        self.remote_url = os.fspath(repo) if is_remote_url(repo) else None
        self._target: RemoteTarget | None = None  # the remote as found, on the coordinator
        self._remotes: dict[RemoteTarget, RemoteRepo] = {}  # kept across saves: indexes read once
        self.location = None if repo is None or self.remote_url else repository_location(repo)
        self._name: str | None = None  # the ref a checkpoint path named (location.py)
        self._tag: str | None = None  # the tag the coordinator points at the commit, decided in planning
        self._request = prepare_commit(message, branch, metadata)  # refuses bad input before any save
        self.commit_id: str | None = None
        self._ctx: RepoContext | None = None
        self._hold = SaveHold()
        self._world = 1
        self._plan_branch: str | None = None

    def __getstate__(self) -> dict[str, Any]:  # async_save in a separate process pickles the writer
        state = dict(self.__dict__)
        state["_ctx"], state["_remotes"], state["compaction"] = None, {}, None
        del state["_hold"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._hold = SaveHold()

    def _remote(self, target: RemoteTarget) -> RemoteRepo:
        if target not in self._remotes:
            self._remotes[target] = target.open()
        return self._remotes[target]

    def _context(self) -> RepoContext:
        if self._ctx is None:
            if self.location is None:
                raise InvalidInputError("ckstore.dcp.Writer: no repository (pass one, or a checkpoint_id to dcp.save)")
            self._ctx = open_context(self.location)
        return self._ctx

    # ---- the StorageWriter protocol ------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._hold.release()  # a previous save that failed after planning
        self.commit_id = None
        if checkpoint_id is None:
            return  # the same place as before (DCP's older save_state_dict resets without one)
        if is_remote_url(checkpoint_id):
            self.remote_url, self.location, self._ctx = os.fspath(checkpoint_id), None, None
            return
        self.remote_url = None
        target = _target(checkpoint_id, "ckstore.dcp.Writer")
        if target.name is not None:
            check_ref_name(target.name, "checkpoint name")
        if target.repo != self.location:
            self._ctx = None
        self.location, self._name = target.repo, target.name

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return is_remote_url(checkpoint_id) or checkpoint_path(checkpoint_id) is not None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.remote_url is None:
            self._context()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if self.remote_url is not None:
            return self._remote_plan(plans)
        ctx = self._context()
        branch, self._tag = self._request.on_branch(ctx).branch, None
        if self._name is not None and (self._name == self._request.branch or ctx.refs.read(HEADS + self._name)):
            branch = self._name
        elif self._name is not None:
            self._tag = self._name
        assert branch is not None  # on_branch decided it
        self._hold.take(ctx, self.lock_hold)  # before any rank writes: see hold.py
        self._world, self._plan_branch = len(plans), branch
        return [dataclasses.replace(p, storage_data=_PlanInfo(i, len(plans), branch)) for i, p in enumerate(plans)]

    def _remote_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        assert self.remote_url is not None
        found = find_target(self.remote_url, self.endpoint_url, self.cache_dir)
        remote = self._remote(found)
        prepare_remote(remote, found)
        branch, self._tag = save_branch(remote, self._request, found.name)
        self._target, self._world, self._plan_branch = found, len(plans), branch
        return [
            dataclasses.replace(p, storage_data=_PlanInfo(i, len(plans), branch, found)) for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        try:
            return self._write_data(plan, planner)
        except BaseException:
            self._hold.release()  # on the coordinator: DCP will not call finish
            raise

    def _write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        info = plan.storage_data
        if not isinstance(info, _PlanInfo):
            raise InvalidInputError("the save plan did not come from ckstore's Writer (prepare_global_plan)")
        path = rank_file(info.rank)
        specs: list[tuple[str, str, tuple[int, ...]]] = []
        buffers: list[Any] = []
        encodings: list[str | None] = []
        keep: list[torch.Tensor] = []  # the buffers' tensors, alive until their bytes are stored
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                data, value_encoding = _object_bytes(planner, item)
                specs.append((item.index.fqn + OBJECT_SUFFIX, "U8", (len(data),)))
                buffers.append(memoryview(data))
                encodings.append(value_encoding)
                continue
            tensor = planner.resolve_data(item)
            if not isinstance(tensor, torch.Tensor) or item.tensor_data is None:
                raise InvalidInputError(f"item {item.index.fqn!r}: the planner did not resolve it to a tensor")
            tensor = tensor.detach().to("cpu").contiguous()
            chunk = item.tensor_data.chunk
            if tuple(tensor.shape) != tuple(chunk.sizes):
                raise InvalidInputError(f"item {item.index.fqn!r}: the tensor's shape differs from the plan's")
            code, shape = stored_dtype(dtype_name(tensor.dtype), chunk.sizes)
            specs.append((piece_name(item.index.fqn, chunk.offsets), code, shape))
            keep.append(tensor)
            buffers.append(bytes_of(tensor))
            encodings.append(None)
        results: list[WriteResult] = []
        if plan.items:
            header, _ = emit_header(specs, FILE_METADATA)
            size = len(header) + sum(len(b) for b in buffers)
            source = MemoryFile(path, parse_header(header, size), (memoryview(header), *buffers))
            if info.remote is not None:  # on the remote, in indexed packs, before we report
                entry, added = save_rank(self._remote(info.remote), source, self.chunk_size)
            else:
                ctx = self._context()
                with writing(ctx), ctx.store.batch(size) as staged:  # durable before we report
                    entry, added = store_pieces(staged, source, ctx.config.chunk_size)
            entries = {t.name: t for t in entry.tensors}
            for i, (item, (piece, _, _), item_encoding) in enumerate(zip(plan.items, specs, encodings)):
                stored = StoredItem(
                    info.rank, path, entries[piece], item_encoding, entry.header, added if i == 0 else 0
                )
                results.append(WriteResult(index=item.index, size_in_bytes=entries[piece].nbytes, storage_data=stored))
        del keep
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if self._target is not None and self.remote_url is not None:
            self._finish_remote(metadata, results, self._target)
            return
        ctx = self._context()
        try:
            items = [r.storage_data for rank in results for r in rank]
            files = _rank_files(items)
            with writing(ctx):  # still held, unless lock_hold ran out: then checked under it again
                missing = [c.id for f in files for c in f.all_chunks() if not ctx.store.has_durable(c.id)]
                if missing:
                    raise IntegrityError(
                        f"{len(missing)} object(s) the ranks reported are missing (first: "
                        f"{missing[0]}); nothing was committed"
                    )
                record = build_record(metadata, results, max(self._world, len(results)))
                # The branch the ranks used (the one the global plan named).
                request = dataclasses.replace(self._request, branch=self._plan_branch or self._request.branch)
                added = sum(i.added for i in items)
                # Recording the commit starts the compaction after it, on this process's background
                # thread (dcp/compaction.py).
                self.commit_id = record_commit(ctx, files, added, request, dcp=record)
                if self._tag is not None:
                    create(ctx, "tag", self._tag, self.commit_id, force=True)
            # DCP hands the coordinator's metadata back to every rank as dcp.save's return value,
            # so this is how the other ranks learn the commit.
            metadata.storage_data = {COMMIT_KEY: self.commit_id}
        finally:
            self._hold.release()

    def _finish_remote(self, metadata: Metadata, results: list[list[WriteResult]], target: RemoteTarget) -> None:
        items = [r.storage_data for rank in results for r in rank]
        files = _rank_files(items)
        record = build_record(metadata, results, max(self._world, len(results)))
        remote = self._remote(target)
        assert self._plan_branch is not None  # decided in planning
        added = sum(i.added for i in items)
        self.commit_id = land_save(remote, files, added, self._request, self._plan_branch, record)
        if self._tag is not None:
            point_tag(remote, self._tag, self.commit_id)
        metadata.storage_data = {COMMIT_KEY: self.commit_id}
        # Landed: from here a failure of the re-encoding costs bytes, never the save.
        try:
            self.compaction = remote_compaction.start(target, self.commit_id, self.compact)
        except (CkstoreError, OSError) as exc:
            warnings.warn(f"ckstore: the save landed, but its remote compaction did not run: {exc}", stacklevel=2)

    def storage_meta(self) -> Any:
        return None


def saved_commit(metadata: Metadata) -> str:
    """The commit a ``dcp.save`` through ckstore's ``Writer`` made, from the metadata it returned."""
    data = getattr(metadata, "storage_data", None)
    if not isinstance(data, dict) or not isinstance(data.get(COMMIT_KEY), str):
        raise InvalidInputError("this metadata does not come from a save through ckstore's Writer")
    return data[COMMIT_KEY]


def _object_bytes(planner: SavePlanner, item: Any) -> tuple[bytes, str]:
    """A non-tensor item's stored bytes and their encoding (see the module docstring)."""
    if getattr(type(planner), "transform_object", None) is DefaultSavePlanner.transform_object:
        try:
            default = cast(DefaultSavePlanner, planner)  # its transform_object is the default's (checked above)
            return canonical_json(encode_value(default.lookup_object(item.index))), "value"
        except UnencodableValueError:
            pass  # not representable without pickle: store what DCP's planner makes of it
    data = planner.resolve_data(item)
    return (data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)), "opaque"


def _rank_files(items: list[Any]) -> list[FileEntry]:
    """The manifest entries of the ranks' files, rebuilt from their write results."""
    by_file: dict[str, list[StoredItem]] = {}
    for item in items:
        if not isinstance(item, StoredItem):
            raise IntegrityError("a write result did not come from ckstore's Writer")
        by_file.setdefault(item.file, []).append(item)
    files = []
    for path, found in sorted(by_file.items()):
        header = found[0].header
        tensors = tuple(i.entry for i in found)
        size = sum(c.size for c in header) + sum(t.nbytes for t in tensors)
        files.append(FileEntry(path, "safetensors", size, header=header, tensors=tensors))
    return files


class Reader(StorageReader):
    """Load a DCP checkpoint from the commit ``ref`` names (resolved once, on first use).

    ``repo`` may be left out when the call site passes ``checkpoint_id``: ``<repo>`` (HEAD) or
    ``<repo>/<name>`` (a branch, tag or commit id; location.py); a checkpoint id that lies in
    no repository is taken as a ref of ``repo``.

    ``repo`` may be a remote URL as for ``Writer`` (the same URL: ``<remote>/<name>`` reads
    ``<name>``, ``<remote>`` reads ``ref``, where ``HEAD`` is branch ``main``): each rank then
    reads only the chunks of its own read items from the remote, each verified as it arrives,
    and keeps them in ``cache_dir`` (or ``CKSTORE_CACHE_DIR``) when one is given.
    """

    def __init__(
        self,
        repo: Any = None,
        ref: str = "HEAD",
        cache_dir: str | os.PathLike[str] | None = None,
        endpoint_url: str | None = None,
    ) -> None:
        super().__init__()
        self.remote_url = os.fspath(repo) if is_remote_url(repo) else None
        self.location = None if repo is None or self.remote_url else repository_location(repo)
        self.cache_dir, self.endpoint_url = cache_dir, endpoint_url
        self.ref = ref
        self.commit_id: str | None = None
        self._ctx: RepoContext | None = None
        self._graph: CommitGraph | None = None
        self._storage: dict[MetadataIndex, Location] = {}
        self._readers: dict[str, LazyTensors] = {}
        self.bytes_read = 0

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_ctx"], state["_graph"], state["_readers"] = None, None, {}
        return state

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None and is_remote_url(checkpoint_id):
            self.remote_url, self.location, self._ctx = os.fspath(checkpoint_id), None, None
        elif checkpoint_id is not None and self.remote_url is not None:
            self.ref = os.fspath(checkpoint_id)  # dcp.load(checkpoint_id=REF, storage_reader=Reader(url))
        elif checkpoint_id is not None:
            target = checkpoint_path(checkpoint_id)
            if target is None and self.location is None:
                target = _target(checkpoint_id, "ckstore.dcp.Reader")
            if target is None:  # dcp.load(checkpoint_id=REF, storage_reader=Reader(repo))
                self.ref = os.fspath(checkpoint_id)
            else:
                if target.repo != self.location:
                    self._ctx = None
                self.location, self.ref = target.repo, target.name or "HEAD"
        self.commit_id, self._graph = None, None  # a remote's holdings are read again for each load
        self._readers = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return is_remote_url(checkpoint_id) or checkpoint_path(checkpoint_id) is not None

    def _open(self) -> CommitGraph:
        """The graph to read from (the repository's, or the remote's read lazily), with
        ``commit_id`` resolved."""
        if self._graph is None and self.remote_url is not None:
            target = find_target(self.remote_url, self.endpoint_url, self.cache_dir)
            view = RemoteView(target)
            self._graph = view.graph
            if self.commit_id is None:
                self.commit_id = view.resolve(target.name if target.name is not None else self.ref)
        if self._graph is None:
            if self.location is None:
                raise InvalidInputError("ckstore.dcp.Reader: no repository (pass one, or a checkpoint_id to dcp.load)")
            if self._ctx is None:
                self._ctx = open_context(self.location)
            self._graph = self._ctx.graph
        if self.commit_id is None:
            self.commit_id = self._graph.resolve(self.ref)
        return self._graph

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        graph = self._open()
        assert self.commit_id is not None  # resolved by _open
        commit = graph.read_commit(self.commit_id)
        if commit.dcp is None:
            raise InvalidInputError(f"commit {self.commit_id[:12]} is not a distributed checkpoint")
        metadata, self._storage = build_metadata(commit.dcp)
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        # Every rank resolved the ref on its own: the coordinator's commit goes out with the plan
        # so that a rank that saw the branch move refuses instead of mixing two checkpoints.
        return [dataclasses.replace(p, storage_data=self.commit_id) for p in plans]

    def _file(self, path: str) -> LazyTensors:
        if path not in self._readers:
            assert self._graph is not None and self.commit_id is not None
            self._readers[path] = LazyTensors(self._graph, self.commit_id, path, "pt")
        return self._readers[path]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if plan.storage_data is not None and plan.storage_data != self.commit_id:
            raise ConflictError(
                f"the ranks read different commits of {self.ref!r} (it moved during the load); load a commit id instead"
            )
        for req in plan.items:
            where = self._where(req.storage_index)
            reader = self._file(where.file)
            before = reader.bytes_read
            if req.type == LoadItemType.BYTE_IO:
                data = reader.get_tensor(where.tensor).numpy().tobytes()
                if where.kind == "value":
                    _deliver_value(planner, req, decode_object(data, req.storage_index.fqn))
                else:
                    planner.load_bytes(req, io.BytesIO(data))
            else:
                target = planner.resolve_tensor(req).detach()
                if tuple(target.shape) != tuple(req.lengths):
                    raise IntegrityError(
                        f"tensor {req.storage_index.fqn!r}: stored region {tuple(req.lengths)} "
                        f"does not fit the target {tuple(target.shape)}"
                    )
                self._copy_region(reader, where, req, target)
                planner.commit_tensor(req, target)
            self.bytes_read += reader.bytes_read - before
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _where(self, index: MetadataIndex) -> Location:
        found = self._storage.get(index)
        if found is None:
            raise IntegrityError(
                f"commit {str(self.commit_id)[:12]} has no stored piece {index.fqn!r} at {index.offset}"
            )
        return found

    @staticmethod
    def _copy_region(reader: LazyTensors, where: Location, req: Any, target: torch.Tensor) -> None:
        """Copy the requested hypercube of a stored piece into ``target``, reading only the
        chunks of its rows, a band of rows at a time: a load holds about COPY_BAND bytes of a
        piece on top of its target, whatever the piece's size."""
        offsets, lengths = list(req.storage_offsets), list(req.lengths)
        if TORCH_DTYPES[where.kind][1] is None:  # a dtype safetensors cannot name: raw bytes, read whole
            piece = reader.get_tensor(where.tensor).view(getattr(torch, where.kind)).reshape(where.sizes)
            for dim, (offset, length) in enumerate(zip(offsets, lengths)):
                piece = piece.narrow(dim, offset, length)
            target.copy_(piece)
            return
        if not offsets:
            target.copy_(reader.get_tensor(where.tensor))
            return
        row = math.prod(where.sizes[1:]) * getattr(torch, where.kind).itemsize
        band = max(1, COPY_BAND // max(1, row))
        rows = reader.get_slice(where.tensor)
        for start in range(0, lengths[0], band):
            n = min(band, lengths[0] - start)
            piece = rows[offsets[0] + start : offsets[0] + start + n]
            for dim in range(1, len(offsets)):
                piece = piece.narrow(dim, offsets[dim], lengths[dim])
            target.narrow(0, start, n).copy_(piece)


def _deliver_value(planner: LoadPlanner, req: Any, value: Any) -> None:
    """Put a typed value into the state dict without pickle when the planner is DCP's default;
    a planner with its own ``load_bytes`` gets ``torch.save`` bytes of the decoded value."""
    if isinstance(planner, DefaultLoadPlanner) and type(planner).load_bytes is DefaultLoadPlanner.load_bytes:
        fqn = req.dest_index.fqn
        if planner.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(planner.original_state_dict, planner.mappings[fqn], value)
        else:
            planner.state_dict[fqn] = value
        return
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    planner.load_bytes(req, buffer)


__all__ = ["Reader", "Writer", "rank_file", "saved_commit"]
