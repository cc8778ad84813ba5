"""A manifest's file entries: the records (chunk references, tensors, files) and their strict
parsing (pure, no I/O). manifest.py holds the commit around them, its canonical JSON and the
rest of its parsing; docs/format.md section 5 is the normative schema.

Every field, id, size and path is validated, so a damaged or hostile entry is an IntegrityError
and never reaches the filesystem. The common entry (a blob with a plain path) takes a fast path
that accepts only what the general parser accepts (``_plain_blob``, property-tested).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckstore.errors import IntegrityError, InvalidInputError, InvalidPathError
from ckstore.format.dtypes import DTYPE_BITS
from ckstore.format.ids import ObjectId, is_object_id

# Loaded by the commits that carry them: log and status read none.
if TYPE_CHECKING:
    from ckstore.format.tensor_stats import TensorStats

STATS_VERSION = 3  # the manifest version that adds per-tensor ``stats`` (section 5.1)
KINDS = ("safetensors", "blob")
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
DRIVE = re.compile(r"^[A-Za-z]:")


@dataclass(frozen=True)
class ChunkRef:
    id: ObjectId
    size: int  # raw (decoded) length in bytes


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[ChunkRef, ...]
    # Recorded at commit (manifest version 3); None in older manifests. Not part of equality:
    # the same bytes are the same tensor whether or not a writer recorded figures about them.
    stats: TensorStats | None = field(default=None, compare=False)

    @property
    def nbytes(self) -> int:
        return sum(c.size for c in self.chunks)


@dataclass(frozen=True)
class FileEntry:
    path: str
    kind: str  # "safetensors" or "blob"
    size: int
    header: tuple[ChunkRef, ...] = ()  # safetensors: the exact 8-byte length + JSON header
    tensors: tuple[TensorEntry, ...] = ()  # safetensors: in file order
    chunks: tuple[ChunkRef, ...] = ()  # blob: the file's bytes

    def all_chunks(self) -> Iterator[ChunkRef]:
        yield from self.header
        for tensor in self.tensors:
            yield from tensor.chunks
        yield from self.chunks


def tensors_by_name(
    files: Iterable[FileEntry], advice: str, name_of: Callable[[TensorEntry], str | None] = lambda t: t.name
) -> dict[str, tuple[FileEntry, TensorEntry]]:
    """The tensors of ``files`` under the names ``name_of`` gives them (None: left out), each with
    its file. Two tensors under one name (model and EMA weights side by side) are refused with
    ``advice``: one flat mapping cannot hold both, and keeping either would hand back the wrong
    weights without a word."""
    out: dict[str, tuple[FileEntry, TensorEntry]] = {}
    for f in files:
        for t in f.tensors:
            name = name_of(t)
            if name is None:
                continue
            if name in out:
                raise InvalidInputError(f"tensor {name!r} is in both {out[name][0].path} and {f.path}; {advice}")
            out[name] = (f, t)
    return out


def check_relative_path(path: str) -> str:
    """Refuse any path that is absolute, climbs out of its root, or holds hostile characters."""
    if not isinstance(path, str) or not path:
        raise InvalidPathError(f"invalid file path {path!r}")
    if CONTROL.search(path) or "\\" in path or path.startswith("/") or DRIVE.match(path):
        raise InvalidPathError(f"file path {path!r} is absolute or holds forbidden characters")
    if any(part in ("", ".", "..") for part in path.split("/")):
        raise InvalidPathError(f"file path {path!r} has an empty, '.' or '..' component")
    return path


def expect_field(doc: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in doc:
        raise IntegrityError(f"{where}: missing field {key!r}")
    value = doc[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise IntegrityError(f"{where}: field {key!r} has the wrong type")
    return value


def size_field(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or value >= 1 << 63:
        raise IntegrityError(f"{where}: invalid size {value!r}")
    return value


def parse_chunks(value: Any, where: str) -> tuple[ChunkRef, ...]:
    if not isinstance(value, list):
        raise IntegrityError(f"{where}: chunks are not a list")
    out = []
    for item in value:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and is_object_id(item[0])):
            raise IntegrityError(f"{where}: malformed chunk reference {item!r:.80}")
        size = size_field(item[1], where)
        if size == 0:
            raise IntegrityError(f"{where}: empty chunk")
        out.append(ChunkRef(ObjectId(item[0]), size))
    return tuple(out)


_TENSOR_FIELDS = {"name", "dtype", "shape", "chunks"}
_STATS_FIELDS = ("l2", "absmax", "nonfinite", "change")


def _optional_number(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise IntegrityError(f"{where}: malformed stats")
    return float(value)


def _parse_stats(doc: Any, where: str) -> TensorStats:
    if not isinstance(doc, dict) or set(doc) != set(_STATS_FIELDS):
        raise IntegrityError(f"{where}: malformed stats")
    nonfinite = doc["nonfinite"]
    if isinstance(nonfinite, bool) or not isinstance(nonfinite, int) or nonfinite < 0:
        raise IntegrityError(f"{where}: malformed stats")
    from ckstore.format.tensor_stats import TensorStats

    return TensorStats(
        _optional_number(doc["l2"], where),
        _optional_number(doc["absmax"], where),
        nonfinite,
        _optional_number(doc["change"], where),
    )


def _parse_tensor(doc: Any, where: str, version: int) -> TensorEntry:
    allowed = (_TENSOR_FIELDS, {*_TENSOR_FIELDS, "stats"}) if version >= STATS_VERSION else (_TENSOR_FIELDS,)
    if not isinstance(doc, dict) or set(doc) not in allowed:
        raise IntegrityError(f"{where}: malformed tensor entry")
    name = expect_field(doc, "name", str, where)
    where = f"{where}, tensor {name!r}"
    dtype = expect_field(doc, "dtype", str, where)
    if dtype not in DTYPE_BITS:
        raise IntegrityError(f"{where}: unknown dtype {dtype!r}")
    shape = expect_field(doc, "shape", list, where)
    if len(shape) > 64 or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 63 for d in shape):
        raise IntegrityError(f"{where}: invalid shape")
    chunks = parse_chunks(doc["chunks"], where)
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits != 8 * sum(c.size for c in chunks):
        raise IntegrityError(f"{where}: chunk sizes do not match dtype and shape")
    stats = _parse_stats(doc["stats"], where) if "stats" in doc else None
    return TensorEntry(name, dtype, tuple(shape), chunks, stats)


# A path made of these characters, no component empty, "." or "..", passes check_relative_path.
_PLAIN_PART = r"(?!\.\.?(?:/|$))[A-Za-z0-9_.+@=-]+"
_PLAIN_PATH = re.compile(rf"{_PLAIN_PART}(?:/{_PLAIN_PART})*")
_MAX_SIZE = 1 << 63


def _plain_blob(doc: Any) -> FileEntry | None:
    """A blob entry of the common shape (plain path, well-formed chunks adding up), parsed
    without the general path's per-field bookkeeping (10^5-file manifests: most of a decode);
    None for anything else, which ``_parse_file`` then accepts or refuses with its reason.
    Accepts only entries ``_parse_file`` accepts, and builds the same FileEntry."""
    if type(doc) is not dict or len(doc) != 4 or doc.get("kind") != "blob":
        return None
    path, size, chunks = doc.get("path"), doc.get("size"), doc.get("chunks")
    if type(path) is not str or type(size) is not int or type(chunks) is not list or not _PLAIN_PATH.fullmatch(path):
        return None
    refs = []
    total = 0
    for item in chunks:
        if type(item) is not list or len(item) != 2:
            return None
        oid, n = item
        if type(oid) is not str or type(n) is not int or not 0 < n < _MAX_SIZE or not is_object_id(oid):
            return None
        total += n
        refs.append(ChunkRef(ObjectId(oid), n))
    if total != size or size >= _MAX_SIZE:  # chunks are positive, so 0 <= size
        return None
    return FileEntry(path, "blob", size, chunks=tuple(refs))


def _parse_file(doc: Any, index: int, version: int) -> FileEntry:
    plain = _plain_blob(doc)
    return plain if plain is not None else _parse_any_file(doc, index, version)


def _parse_any_file(doc: Any, index: int, version: int) -> FileEntry:
    where = f"file #{index}"
    if not isinstance(doc, dict):
        raise IntegrityError(f"{where}: not an object")
    try:
        path = check_relative_path(expect_field(doc, "path", str, where))
    except InvalidPathError as exc:
        raise IntegrityError(f"{where}: {exc}") from None
    where = f"file {path!r}"
    kind = expect_field(doc, "kind", str, where)
    size = size_field(doc.get("size"), where)
    if kind == "safetensors":
        if set(doc) != {"path", "kind", "size", "header", "tensors"}:
            raise IntegrityError(f"{where}: unexpected fields")
        header = parse_chunks(doc["header"], where)
        tensors_doc = expect_field(doc, "tensors", list, where)
        tensors = tuple(_parse_tensor(t, where, version) for t in tensors_doc)
        if len({t.name for t in tensors}) != len(tensors):
            raise IntegrityError(f"{where}: duplicate tensor names")
        entry = FileEntry(path, kind, size, header=header, tensors=tensors)
    elif kind == "blob":
        if set(doc) != {"path", "kind", "size", "chunks"}:
            raise IntegrityError(f"{where}: unexpected fields")
        entry = FileEntry(path, kind, size, chunks=parse_chunks(doc["chunks"], where))
    else:
        raise IntegrityError(f"{where}: unknown kind {kind!r}")
    if sum(c.size for c in entry.all_chunks()) != size:
        raise IntegrityError(f"{where}: chunk sizes do not add up to the file size {size}")
    return entry


def parse_files(doc: list[Any], version: int) -> tuple[FileEntry, ...]:
    files = tuple(_parse_file(f, i, version) for i, f in enumerate(doc))
    paths = {f.path for f in files}
    if len(paths) != len(files):
        raise IntegrityError("manifest: duplicate file paths")
    for path in paths:  # "a" and "a/b" cannot both be files
        parts = path.split("/")
        if any("/".join(parts[:i]) in paths for i in range(1, len(parts))):
            raise IntegrityError(f"manifest: {path!r} lies below another file")
    return files
