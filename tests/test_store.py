"""The object store: dedup, verified reads, errors that name the object and its context."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckstore.backend.local import LocalBackend
from ckstore.backend.memory import MemoryBackend
from ckstore.codecs.objects import Kind
from ckstore.errors import IntegrityError, ObjectMissingError
from ckstore.format.ids import chunk_id
from ckstore.format.manifest import Commit, encode_commit
from ckstore.repository.store import ObjectStore, object_key

from helpers import flip_bit

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
    raw = {"zeros": bytes(n), "random": noise, "random head, zeros after": noise[:SAMPLE_BYTES] + bytes(n - SAMPLE_BYTES)}[kind]
    store = ObjectStore(MemoryBackend())
    result = store.put_chunk(raw, width=4, fast=True)
    encoding = parse_header(store.read_raw(result.id)).encoding
    # The sample decides: a chunk whose head is noise is stored raw even if its tail is zeros.
    assert encoding == (Encoding.ZSTD if kind == "zeros" else Encoding.RAW)
    assert result.stored < n // 100 if kind == "zeros" else result.stored > n
    assert store.get_chunk(result.id, n) == raw
