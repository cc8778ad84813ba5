"""Commit manifests: the records, their canonical JSON, and strict parsing (pure, no I/O); the
file entries' records and parsing are in manifest_entries.py.

A manifest is one JSON object (UTF-8, no insignificant whitespace, keys in the fixed order the
writer emits). Parsing validates every field, every id, every size and every path, so a damaged
or hostile manifest is an IntegrityError and never reaches the filesystem. docs/format.md is the
normative description of this schema.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, overload

from ckstore.errors import IntegrityError, InvalidInputError, UnsupportedFormatError
from ckstore.format.ids import ObjectId, is_object_id
from ckstore.format.manifest_entries import (  # noqa: F401  (the records are part of the manifest's face)
    CONTROL,
    STATS_VERSION,
    ChunkRef,
    FileEntry,
    TensorEntry,
    check_relative_path,
    expect_field,
    parse_chunks,
    parse_files,
    size_field,
)
from ckstore.format.values import JSONValue, decode_value

# Loaded by the commits that carry them (DCP): log and status read none.
if TYPE_CHECKING:
    from ckstore.format.dcp_record import DcpRecord

# Version 2 adds the ``dcp`` field (distributed checkpoints, format.md section 16). Writers emit
# version 1, byte for byte as before, for every commit without a dcp record, so only DCP commits
# are refused by readers that know version 1 alone. Version 3 adds per-tensor ``stats`` (section
# 5.1) to a commit without a dcp record; writers emit it only when some tensor carries them.
# Version 4 (section 5.3) moves a large file list out of the manifest into chunk objects the
# manifest names, so reading a commit's header (log, status, ``~N``) costs what the header is.
MANIFEST_VERSION = 4
FILE_LIST_VERSION = 4
# A file list whose JSON text reaches this many bytes is stored apart (version 4): below it, the
# whole manifest decodes and hashes in about a millisecond, and older readers read the commit.
FILE_LIST_MIN_BYTES = 1 << 18
# The file list's text is cut after an entry whose path's digest falls under this fraction of
# 2^16 (a cut a change to other files does not move: consecutive commits share the pieces of the
# files they share), and after PIECE_MAX_BYTES in any case.
PIECE_CUT = 1 << 7  # about one cut per 512 entries
PIECE_MAX_BYTES = 1 << 22
MAX_MANIFEST_BYTES = 1 << 30
# Beyond MAX_DENSE_CONTAINERS, a manifest holds at most one JSON list or object per
# MIN_CONTAINER_BYTES bytes of text (a real one: one per 20 bytes or more; docs/format.md 10).
MAX_DENSE_CONTAINERS = 1 << 16
MIN_CONTAINER_BYTES = 8


@dataclass(frozen=True)
class StateFiles:
    """A training-state commit's two files: typed-JSON values and the safetensors of tensors."""

    values: str
    tensors: str


@dataclass(frozen=True)
class BaseRef:
    """An overlay's base commit; ``repo`` is None when it lives in the same repository."""

    commit: ObjectId
    repo: str | None = None


# The verified raw bytes of a chunk, by reference (the store's get_chunk): how a version-4
# manifest's file list is read. Raises CkstoreError when the chunk is missing or corrupt.
ChunkReader = Callable[[ChunkRef], "bytes | memoryview"]


