"""Commit manifests: canonical round trip and strict refusal of anything malformed or hostile."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckstore.errors import CkstoreError, IntegrityError
from ckstore.format.ids import chunk_id
from ckstore.format.manifest import (
    ChunkRef,
    Commit,
    FileEntry,
    TensorEntry,
    canonical_json,
    decode_commit,
    encode_commit,
)
from ckstore.format.values import encode_value

A, B, C = (chunk_id(bytes([i])) for i in range(3))


def sample_commit() -> Commit:
    weights = FileEntry(
        "model/model.safetensors",
        "safetensors",
        100 + 24 + 8,
        header=(ChunkRef(A, 100),),
        tensors=(
            TensorEntry("w", "F32", (2, 3), (ChunkRef(B, 16), ChunkRef(C, 8))),
            TensorEntry("flag", "BOOL", (8,), (ChunkRef(C, 8),)),
            TensorEntry("empty", "F16", (0, 4), ()),
        ),
    )
    config = FileEntry("model/config.json", "blob", 16, chunks=(ChunkRef(B, 16),))
    return Commit(
        parents=(chunk_id(b"parent"),),
        time="2024-05-01T12:00:00.000001Z",
        message="épоch 3 ✓",
        branch="main",
        files=(config, weights),
        metadata=encode_value({"epoch": 3, "lr": 1e-4, "final": False, "tags": ["a", "b"]}),
        provenance={"ckstore": "0.1.0", "python": "3.11"},
        logical_bytes=148,
        added_bytes=64,
    )


BASE = encode_commit(sample_commit())


def edited(edit: Callable[[dict[str, Any]], None]) -> bytes:
    """The sample manifest with its JSON changed by ``edit``, re-serialised canonically."""
    doc = json.loads(BASE)
    edit(doc)
    return canonical_json(doc)


def weights(doc: dict[str, Any]) -> dict[str, Any]:
    return next(f for f in doc["files"] if f["kind"] == "safetensors")


def test_round_trip() -> None:
    commit = sample_commit()
    decoded = decode_commit(BASE)
    assert decoded == commit
    assert encode_commit(decoded) == BASE
    assert decoded.decoded_metadata() == {"epoch": 3, "lr": 1e-4, "final": False, "tags": ["a", "b"]}


def test_duplicate_keys_refused() -> None:
    doubled = BASE.replace(b'"branch":"main"', b'"branch":"main","branch":"main"', 1)
    assert doubled != BASE
    with pytest.raises(IntegrityError, match="duplicate"):
        decode_commit(doubled)
    nested = BASE.replace(b'"kind":"blob"', b'"kind":"blob","kind":"blob"', 1)
    with pytest.raises(IntegrityError, match="duplicate"):
        decode_commit(nested)


def test_field_order_enforced() -> None:
    doc = json.loads(BASE)
    keys = list(doc)
    keys[1], keys[2] = keys[2], keys[1]
    with pytest.raises(IntegrityError, match="order"):
        decode_commit(canonical_json({k: doc[k] for k in keys}))


def test_non_json_and_constants_refused() -> None:
    for data in (b"", b"[]", b"\xff\xfe", BASE[:-1], BASE.replace(b'"added_bytes":64', b'"added_bytes":NaN')):
        with pytest.raises(IntegrityError):
            decode_commit(data)


BAD_EDITS: dict[str, Callable[[dict[str, Any]], None]] = {
    "parent id uppercase": lambda d: d.update(parents=[d["parents"][0].upper()]),
    "parent id short": lambda d: d.update(parents=["abc"]),
    "parent not a string": lambda d: d.update(parents=[1]),
    "chunk id bad": lambda d: weights(d)["header"][0].__setitem__(0, "x" * 64),
    "chunk ref too long": lambda d: weights(d)["header"][0].append(1),
    "chunk size zero": lambda d: weights(d)["header"].append([A, 0]),
    "chunk size bool": lambda d: weights(d)["tensors"][1]["chunks"][0].__setitem__(1, True),
    "chunk size negative": lambda d: weights(d)["header"][0].__setitem__(1, -100),
    "file size mismatch": lambda d: weights(d).update(size=weights(d)["size"] + 1),
    "tensor bytes mismatch shape": lambda d: weights(d)["tensors"][0].update(shape=[2, 4]),
    "unknown dtype": lambda d: weights(d)["tensors"][0].update(dtype="F128"),
    "shape with bool": lambda d: weights(d)["tensors"][1].update(shape=[True]),
    "duplicate tensor": lambda d: weights(d)["tensors"].append(weights(d)["tensors"][1]),
    "extra tensor field": lambda d: weights(d)["tensors"][0].update(offset=0),
    "unknown kind": lambda d: d["files"][0].update(kind="symlink"),
    "extra file field": lambda d: d["files"][0].update(mode=0o755),
    "duplicate path": lambda d: d["files"][1].update(path=d["files"][0]["path"]),
    "missing field": lambda d: d.pop("message"),
    "extra field": lambda d: d.update(extra=1),
    "bad time": lambda d: d.update(time="yesterday"),
    "logical bytes float": lambda d: d.update(logical_bytes=1.5),
    "provenance non-string": lambda d: d["provenance"].update(python=3),
    "metadata not mapping": lambda d: d.update(metadata=[1, 2]),
    "metadata bad tag": lambda d: d["metadata"].update(bad={"$int": "12"}),
    "message not a string": lambda d: d.update(message=None),
    "state path not a string": lambda d: d.update(state={"values": ["x"], "tensors": "model/model.safetensors"}),
}


@pytest.mark.parametrize("edit", BAD_EDITS.values(), ids=BAD_EDITS.keys())
def test_malformed_manifests_refused(edit: Callable[[dict[str, Any]], None]) -> None:
    with pytest.raises(IntegrityError):
        decode_commit(edited(edit))


@pytest.mark.parametrize("edit", BAD_EDITS.values(), ids=BAD_EDITS.keys())
def test_lazy_files_refuse_the_same_manifests_by_first_use(edit: Callable[[dict[str, Any]], None]) -> None:
    # log reads headers with the files unparsed: a damaged file entry must still be refused,
    # naming the commit, as soon as anything reads the files.
    with pytest.raises(IntegrityError):
        commit = decode_commit(edited(edit), lazy_files="commit abc123")
        list(commit.files)


def test_lazy_files_are_parsed_on_first_use_and_equal_the_eager_ones() -> None:
    damaged = edited(lambda d: weights(d).update(size=weights(d)["size"] + 1))
    header = decode_commit(damaged, lazy_files="commit abc123")  # the header alone is sound
    assert header.message == "épоch 3 ✓" and header.logical_bytes == 148
    with pytest.raises(IntegrityError, match="^commit abc123: file 'model/model.safetensors'"):
        len(header.files)
    lazy, eager = decode_commit(BASE, lazy_files="commit abc123"), decode_commit(BASE)
    assert lazy == eager and eager == lazy
    assert len(lazy.files) == 2 and lazy.files[1] == eager.files[1] and list(lazy.files) == list(eager.files)
    assert lazy.files[:1] == eager.files[:1] and encode_commit(lazy) == BASE


@pytest.mark.parametrize(
    "path",
    [
        "../x",
        "a/../../x",
        "/abs",
        "C:\\x",
        "C:x",
        "\\\\host\\share",
        "a\\b",
        "a\x00b",
        "a\nb",
        "a\x7fb",
        "a//b",
        "a/",
        "./a",
        "a/./b",
        "",
        "..",
    ],
)
def test_hostile_paths_refused(path: str) -> None:
    with pytest.raises(IntegrityError, match="file"):
        decode_commit(edited(lambda d: d["files"][0].update(path=path)))


def test_path_below_another_file_refused() -> None:
    def nest(d: dict[str, Any]) -> None:
        d["files"][0]["path"] = "model"  # the other file is model/model.safetensors

    with pytest.raises(IntegrityError, match="below another file"):
        decode_commit(edited(nest))


def test_newer_version_is_unsupported_not_corrupt() -> None:
    from ckstore.errors import UnsupportedFormatError

    with pytest.raises(UnsupportedFormatError):
        decode_commit(edited(lambda d: d.update(ckstore=5)))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_byte_mutations_raise_only_ckstore_errors(data: st.DataObject) -> None:
    raw = bytearray(BASE)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        op = data.draw(st.sampled_from(["set", "insert", "delete"]))
        if op == "set":
            raw[i] = data.draw(st.integers(0, 255))
        elif op == "insert":
            raw[i:i] = data.draw(st.binary(min_size=1, max_size=4))
        else:
            del raw[i]
    try:
        decode_commit(bytes(raw))
    except CkstoreError:
        pass


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


def _containers(value: Any, out: list[Any]) -> list[Any]:
    if isinstance(value, (dict, list)):
        out.append(value)
        for child in value.values() if isinstance(value, dict) else value:
            _containers(child, out)
    return out


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_json_mutations_raise_only_ckstore_errors(data: st.DataObject) -> None:
    # Structured mutations reach the field validators that byte noise rarely gets past JSON for.
    doc = json.loads(BASE)
    target = data.draw(st.sampled_from(_containers(doc, [])))
    replacement = data.draw(JSON_VALUES)
    if isinstance(target, dict):
        target[data.draw(st.sampled_from(sorted(target)))] = replacement
    elif target:
        target[data.draw(st.integers(0, len(target) - 1))] = replacement
    for lazy in (None, "commit abc123"):
        try:
            list(decode_commit(canonical_json(doc), lazy_files=lazy).files)
        except CkstoreError:
            pass


# The plain-blob fast path (manifest_entries._plain_blob) must accept exactly a subset of what the
# general parser accepts, and build the same entry: validation stays as strict. Documents are
# well-formed blob entries with one or two fields replaced by near misses.
_ID = "ab" * 32
_near_misses: dict[str, Any] = {
    "path": st.one_of(
        st.sampled_from(
            [
                "a.txt",
                "d/e/f.bin",
                ".hidden",
                "x+y@z=1-2_3.txt",
                "a/.../b",
                "..a/b..",
                "a/./b",
                "a/../b",
                "..",
                ".",
                "/abs",
                "a//b",
                "C:x",
                "a\\b",
                "a\x00b",
                "ü/ß",
                "a/",
                "./a",
                "",
            ]
        ),
        st.text(alphabet="ab./\\:\x01-_", max_size=8),
        st.integers(),
        st.none(),
    ),
    "kind": st.sampled_from(["safetensors", "other", 1, None]),
    "size": st.sampled_from([-1, 0, True, False, 1 << 63, (1 << 63) - 1, 1.0, "3", None]),
    "chunks": st.one_of(
        st.lists(
            st.one_of(
                st.tuples(
                    st.sampled_from([_ID, "AB" * 32, "ab" * 31, _ID + "0", 5]),
                    st.sampled_from([0, -1, 1, 2, True, 1 << 63, (1 << 63) - 1, 1.0, None]),
                ).map(list),
                st.sampled_from([[_ID], [_ID, 1, 2], (_ID, 1), "x", None]),
            ),
            max_size=3,
        ),
        st.sampled_from([None, "x", {}, ()]),
    ),
    "extra": st.just(1),
}


@settings(max_examples=300)
@given(
    sizes=st.lists(st.integers(1, 5), max_size=3),
    changes=st.dictionaries(st.sampled_from(sorted(_near_misses)), st.none(), max_size=2),
    data=st.data(),
)
def test_plain_blob_path_accepts_only_what_the_general_parser_accepts(
    sizes: list[int], changes: dict[str, None], data: st.DataObject
) -> None:
    from ckstore.format.manifest_entries import _parse_any_file, _plain_blob

    doc: dict[str, Any] = {"path": "d/f.bin", "kind": "blob", "size": sum(sizes), "chunks": [[_ID, n] for n in sizes]}
    for field_name in changes:
        doc[field_name] = data.draw(_near_misses[field_name], label=field_name)
    if "size" not in changes and isinstance(doc["chunks"], list):  # sizes that add up, whatever the chunks hold
        doc["size"] = sum(c[1] for c in doc["chunks"] if isinstance(c, list) and len(c) == 2 and isinstance(c[1], int))
    dropped = data.draw(st.booleans(), label="drop a field")
    if dropped:
        del doc[data.draw(st.sampled_from(sorted(doc)), label="dropped")]
    plain = _plain_blob(doc)
    try:
        general: FileEntry | None = _parse_any_file(doc, 0, 3)
    except IntegrityError:
        general = None
    if plain is not None:
        assert general == plain
    assert plain is not None or changes or dropped  # an untouched entry takes the fast path


_GOOD = {"path": "d/f.bin", "kind": "blob", "size": 3, "chunks": [[_ID, 1], [_ID, 2]]}


@pytest.mark.parametrize(
    "change",
    [
        {"chunks": [["AB" * 32, 1], [_ID, 2]]},
        {"chunks": [["ab" * 31, 1], [_ID, 2]]},
        {"chunks": [[_ID, 0], [_ID, 3]]},
        {"chunks": [[_ID, True], [_ID, 2]]},
        {"chunks": [[_ID, 1.0], [_ID, 2]]},
        {"chunks": [[_ID, 1, 0], [_ID, 2]]},
        {"size": 1 << 63, "chunks": [[_ID, (1 << 63) - 1], [_ID, 1]]},
        {"size": True, "chunks": [[_ID, 1]]},
        {"path": "a/../b"},
        {"path": "./b"},
        {"path": ""},
        {"path": "/abs"},
        {"path": "C:x"},
        {"path": "a\\b"},
        {"path": "a\x00b"},
        {"path": "a//b"},
        {"path": "a/"},
        {"kind": "safetensors"},
        {"extra": 1},
    ],
)
def test_plain_blob_path_refuses_near_misses(change: dict[str, Any]) -> None:
    """Each is refused by the general parser (or, for ``extra``, by its field check)."""
    from ckstore.format.manifest_entries import _parse_any_file, _plain_blob

    doc = {**_GOOD, **change}
    assert _plain_blob(doc) is None
    with pytest.raises(IntegrityError):
        _parse_any_file(doc, 0, 3)


def test_plain_blob_path_takes_the_common_entry() -> None:
    from ckstore.format.manifest_entries import _plain_blob

    doc = {"path": "0000/0000001.txt", "kind": "blob", "size": 5, "chunks": [[_ID, 2], [_ID, 3]]}
    assert _plain_blob(doc) == FileEntry("0000/0000001.txt", "blob", 5, chunks=(ChunkRef(_ID, 2), ChunkRef(_ID, 3)))
    assert _plain_blob({**doc, "size": 6}) is None and _plain_blob({**doc, "path": "a/../b"}) is None
