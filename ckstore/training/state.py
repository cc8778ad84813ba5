"""Training state as commits, without pickle. torch is imported only by the torch-facing modules
(training/, dcp/, read/lora.py, format/torch_dtypes.py, integrations/lightning.py), each lazily
from ``Repo`` and the CLI, so ``import ckstore`` and commands that decode no tensor stay torch-free.

``commit_state`` splits a nested state (dicts, lists, tuples, tensors, numpy arrays, scalars) into
a safetensors file of its tensors, named by their dotted key paths, and a JSON document of
everything else in the typed encoding of values.py, where each tensor is ``{"$tensor": …}``. Both
files are ingested exactly like committed files, so dedup, compression and verification are the
core's, and ``ckstore checkout`` of such a commit yields plain ``state.safetensors`` +
``state.json``. Tensors that share storage (tied weights) are stored once and come back as one
tensor object. Dtypes safetensors cannot name (complex128, float4 …) are stored as raw bytes with
their torch dtype and shape in the JSON.
"""

from __future__ import annotations

import fnmatch
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import numpy as np
import torch

from ckstore.errors import IntegrityError, InvalidInputError, UnencodableValueError
from ckstore.format.manifest import FileEntry, TensorEntry, canonical_json
from ckstore.format.manifest_entries import tensors_by_name
from ckstore.format.safetensors import emit_header, parse_header
from ckstore.format.torch_dtypes import ST_CODES, bytes_of, dtype_of_code, from_bytes, torch_dtype
from ckstore.format.values import JSONValue, KeyPath, decode_value, encode_value, format_path
from ckstore.repository.filedata import state_document
from ckstore.runtime.pipeline import ordered_map
from ckstore.write.ingest import MemoryFile

if TYPE_CHECKING:
    from ckstore.format.manifest import Commit
    from ckstore.repository.graph import CommitGraph
    from ckstore.repository.store import ObjectStore

# Where load_state puts tensors: "cpu", "cuda:0", a torch.device (type checkers only: Repo names
# it without importing torch).
Device: TypeAlias = "str | torch.device"
STATE_VALUES = "state.json"
STATE_TENSORS = "state.safetensors"
STATE_VERSION = 1


def dotted_name(path: KeyPath) -> str:
    """``("model", "0.weight")`` -> ``"model.0.weight"``: state_dict keys keep their own dots."""
    return ".".join(str(p) for p in path) if path else "<root>"