class ManifestFiles(Sequence[FileEntry]):
    """A manifest's ``files``, parsed and validated on first use. ``log`` and ``status`` read a
    commit's header only; parsing 10^4 file entries they never look at cost them seconds.
    ``doc`` is the parsed JSON list, or (version 4) the pieces of its text and their reader."""

    __slots__ = ("_doc", "_version", "_label", "_entries", "_pieces", "_read")

    def __init__(
        self,
        doc: list[Any] | None,
        version: int,
        label: str,
        pieces: tuple[ChunkRef, ...] = (),
        read: ChunkReader | None = None,
    ) -> None:
        self._doc: list[Any] | None = doc
        self._version = version
        self._label = label  # names the commit in the error a damaged entry raises
        self._entries: tuple[FileEntry, ...] | None = None
        self._pieces = pieces
        self._read = read

    def load(self) -> tuple[FileEntry, ...]:
        """The parsed entries (IntegrityError, naming the commit, if any is malformed)."""
        if self._entries is None:
            if self._doc is None:
                self._doc = self._read_list()
            try:
                self._entries = parse_files(self._doc, self._version)
            except IntegrityError as exc:
                raise IntegrityError(f"{self._label}: {exc}") from None
            self._doc = None  # the parsed entries replace the JSON they came from
        return self._entries

    def _read_list(self) -> list[Any]:
        if self._read is None:
            raise ValueError(f"{self._label}: a version-4 manifest needs a chunk reader for its file list")
        text = b"".join(self._read(ref) for ref in self._pieces)  # each piece verified by its reader
        try:
            check_shape(text)
            doc = parse_json(text)
        except IntegrityError as exc:
            raise IntegrityError(f"{self._label}: file list: {exc}") from None
        if not isinstance(doc, list):
            raise IntegrityError(f"{self._label}: file list is not a JSON list")
        return doc

    @overload
    def __getitem__(self, index: int) -> FileEntry: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[FileEntry, ...]: ...
    def __getitem__(self, index: int | slice) -> FileEntry | tuple[FileEntry, ...]:
        return self.load()[index]

    def __len__(self) -> int:
        return len(self.load())

    def __iter__(self) -> Iterator[FileEntry]:
        return iter(self.load())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (ManifestFiles, tuple)):
            return self.load() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.load())

    def __repr__(self) -> str:
        return repr(self.load()) if self._entries is not None else f"ManifestFiles(<{len(self._doc or ())} unparsed>)"


@dataclass(frozen=True)
class Commit:
    parents: tuple[ObjectId, ...]
    time: str
    message: str
    branch: str
    files: Sequence[FileEntry]  # a tuple, or ManifestFiles (decode_commit with lazy_files)
    metadata: JSONValue = field(default_factory=dict)  # typed encoding, see values.py
    provenance: Mapping[str, str] = field(default_factory=dict)
    logical_bytes: int = 0
    added_bytes: int = 0
    state: StateFiles | None = None  # training state
    base: BaseRef | None = None  # overlay
    dcp: DcpRecord | None = None  # distributed checkpoint (manifest version 2)
    # Version 4: the chunks whose concatenated bytes are the file list's JSON text (section 5.3).
    file_list: tuple[ChunkRef, ...] = ()

    def all_chunks(self) -> Iterator[ChunkRef]:
        """Every chunk the commit needs: its file list's pieces first (gc keeps them, push sends
        them, fetch receives them, fsck checks them like any chunk), then its files'."""
        yield from self.file_list
        for f in self.files:
            yield from f.all_chunks()

    @property
    def timestamp(self) -> float:
        """``time`` as seconds since the epoch (validated when the manifest was parsed)."""
        return datetime.fromisoformat(self.time).timestamp()

    def decoded_metadata(self) -> dict[str, Any]:
        value = decode_value(self.metadata)
        if not isinstance(value, dict):
            raise IntegrityError("commit metadata is not a mapping")
        return value


def piece_files(text: bytes | memoryview) -> tuple[FileEntry, ...]:
    """The file entries one piece of a version-4 file list holds, each validated as an entry
    (section 5.3: pieces are cut at entry boundaries, so a piece is whole entries; the first
    opens the list with ``[``, the last closes it with ``]``, every other ends with ``,``).
    What only the whole list shows (a path twice, a file below another) is not checked here:
    a reader of the files reads them whole (``ManifestFiles``); this serves one that wants only
    the chunks of a few pieces (push: what a commit names beyond the pieces the remote has)."""
    return parse_files(_piece_doc(text), FILE_LIST_VERSION)


def piece_chunk_ids(text: bytes | memoryview) -> list[str]:
    """The chunk ids that the entries of one file-list piece name, in order: what gc needs of a
    kept commit (at 10^6 files, parsing every entry whole was half of gc). What the ids depend
    on is checked (each entry an object of a known kind, its chunk lists and references well
    formed, each id an object id); paths, sizes and tensor fields are not parsed, as gc does not
    use them. A piece whose entries parse whole gives exactly the ids of ``piece_files``."""
    out: list[str] = []
    for i, f in enumerate(_piece_doc(text)):
        kind = f.get("kind") if type(f) is dict else None
        if kind == "blob":
            lists = [f.get("chunks")]
        elif kind == "safetensors" and type(f.get("tensors")) is list:
            lists = [f.get("header"), *(t.get("chunks") if type(t) is dict else None for t in f["tensors"])]
        else:
            raise IntegrityError(f"file list piece: file #{i} is not an entry of a known kind")
        for refs in lists:
            if type(refs) is not list:
                raise IntegrityError(f"file list piece: file #{i} has a malformed chunk list")
            for ref in refs:
                if (
                    type(ref) is not list
                    or len(ref) != 2
                    or type(ref[0]) is not str
                    or type(ref[1]) is not int
                    or ref[1] < 1
                    or not is_object_id(ref[0])
                ):
                    raise IntegrityError(f"file list piece: file #{i} has a malformed chunk reference")
                out.append(ref[0])
    return out


