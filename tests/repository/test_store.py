"""The object store: dedup, verified reads, errors that name the object and its context."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckstore.backend.local import LocalBackend
from ckstore.backend.memory import MemoryBackend
from ckstore.codecs.objects import Encoding, Kind, parse_header
from ckstore.errors import IntegrityError, ObjectMissingError
from ckstore.format.ids import chunk_id
from ckstore.format.manifest import Commit, encode_commit
from ckstore.repo import Repo
from ckstore.repository.store import ObjectStore, object_key
from tests.helpers import flip_bit

CONTEXT = " (file 'model.safetensors', tensor 'w')"


@pytest.fixture
def local_store(tmp_path: Path) -> ObjectStore:
    return ObjectStore(LocalBackend(tmp_path))


def test_put_is_deduplicated() -> None:
    store = ObjectStore(MemoryBackend())
    first = store.put_chunk(b"x" * 10_000)
    again = store.put_chunk(b"x" * 10_000)
    assert first.id == again.id == chunk_id(b"x" * 10_000)
    assert first.stored == store.stored_size(first.id) > 0
    assert again.stored == 0
    assert list(store.iter_ids()) == [first.id]
    assert store.get_chunk(first.id, 10_000) == b"x" * 10_000


def test_iter_ids_with_prefix() -> None:
    store = ObjectStore(MemoryBackend())
    ids = sorted(store.put_chunk(bytes([i])).id for i in range(40))
    assert sorted(store.iter_ids()) == ids
    assert list(store.iter_ids(ids[0][:7])) == [ids[0]]
    assert sorted(store.iter_ids(ids[0][:2])) == [i for i in ids if i[:2] == ids[0][:2]]


@pytest.mark.parametrize("compressible", [True, False])
def test_flipped_bit_names_object_and_context(local_store: ObjectStore, tmp_path: Path, compressible: bool) -> None:
    raw = bytes(50_000) if compressible else os.urandom(50_000)
    oid = local_store.put_chunk(raw).id
    flip_bit(tmp_path / object_key(oid), -10)  # inside the body, past the header
    with pytest.raises(IntegrityError) as info:
        local_store.get_chunk(oid, len(raw), CONTEXT)
    assert oid in str(info.value) and CONTEXT.strip() in str(info.value)
    with pytest.raises(IntegrityError, match=oid):
        local_store.verify(oid)


def test_raw_chunk_bit_flip_caught_by_hash(local_store: ObjectStore, tmp_path: Path) -> None:
    raw = os.urandom(1000)  # stored raw: only the hash check can notice the change
    oid = local_store.put_chunk(raw).id
    flip_bit(tmp_path / object_key(oid), 100)
    with pytest.raises(IntegrityError, match="do not hash to its name"):
        local_store.get_chunk(oid, len(raw), CONTEXT)


def test_wrong_size_and_missing_object(local_store: ObjectStore) -> None:
    oid = local_store.put_chunk(b"abc" * 100).id
    with pytest.raises(IntegrityError, match=oid):
        local_store.get_chunk(oid, 299, CONTEXT)
    missing = "ab" * 32
    with pytest.raises(ObjectMissingError) as info:
        local_store.get_chunk(missing, 10, CONTEXT)
    assert missing in str(info.value) and "tensor 'w'" in str(info.value)


def test_object_stored_under_another_name_is_refused(local_store: ObjectStore, tmp_path: Path) -> None:
    # A valid object copied under a foreign name decodes fine but fails the name check.
    a = local_store.put_chunk(b"a" * 100).id
    b = local_store.put_chunk(b"b" * 100).id
    (tmp_path / object_key(b)).write_bytes((tmp_path / object_key(a)).read_bytes())
    with pytest.raises(IntegrityError, match=b):
        local_store.get_chunk(b, 100)


def test_chunk_and_commit_names_never_collide() -> None:
    store = ObjectStore(MemoryBackend())
    manifest = encode_commit(Commit(parents=(), time="2024-01-01T00:00:00Z", message="m", branch="main", files=()))
    as_commit = store.put_commit(manifest)
    as_chunk = store.put_chunk(manifest)  # a user file whose bytes are exactly a manifest
    assert as_commit.id != as_chunk.id
    assert as_chunk.stored > 0  # not deduplicated against the commit
    assert store.get_commit(as_commit.id) == manifest
    assert store.get_chunk(as_chunk.id, len(manifest)) == manifest
    assert store.kind(as_commit.id) == Kind.COMMIT and store.kind(as_chunk.id) == Kind.CHUNK
    with pytest.raises(IntegrityError):
        store.get_commit(as_chunk.id)
    with pytest.raises(IntegrityError):
        store.get_chunk(as_commit.id, len(manifest))
    store.verify(as_commit.id)
    store.verify(as_chunk.id)


def test_delete() -> None:
    store = ObjectStore(MemoryBackend())
    oid = store.put_chunk(b"abc").id
    assert store.delete(oid) and not store.has(oid) and not store.delete(oid)


def test_delta_bases_of_many_objects_match_one_at_a_time(local_store: ObjectStore) -> None:
    """The batched header reads (on threads, in batches) give each object's own bases, in order,
    and chains are followed to their whole objects; a missing object has none."""
    import numpy as np

    rng = np.random.default_rng(0)
    base = rng.standard_normal(4096).astype(np.float32)
    whole, deltas = [], []
    for i in range(300):  # more than two batches
        first = base + np.float32(i)
        whole.append(local_store.put_chunk(first.tobytes(), width=4).id)
        near = first.copy()
        near[i] += 1
        deltas.append(local_store.put_chunk(near.tobytes(), width=4, base_id=whole[-1]).id)
    missing = chunk_id(b"never stored")
    asked = [*deltas, missing, *whole]
    batched = list(local_store.bases_of_many(asked))
    assert [oid for oid, _ in batched] == asked
    assert dict(batched) == {**{oid: local_store.bases_of(oid) for oid in deltas + whole}, missing: ()}
    assert sum(1 for oid in deltas if local_store.bases_of(oid)) > 250  # most are deltas indeed
    assert local_store.with_delta_bases(deltas) == set(deltas) | {b for d in deltas for b in local_store.bases_of(d)}


@pytest.mark.parametrize("kind", ["zeros", "random", "random head, zeros after"])
def test_fast_put_stores_raw_only_what_does_not_compress(kind: str) -> None:
    """A commit's fast encoding skips zstd on chunks whose sample does not compress (fp32
    weights), yet every chunk reads back bit-exact and a compressible one is still compressed."""
    from ckstore.codecs.objects import SAMPLE_BYTES, Encoding, parse_header

    n = 1 << 20
    noise = os.urandom(n)
    raw = {
        "zeros": bytes(n),
        "random": noise,
        "random head, zeros after": noise[:SAMPLE_BYTES] + bytes(n - SAMPLE_BYTES),
    }[kind]
    store = ObjectStore(MemoryBackend())
    result = store.put_chunk(raw, width=4, fast=True)
    encoding = parse_header(store.read_raw(result.id)).encoding
    # The sample decides: a chunk whose head is noise is stored raw even if its tail is zeros.
    assert encoding == (Encoding.ZSTD if kind == "zeros" else Encoding.RAW)
    assert result.stored < n // 100 if kind == "zeros" else result.stored > n
    assert store.get_chunk(result.id, n) == raw


def _outcome(value: object) -> object:
    return (type(value).__name__, str(value)) if isinstance(value, Exception) else value


def test_headers_read_together_agree_with_one_by_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gc, stats and fsck read every header at once (``Backend.object_prefixes``: each pack opened
    once); what they find is what ``bases_of`` finds one object at a time: packed whole objects
    and deltas, a loose copy shadowing a packed one, a damaged header in a pack, a missing object."""
    import numpy as np

    from ckstore.backend.local_packs import PACK_FOLDER
    from ckstore.repo import Repo

    monkeypatch.setattr(LocalBackend, "BULK_MIN", 0)
    repo = Repo.init(tmp_path / "r")
    store = repo.store
    rng = np.random.default_rng(0)
    base = rng.standard_normal(1024).astype(np.float32)
    whole, deltas = [], []
    with store.batch(expected_objects=400) as view:  # 64 objects or more: one pack
        for i in range(150):
            first = base + np.float32(i)
            whole.append(view.put_chunk(first.tobytes(), width=4).id)
            near = first.copy()
            near[i] += 1
            deltas.append(view.put_chunk(near.tobytes(), width=4, base_id=whole[-1]).id)
    packs = sorted((repo.path / PACK_FOLDER).glob("*.pack"))  # type: ignore[operator]
    assert len(packs) == 1 and not (repo.path / object_key(whole[0])).exists()  # type: ignore[operator]
    shadowed = whole[0]  # a loose copy is read first (a replaced object): here a damaged one
    (repo.path / object_key(shadowed)).parent.mkdir(parents=True, exist_ok=True)  # type: ignore[operator]
    (repo.path / object_key(shadowed)).write_bytes(b"XXXX" + store.read_raw(shadowed)[4:])  # type: ignore[operator]
    damaged = deltas[1]
    entry = repo.backend.packs.locate(damaged).entry  # type: ignore[attr-defined]
    flip_bit(packs[0], entry.offset + 4)  # its version byte
    loose = store.put_chunk(os.urandom(3000)).id
    missing = chunk_id(b"never stored")
    asked = [*deltas, missing, *whole, loose]
    repo = Repo(repo.path)  # tables read from the packs' tails (arrays), as another process reads them
    store = repo.store

    assert set(repo.backend.object_prefixes(asked, 64)) == {*deltas, *whole[1:]}  # packed only
    together = [(oid, _outcome(v)) for oid, v in store.bases_or_errors(asked)]
    monkeypatch.setattr(LocalBackend, "BULK_MIN", 10**9)
    assert repo.backend.object_prefixes(asked, 64) == {}
    one_by_one = [(oid, _outcome(v)) for oid, v in store.bases_or_errors(asked)]
    assert together == one_by_one
    outcome = dict(together)
    assert outcome[missing][0] == "ObjectMissingError" and outcome[shadowed][0] == "IntegrityError"
    assert outcome[damaged][0] == "IntegrityError" and outcome[loose] == ()
    assert sum(1 for oid in deltas if outcome[oid] == (whole[deltas.index(oid)],)) > 100  # deltas indeed


