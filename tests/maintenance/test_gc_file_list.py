"""gc reads a version-4 file list (docs/format.md 5.3) for its chunk ids alone, each shared piece
once (``piece_chunk_ids``, maintenance/kept.py): at 10^6 files, parsing every entry whole was half
of gc. The ids it takes are exactly those of the entries parsed whole."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckstore.errors import IntegrityError
from ckstore.format import manifest
from ckstore.format.manifest import ChunkRef, FileEntry, TensorEntry, piece_chunk_ids, piece_files, split_file_list
from ckstore.repo import Repo
from tests.helpers import commit_many_files, counting_parsed_entries

ids = st.binary(min_size=32, max_size=32).map(bytes.hex)
refs = st.lists(st.tuples(ids, st.integers(1, 9)).map(lambda t: ChunkRef(*t)), min_size=1, max_size=3)


@st.composite
def entries(draw: st.DrawFn) -> list[FileEntry]:
    out = []
    for i in range(draw(st.integers(1, 40))):
        path = f"d{i % 3}/{i:04d}.bin"
        if draw(st.booleans()):
            chunks = tuple(draw(refs))
            out.append(FileEntry(path, "blob", sum(c.size for c in chunks), chunks=chunks))
            continue
        header = tuple(draw(refs))
        tensors = tuple(
            TensorEntry(f"t{j}", "U8", (sum(c.size for c in cs),), cs)
            for j, cs in enumerate(tuple(draw(refs)) for _ in range(draw(st.integers(0, 3))))
        )
        size = sum(c.size for c in header) + sum(t.nbytes for t in tensors)
        out.append(FileEntry(path, "safetensors", size, header=header, tensors=tensors))
    return sorted(out, key=lambda f: f.path)


@settings(max_examples=60, deadline=None)
@given(entries())
def test_the_ids_of_each_piece_are_those_of_its_entries_parsed_whole(files: list[FileEntry]) -> None:
    with mock.patch.object(manifest, "PIECE_CUT", 1 << 14):  # a cut after about one entry in four
        pieces = split_file_list(files)
    assert b"".join(pieces).startswith(b"[") and len(pieces) >= 1
    for piece in pieces:
        assert piece_chunk_ids(piece) == [c.id for f in piece_files(piece) for c in f.all_chunks()]
    assert [i for p in pieces for i in piece_chunk_ids(p)] == [c.id for f in files for c in f.all_chunks()]


@pytest.mark.parametrize(
    "piece",
    [
        b'[{"path":"a","kind":"blob","size":1,"chunks":[["zz",1]]}]',  # not an object id
        b'[{"path":"a","kind":"blob","size":1,"chunks":[["' + b"ab" * 32 + b'",0]]}]',  # an empty chunk
        b'[{"path":"a","kind":"blob","size":1,"chunks":"' + b"ab" * 32 + b'"}]',  # not a list of references
        b'[{"path":"a","kind":"tree","size":1,"chunks":[]}]',  # an unknown kind
        b'[{"path":"a","kind":"safetensors","size":1,"header":[],"tensors":[{"chunks":7}]}]',
        b'["a"]',
        b'[{"path":"a","kind":"blob"',  # cut short
    ],
)
def test_a_malformed_piece_is_refused(piece: bytes) -> None:
    with pytest.raises(IntegrityError):
        piece_chunk_ids(piece)


def test_gc_parses_no_entry_of_a_version_4_file_list_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = Repo.init(tmp_path / "repo")
    first = commit_many_files(repo, 3000)
    second = commit_many_files(repo, 3000, changed=7)
    repo.create_branch("old", first)
    assert repo.read_commit(second).file_list  # stored apart
    gone = commit_many_files(repo, 3000, changed=8)
    repo.reset(second)
    with counting_parsed_entries(monkeypatch) as parsed:
        report = Repo(repo.path).gc(prune_now=True)
    assert parsed[0] == 0
    assert gone in report.unreachable_commits and report.deleted_objects >= 3  # it, its changed file and piece
    fresh = Repo(repo.path)
    assert fresh.fsck(read_data=True) == []
    fresh.checkout(second, tmp_path / "out")
    assert (tmp_path / "out" / "000" / "00007.txt").read_text() == "object 7 changed\n"
    assert (tmp_path / "out" / "000" / "00008.txt").read_text() == "object 8\n"