@dataclass
class _Flattener:
    """Collects tensors under unique names while values.py encodes the rest."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    specs: dict[str, tuple[str, list[int]]] = field(default_factory=dict)
    shared: dict[tuple[Any, ...], dict[str, JSONValue]] = field(default_factory=dict)
    snapshot: bool = False  # take private copies (background commits: training goes on mutating)
    device_copies: bool = False  # a non-blocking device-to-host copy is in flight

    def _name(self, path: KeyPath) -> str:
        # Plain dotted names ("model.layer1.weight"), what users and safetensors tools expect
        # after a checkout; the JSON maps each tensor back to its exact key path, so a name only
        # has to be unique. Clashes ({"a.b": x, "a": {"b": y}}) get a "#n" suffix.
        name = dotted_name(path)
        if name in self.tensors or not name.isprintable() or name == "__metadata__":
            name = f"{name}#{len(self.tensors)}" if name.isprintable() else f"tensor#{len(self.tensors)}"
        return name

    def add(self, path: KeyPath, value: torch.Tensor) -> dict[str, JSONValue]:
        where = format_path(path)
        # Refuse what raw dense bytes cannot represent, instead of storing it wrongly: a sparse or
        # nested tensor has no single buffer, a quantized one would lose its scale/zero point.
        if value.layout != torch.strided or value.is_nested:
            raise UnencodableValueError(f"tensor at {where} has layout {value.layout}; store value.to_dense()")
        if value.is_quantized:
            raise UnencodableValueError(
                f"quantized tensor at {where} cannot be stored; store int_repr(), q_scale() and q_zero_point()"
            )
        key = None
        if value.numel() > 0 and value.device.type != "meta":
            key = (
                value.untyped_storage().data_ptr(),
                value.storage_offset(),
                tuple(value.shape),
                tuple(value.stride()),
                value.dtype,
                str(value.device),
            )
            if key in self.shared:
                return self.shared[key]  # tied weights: one stored tensor, one object on load
        if value.device.type == "meta":
            raise UnencodableValueError(f"tensor at {where} is on the meta device and holds no data")
        name = self._name(path)
        # resolve_conj/neg: a lazily conjugated view has no bytes of its own to reinterpret.
        stored = (
            self._private_copy(value)
            if self.snapshot
            else (value.detach().to("cpu").resolve_conj().resolve_neg().contiguous())
        )
        payload: dict[str, JSONValue] = {"name": name}
        code = ST_CODES.get(stored.dtype)
        if code is None:  # safetensors has no name for it: raw bytes + the real dtype and shape
            payload.update(dtype=str(stored.dtype).removeprefix("torch."), shape=list(stored.shape))
            shape = [stored.numel() * stored.element_size()]
            code = "U8"
        else:
            shape = list(stored.shape)
        self.tensors[name] = stored
        self.specs[name] = (code, shape)
        if key is not None:
            self.shared[key] = payload
        return payload

    def _private_copy(self, value: torch.Tensor) -> torch.Tensor:
        """One copy the caller can no longer change: CPU tensors cloned, device tensors copied
        into pinned host memory without blocking (``finish`` synchronizes once)."""
        source = value.detach().resolve_conj().resolve_neg()
        if source.device.type == "cpu":
            return source.clone(memory_format=torch.contiguous_format)
        pinned = torch.cuda.is_available()
        out = torch.empty(source.shape, dtype=source.dtype, pin_memory=pinned)
        out.copy_(source, non_blocking=pinned)
        self.device_copies = self.device_copies or pinned
        return out

    def finish(self) -> None:
        if self.device_copies:
            torch.cuda.synchronize()

    def leaf(self, path: KeyPath, value: object) -> tuple[str, JSONValue] | Any:
        if isinstance(value, torch.Tensor):
            return "tensor", self.add(path, value)
        if isinstance(value, np.ndarray):
            # Subclasses (masked arrays, matrix) carry state beyond the buffer; only plain arrays
            # (and memmaps, which are plain arrays on disk) round-trip exactly.
            if type(value) not in (np.ndarray, np.memmap) or value.dtype.kind not in "biufc":
                raise UnencodableValueError(
                    f"numpy {type(value).__name__} of dtype {value.dtype} at {format_path(path)} cannot be stored"
                    " without pickle"
                )
            # np.asarray, not np.ascontiguousarray, which turns a 0-d array into shape (1,).
            native = np.asarray(value, order="C").astype(value.dtype.newbyteorder("="), copy=False)
            try:
                tensor = torch.from_numpy(native)
            except TypeError:  # a dtype torch lacks, e.g. longdouble or complex256
                raise UnencodableValueError(
                    f"numpy array of dtype {value.dtype} at {format_path(path)} has no torch equivalent"
                ) from None
            return "ndarray", self.add(path, tensor)
        if isinstance(value, torch.dtype):
            return "torch_dtype", str(value).removeprefix("torch.")
        if isinstance(value, torch.device):
            return "torch_device", str(value)
        if isinstance(value, torch.Size):
            return "torch_size", list(value)
        return NotImplemented


def state_files(state: object, snapshot: bool = False) -> list[MemoryFile]:
    """The two in-memory files that represent ``state`` (raises before anything is stored).

    With ``snapshot`` every tensor is copied, so the caller may change its tensors as soon as
    this returns (background commits); otherwise the files view the caller's tensors.
    """
    flat = _Flattener(snapshot=snapshot)
    skeleton = encode_value(state, leaf=flat.leaf)
    flat.finish()
    names = list(flat.tensors)
    header, _ = emit_header([(n, *flat.specs[n]) for n in names], {"format": "ckstore-state"})
    segments = [memoryview(header)] + [bytes_of(flat.tensors[n]) for n in names]
    layout = parse_header(header, sum(len(s) for s in segments))
    values = canonical_json({"ckstore_state": STATE_VERSION, "value": skeleton})
    return [MemoryFile(STATE_TENSORS, layout, tuple(segments)), MemoryFile(STATE_VALUES, None, (memoryview(values),))]


# ---- loading -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _TensorRef:
    name: str
    numpy: bool
    dtype: str | None
    shape: tuple[int, ...] | None


def _is_size(d: JSONValue) -> bool:
    return isinstance(d, int) and not isinstance(d, bool) and d >= 0


def _leaf_decoder(tag: str, payload: JSONValue) -> object:
    if tag in ("tensor", "ndarray"):
        name = payload.get("name") if isinstance(payload, dict) else None
        if not isinstance(payload, dict) or not isinstance(name, str):
            raise IntegrityError("malformed tensor reference in state")
        shape = payload.get("shape")
        if shape is not None and not (isinstance(shape, list) and all(_is_size(d) for d in shape)):
            raise IntegrityError("malformed tensor shape in state")
        dtype = payload.get("dtype")
        return _TensorRef(
            name,
            tag == "ndarray",
            dtype if isinstance(dtype, str) else None,
            tuple(cast(list[int], shape)) if shape is not None else None,
        )
    if tag == "torch_dtype":
        return torch_dtype(payload)
    if tag == "torch_device" and isinstance(payload, str):
        try:
            return torch.device(payload)
        except RuntimeError:
            raise IntegrityError(f"invalid torch device {payload!r} in state") from None
    if tag == "torch_size" and isinstance(payload, list) and all(isinstance(d, int) for d in payload):
        return torch.Size(cast(list[int], payload))
    raise IntegrityError(f"unknown value tag ${tag} in state")


class _TensorReader:
    """Reads single tensors of one commit's safetensors file(s), each chunk verified."""

    def __init__(self, store: ObjectStore, files: Sequence[FileEntry], device: str | torch.device) -> None:
        self.store = store
        self.device = device
        self.entries: dict[str, tuple[FileEntry, TensorEntry]] = {t.name: (f, t) for f in files for t in f.tensors}
        self.cache: dict[str, torch.Tensor] = {}
        self.bytes_read = 0

    def read(self, ref: _TensorRef) -> Any:
        tensor = self.cache.get(ref.name)
        if tensor is None:
            tensor = self._load(ref)
            self.cache[ref.name] = tensor
        return tensor.numpy() if ref.numpy else tensor

    def prefetch(self, refs: Sequence[_TensorRef]) -> None:
        """Load many tensors in one parallel pass over all their chunks (eager loads)."""
        todo = list({r.name: r for r in refs if r.name not in self.cache}.values())
        buffers = {r.name: self._buffer(r) for r in todo}

        def fetch(job: tuple[str, int, str, int, str]) -> None:
            name, start, oid, size, context = job
            self._fill(buffers[name][1][start : start + size], oid, context)

        for _ in ordered_map(fetch, (job for r in todo for job in self._jobs(r))):
            pass
        for r in todo:
            self.cache[r.name] = self._finish(r, buffers[r.name][0])

    def _entry(self, ref: _TensorRef) -> tuple[FileEntry, TensorEntry]:
        if ref.name not in self.entries:
            raise IntegrityError(f"state refers to tensor {ref.name!r}, which the commit does not hold")
        return self.entries[ref.name]

    def _buffer(self, ref: _TensorRef) -> tuple[torch.Tensor, np.ndarray]:
        out = torch.empty(self._entry(ref)[1].nbytes, dtype=torch.uint8)
        return out, out.numpy()

    def _jobs(self, ref: _TensorRef) -> Iterator[tuple[str, int, str, int, str]]:
        f, entry = self._entry(ref)
        context = f" (file {f.path!r}, tensor {entry.name!r})"
        start = 0
        for c in entry.chunks:
            yield ref.name, start, c.id, c.size, context
            start += c.size

    def _load(self, ref: _TensorRef) -> torch.Tensor:
        out, view = self._buffer(ref)

        def fetch(job: tuple[str, int, str, int, str]) -> None:
            _, start, oid, size, context = job
            self._fill(view[start : start + size], oid, context)

        for _ in ordered_map(fetch, self._jobs(ref)):
            pass
        return self._finish(ref, out)

    def _fill(self, target: np.ndarray, oid: str, context: str) -> None:
        """Chunk ``oid``, verified, into ``target`` (its place in the tensor): a byte-grouped or
        delta chunk is decoded straight into it; only a chunk stored whole is copied in. (A
        chunk decoded into its own array first cost a page fault per 4 KiB and a second copy.)"""
        data = self.store.chunk_view(oid, target.size, context, target)
        decoded = np.frombuffer(data, dtype=np.uint8)
        if decoded.ctypes.data != target.ctypes.data:
            target[:] = decoded

    def _finish(self, ref: _TensorRef, out: torch.Tensor) -> torch.Tensor:
        _, entry = self._entry(ref)
        self.bytes_read += entry.nbytes
        if ref.dtype is not None:
            dtype, shape = torch_dtype(ref.dtype), ref.shape or ()
        else:
            dtype, shape = dtype_of_code(entry.dtype, entry.name), entry.shape
        tensor = from_bytes(out, dtype, shape)
        return tensor.to(self.device) if str(self.device) != "cpu" else tensor