def _piece_doc(text: bytes | memoryview) -> list[Any]:
    """One piece's entries as parsed JSON (pieces are whole entries, section 5.3)."""
    body = bytes(text)
    body = body[1:] if body.startswith(b"[") else body
    body = body[:-1] if body.endswith((b",", b"]")) else body
    check_shape(body)
    doc = parse_json(b"[" + body + b"]")
    if not isinstance(doc, list):  # cannot happen with the brackets above; kept for the type
        raise IntegrityError("file list piece is not a list of entries")
    return doc


def chunks_beyond(commit: Commit, pieces: Collection[str], read: ChunkReader) -> Iterator[ChunkRef]:
    """Every chunk ``commit`` needs (``all_chunks``) but those named only by file-list pieces
    in ``pieces``: a piece that another commit names holds the very same entries, so a caller
    who has that commit's chunks (a remote holding it whole, format.md 15.7) needs none of them.
    Reads (with ``read``) and parses only the other pieces; a chunk may still be listed that
    the known pieces name too (a file in a changed piece whose chunks did not change)."""
    if not any(p.id in pieces for p in commit.file_list):
        yield from commit.all_chunks()
        return
    for piece in commit.file_list:
        if piece.id in pieces:
            continue
        yield piece
        try:
            files = piece_files(read(piece))
        except IntegrityError as exc:
            raise IntegrityError(f"file list piece {piece.id}: {exc}") from None
        for f in files:
            yield from f.all_chunks()


def _chunks_json(chunks: Sequence[ChunkRef]) -> list[list[Any]]:
    return [[c.id, c.size] for c in chunks]


def _file_json(f: FileEntry) -> dict[str, Any]:
    out: dict[str, Any] = {"path": f.path, "kind": f.kind, "size": f.size}
    if f.kind == "safetensors":
        out["header"] = _chunks_json(f.header)
        out["tensors"] = [_tensor_json(t) for t in f.tensors]
    else:
        out["chunks"] = _chunks_json(f.chunks)
    return out


def _tensor_json(t: TensorEntry) -> dict[str, Any]:
    out: dict[str, Any] = {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "chunks": _chunks_json(t.chunks)}
    if t.stats is not None:
        from ckstore.format.tensor_stats import stats_json

        out["stats"] = stats_json(t.stats)
    return out


def _version(commit: Commit) -> int:
    if commit.dcp is not None:
        return 2
    return STATS_VERSION if any(t.stats is not None for f in commit.files for t in f.tensors) else 1


def _piece_cut(path: str) -> bool:
    import hashlib  # here: OpenSSL's load is 3-4 ms of every command that only reads manifests

    digest = hashlib.blake2b(path.encode("utf-8"), digest_size=2).digest()
    return int.from_bytes(digest, "big") < PIECE_CUT


def split_file_list(files: Sequence[FileEntry]) -> list[bytes]:
    """The canonical JSON text of ``files`` cut into pieces at entry boundaries (section 5.3):
    after an entry whose path's digest says so, or once a piece reaches PIECE_MAX_BYTES."""
    pieces: list[bytes] = []
    current: list[bytes] = [b"["]
    size = 1
    last = len(files) - 1
    for i, f in enumerate(files):
        text = canonical_json(_file_json(f)) + (b"," if i < last else b"]")
        current.append(text)
        size += len(text)
        if i < last and (_piece_cut(f.path) or size >= PIECE_MAX_BYTES):
            pieces.append(b"".join(current))
            current, size = [], 0
    if not files:
        current.append(b"]")
    pieces.append(b"".join(current))
    return pieces