def test_object_sizes_in_one_pass_are_each_objects_size(tmp_path: Path) -> None:
    from ckstore.repo import Repo

    repo = Repo.init(tmp_path / "r")
    with repo.store.batch(expected_objects=100) as view:
        packed = [view.put_chunk(os.urandom(100 + i)).id for i in range(100)]
    loose = repo.store.put_chunk(os.urandom(5000)).id
    sizes = repo.store.stored_sizes()
    assert set(sizes) == set(repo.store.iter_ids()) == {*packed, loose}
    assert sizes == {oid: repo.store.stored_size(oid) for oid in sizes}
    assert sizes == {oid: n for oid, n in super(LocalBackend, repo.backend).object_sizes().items()}  # type: ignore[misc]


@given(
    st.sampled_from([b"CKSO", b"CKSX"]),
    st.sampled_from([0, 1, 2]),
    st.sampled_from([0, 1, 2, 3]),
    st.integers(0, 7),
    st.sampled_from([0, 1]),
    st.binary(max_size=150),
)
def test_a_header_read_as_whole_is_what_the_codec_says(
    magic: bytes, version: int, kind: int, encoding: int, reserved: int, rest: bytes
) -> None:
    """The shortcut for whole objects' headers (store.bases_in) agrees with ``delta_bases``."""
    from ckstore.codecs.objects import HEADER, delta_bases
    from ckstore.repository.store import bases_in

    prefix = (HEADER.pack(magic, version, kind, encoding, reserved, len(rest)) + rest)[: 16 + len(rest) % 200]
    got = bases_in("ab" * 32, prefix)
    try:
        expected: object = delta_bases(prefix)
    except IntegrityError as exc:
        expected = ("IntegrityError", f"object {'ab' * 32} is corrupt: {exc}")
    assert _outcome(got) == expected