def _matches(path: KeyPath, patterns: Sequence[str]) -> bool:
    # Both spellings of a path: the plain dotted one users type ("model.layer1.*", as the
    # tensors are named in state.safetensors) and format_path's quoted one ("model.'layer1.w'").
    names = {dotted_name(path), format_path(path)}
    return any(fnmatch.fnmatchcase(n, p) or n == p or n.startswith(p + ".") for n in names for p in patterns)


def _prune(node: object, path: KeyPath, patterns: Sequence[str]) -> tuple[bool, object]:
    """Keep what ``patterns`` select: a matching path keeps its whole subtree."""
    if path and _matches(path, patterns):
        return True, node
    if isinstance(node, dict):
        kept = [(k, v) for k, (keep, v) in ((k, _prune(v, (*path, k), patterns)) for k, v in node.items()) if keep]
        return bool(kept), type(node)(kept)
    if isinstance(node, (list, tuple)) and not isinstance(node, torch.Size):
        items = [v for keep, v in (_prune(v, (*path, i), patterns) for i, v in enumerate(node)) if keep]
        return bool(items), type(node)(items)
    return False, None


def _refs(node: object) -> Iterator[_TensorRef]:
    if isinstance(node, _TensorRef):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, (list, tuple)):
        for value in node:
            yield from _refs(value)