def encode_commit_parts(commit: Commit) -> tuple[bytes, list[tuple[ChunkRef, bytes]]]:
    """(manifest, file-list pieces with their references): no pieces unless the file list is
    large enough to be stored apart (version 4). The caller stores the pieces as chunks before the
    manifest that names them; ``commit.file_list`` is ignored (the pieces are its value)."""
    if commit.dcp is None and commit.state is None:
        pieces = split_file_list(commit.files)
        if sum(map(len, pieces)) >= FILE_LIST_MIN_BYTES:
            from ckstore.format.ids import chunk_id  # blake3: only large commits pay its import here

            refs = [(ChunkRef(chunk_id(p), len(p)), p) for p in pieces]
            return _encode(commit, FILE_LIST_VERSION, {"file_list": _chunks_json([r for r, _ in refs])}), refs
    return encode_commit(commit), []


def encode_commit(commit: Commit) -> bytes:
    """The manifest of a commit whose file list is stored inside it (versions 1-3)."""
    return _encode(commit, _version(commit), None)


def _encode(commit: Commit, version: int, file_list: dict[str, Any] | None) -> bytes:
    if commit.dcp is not None and any(t.stats is not None for f in commit.files for t in f.tensors):
        raise ValueError("a distributed checkpoint's manifest (version 2) cannot carry tensor stats")
    doc: dict[str, Any] = {
        "ckstore": version,
        "parents": list(commit.parents),
        "time": commit.time,
        "branch": commit.branch,
        "message": commit.message,
        "metadata": commit.metadata,
        "provenance": dict(commit.provenance),
        "logical_bytes": commit.logical_bytes,
        "added_bytes": commit.added_bytes,
        "state": {"values": commit.state.values, "tensors": commit.state.tensors} if commit.state else None,
        "base": {"commit": commit.base.commit, "repo": commit.base.repo} if commit.base else None,
    }
    if file_list is not None:
        doc.update(file_list)
    else:
        doc["files"] = [_file_json(f) for f in commit.files]
    if commit.dcp is not None:
        files = doc.pop("files")
        from ckstore.format.dcp_record import record_json

        doc["dcp"] = record_json(commit.dcp)
        doc["files"] = files
    data = canonical_json(doc)
    try:
        check_shape(data)
    except IntegrityError as exc:  # readers would refuse it: it is never written
        raise InvalidInputError(f"commit refused: its {exc} (its metadata is the likely cause)") from None
    return data


def canonical_json(doc: Any) -> bytes:
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")


# ---- parsing -------------------------------------------------------------------------------


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)  # called for every JSON object: one C call, the loop only to name a duplicate
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise IntegrityError(f"duplicate key {key!r} in manifest")
            seen.add(key)
    return out


def _refuse_constant(name: str) -> float:
    raise IntegrityError(f"manifest holds the non-JSON constant {name}")