def test_commits_among_many_objects_read_together_or_one_by_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gc names the commits it deletes from their headers, read together (packs) or one by one
    (loose, damaged): the same answer either way."""
    from ckstore.repo import Repo

    repo = Repo.init(tmp_path / "r")
    folder = tmp_path / "f"
    folder.mkdir()
    for i in range(80):  # 64 files or more: one pack
        (folder / f"{i:03d}.txt").write_text(f"file {i}\n")
    commit = repo.commit(folder, message="many files")
    (folder / "000.txt").write_text("changed\n")
    loose_commit = repo.commit(folder, message="one change")
    repo.wait()
    chunks = [c.id for c in repo.read_commit(commit).all_chunks()]
    damaged = repo.backend.packs.locate(chunks[5])  # type: ignore[attr-defined]
    flip_bit(damaged.path, damaged.entry.offset)  # its magic
    asked = [*chunks, commit, loose_commit, chunk_id(b"never stored")]
    monkeypatch.setattr(LocalBackend, "BULK_MIN", 0)
    assert repo.backend.object_prefixes(chunks, 16)  # read together indeed
    together = repo.store.commits_among(asked)
    monkeypatch.setattr(LocalBackend, "BULK_MIN", 10**9)
    assert together == repo.store.commits_among(asked) == {commit, loose_commit}


def test_a_file_list_piece_that_compresses_too_well_is_stored_raw_and_reads_back(repo: Repo) -> None:
    from ckstore.format.manifest import ChunkRef
    from ckstore.repository.reader import MANIFEST_RATIO, bounded_file_list_reader

    dense = b"[" + b'{"path":"same","kind":"blob","size":1,"chunks":[]},' * 400_000  # about 20 MiB, 1000:1 in zstd
    plain = os.urandom(1 << 18).hex().encode()  # as random as chunk ids: about 2:1
    for piece in (dense, plain):
        put = repo.store.put_file_list_piece(piece)
        stored = repo.store.stored_size(put.id)
        assert stored is not None and len(piece) <= MANIFEST_RATIO * stored
        read = bounded_file_list_reader(lambda oid: repo.store.read_raw(oid), repo.store.reader(), "")
        assert bytes(read(ChunkRef(put.id, len(piece)))) == piece
    assert parse_header(repo.store.read_raw(chunk_id(dense))).encoding == Encoding.RAW
    assert parse_header(repo.store.read_raw(chunk_id(plain))).encoding != Encoding.RAW