def _materialize(node: object, reader: _TensorReader) -> object:
    if isinstance(node, _TensorRef):
        return reader.read(node)
    if isinstance(node, dict):
        out = type(node)((k, _materialize(v, reader)) for k, v in node.items())
        if hasattr(node, "_metadata"):
            # A torch state_dict is an OrderedDict that carries its modules' versions there.
            out._metadata = node._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(node, (list, tuple)) and not isinstance(node, torch.Size):
        return type(node)(_materialize(v, reader) for v in node)
    return node


class LazyState(Mapping[Any, Any]):
    """A read-only view of a stored state that reads each tensor only when it is accessed."""

    def __init__(self, node: Mapping[Any, Any], reader: _TensorReader) -> None:
        self._node = node
        self._reader = reader

    def __getitem__(self, key: Any) -> Any:
        value = self._node[key]
        if isinstance(value, Mapping):
            return LazyState(value, self._reader)
        return _materialize(value, self._reader)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._node)

    def __len__(self) -> int:
        return len(self._node)

    @property
    def bytes_read(self) -> int:
        """Tensor bytes read so far (tests use it to prove laziness)."""
        return self._reader.bytes_read

    def materialize(self) -> Any:
        return _materialize(self._node, self._reader)


def _skeleton(store: ObjectStore, commit: Commit) -> object:
    if commit.state is None:
        return None
    doc = state_document(store, commit)
    entry = commit.state.values
    if not isinstance(doc, dict) or doc.get("ckstore_state") != STATE_VERSION or set(doc) != {"ckstore_state", "value"}:
        raise IntegrityError(f"{entry} is not a ckstore state document")
    return decode_value(doc["value"], leaf=_leaf_decoder)


def _plain_skeleton(files: Sequence[FileEntry]) -> dict[str, _TensorRef]:
    """{tensor name: tensor} of a commit of plain files. A name in two files (model and EMA
    weights side by side) is refused, as ``open`` does: one flat mapping cannot hold both, and
    silently keeping one would hand back the wrong weights."""
    where = tensors_by_name(
        files, "load_state cannot return both under one name; read one file with open(ref, path=...), or check it out"
    )
    return {name: _TensorRef(name, False, None, None) for name in where}


def load_state(
    graph: CommitGraph,
    ref: str = "HEAD",
    *,
    only: str | Sequence[str] | None = None,
    device: str | torch.device = "cpu",
    lazy: bool = False,
) -> Any:
    """The state committed at ``ref``. A commit of plain files loads as {tensor name: tensor}."""
    commit = graph.read_commit(graph.resolve(ref))
    skeleton = _skeleton(graph.store, commit)
    files = [f for f in commit.files if f.kind == "safetensors"]
    if commit.state is None:
        skeleton = _plain_skeleton(files)
    else:
        tensors_file = commit.state.tensors
        files = [f for f in files if f.path == tensors_file]
    if only is not None:
        patterns = [only] if isinstance(only, str) else list(only)
        _, skeleton = _prune(skeleton, (), patterns)
    reader = _TensorReader(graph.store, files, device)
    if lazy:
        if not isinstance(skeleton, Mapping):
            raise InvalidInputError("lazy loading needs a state whose top level is a mapping")
        return LazyState(skeleton, reader)
    reader.prefetch(list(_refs(skeleton)))
    return _materialize(skeleton, reader)


# ---- RNG ---------------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch (CPU, and every CUDA device present) RNG states, encodable."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what ``rng_state`` captured."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"].cpu() if isinstance(state["torch"], torch.Tensor) else state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