def check_shape(data: bytes) -> None:
    """Refuse (IntegrityError) manifest text that no real manifest can be, before parsing it."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise IntegrityError("manifest exceeds the size limit")
    # Parsed JSON costs memory per container: ``[[],[],…]`` takes about 20 times its text, a
    # real manifest (mostly 70-byte chunk references) about 3 times. Counted before parsing, so
    # a manifest bomb is refused at the cost of one scan of its text.
    containers = data.count(b"[") + data.count(b"{")
    if containers > MAX_DENSE_CONTAINERS + len(data) // MIN_CONTAINER_BYTES:
        raise IntegrityError(
            f"manifest holds {containers} JSON lists and objects in {len(data)} bytes, far more than a real one"
        )


def parse_json(data: bytes) -> Any:
    if len(data) > MAX_MANIFEST_BYTES:
        raise IntegrityError("manifest exceeds the size limit")
    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_refuse_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise IntegrityError(f"manifest is not valid JSON: {exc}") from None


def _parse_state(value: Any, files: Sequence[FileEntry]) -> StateFiles | None:
    if value is None:
        return None
    kinds = {f.path: f.kind for f in files}
    if (
        not isinstance(value, dict)
        or set(value) != {"values", "tensors"}
        or not all(isinstance(v, str) for v in value.values())  # a list would make kinds.get raise TypeError
        or kinds.get(value["values"]) != "blob"
        or kinds.get(value["tensors"]) != "safetensors"
    ):
        raise IntegrityError("manifest: malformed state record")
    return StateFiles(value["values"], value["tensors"])


def _parse_base(value: Any) -> BaseRef | None:
    if value is None:
        return None
    if (
        not isinstance(value, dict)
        or set(value) != {"commit", "repo"}
        or not isinstance(value["commit"], str)
        or not is_object_id(value["commit"])
        or not (
            value["repo"] is None
            or (isinstance(value["repo"], str) and value["repo"].startswith("/") and not CONTROL.search(value["repo"]))
        )
    ):
        raise IntegrityError("manifest: malformed base record")
    return BaseRef(ObjectId(value["commit"]), value["repo"])


def _parse_dcp(value: Any, files: Sequence[FileEntry]) -> DcpRecord:
    stored = {(f.path, t.name): (t.dtype, t.shape) for f in files for t in f.tensors}
    from ckstore.format.dcp_record import parse_record

    return parse_record(value, stored)


_COMMIT_FIELDS = (
    "ckstore",
    "parents",
    "time",
    "branch",
    "message",
    "metadata",
    "provenance",
    "logical_bytes",
    "added_bytes",
    "state",
    "base",
    "files",
)
_COMMIT_FIELDS_V2 = (*_COMMIT_FIELDS[:-1], "dcp", "files")
_COMMIT_FIELDS_V4 = (*_COMMIT_FIELDS[:-1], "file_list")
_EXPECTED_FIELDS = {2: _COMMIT_FIELDS_V2, FILE_LIST_VERSION: _COMMIT_FIELDS_V4}


def decode_commit(data: bytes, lazy_files: str | None = None, read: ChunkReader | None = None) -> Commit:
    """Parse and validate a manifest. With ``lazy_files`` (a label such as "commit <id>"), the
    file entries are validated on first use instead, and their errors name that label: every
    other field is checked now (docs/format.md section 5, "Readers"). ``read`` reads the file
    list of a version-4 manifest (section 5.3): always on first use of ``files``, and then only
    when ``lazy_files`` is not given."""
    check_shape(data)
    doc = parse_json(data)
    if not isinstance(doc, dict):
        raise IntegrityError("manifest is not a JSON object")
    version = expect_field(doc, "ckstore", int, "manifest")
    if version > MANIFEST_VERSION:
        raise UnsupportedFormatError(f"manifest version {version} is newer than this ckstore reads")
    if tuple(doc) != _EXPECTED_FIELDS.get(version, _COMMIT_FIELDS):
        raise IntegrityError("manifest fields are missing, unexpected or out of order")
    parents = expect_field(doc, "parents", list, "manifest")
    if not all(isinstance(p, str) and is_object_id(p) for p in parents):
        raise IntegrityError("manifest: malformed parent id")
    provenance = expect_field(doc, "provenance", dict, "manifest")
    if not all(isinstance(v, str) for v in provenance.values()):
        raise IntegrityError("manifest: provenance values must be strings")
    files: Sequence[FileEntry]
    pieces: tuple[ChunkRef, ...] = ()
    if version == FILE_LIST_VERSION:
        pieces = parse_chunks(doc["file_list"], "manifest: file_list")
        if not pieces or sum(p.size for p in pieces) > MAX_MANIFEST_BYTES:
            raise IntegrityError("manifest: file_list is empty or exceeds the manifest size limit")
        if doc["state"] is not None:
            raise IntegrityError("manifest: a version-4 manifest cannot hold a state record")
        files = ManifestFiles(None, version, lazy_files or "manifest", pieces, read)
        if lazy_files is None:
            files.load()
    # The state and dcp records are checked against the files: a commit with one parses them now.
    elif lazy_files is not None and doc["state"] is None and version != 2:
        files = ManifestFiles(expect_field(doc, "files", list, "manifest"), version, lazy_files)
    else:
        files = parse_files(expect_field(doc, "files", list, "manifest"), version)
    try:
        datetime.fromisoformat(expect_field(doc, "time", str, "manifest"))
    except ValueError:
        raise IntegrityError("manifest: time is not an ISO 8601 timestamp") from None
    commit = Commit(
        parents=tuple(ObjectId(p) for p in parents),
        time=expect_field(doc, "time", str, "manifest"),
        message=expect_field(doc, "message", str, "manifest"),
        branch=expect_field(doc, "branch", str, "manifest"),
        files=files,
        metadata=expect_field(doc, "metadata", (dict, list), "manifest"),
        provenance=provenance,
        logical_bytes=size_field(doc["logical_bytes"], "manifest"),
        added_bytes=size_field(doc["added_bytes"], "manifest"),
        state=_parse_state(doc["state"], files),
        base=_parse_base(doc["base"]),
        dcp=None if version != 2 else _parse_dcp(doc["dcp"], files),
        file_list=pieces,
    )
    commit.decoded_metadata()  # validates the typed encoding now, not at first display
    return commit
