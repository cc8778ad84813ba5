"""The one verified object reader (ckstore/repository/reader.py): whatever the stored bytes, a read
returns the bytes named or raises IntegrityError naming the object, within its bounds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckstore.codecs.objects import HEADER, MAGIC, OBJECT_VERSION, Encoding, Kind, encode, encode_chunk, parse_header
from ckstore.errors import IntegrityError, ObjectCorruptError, ObjectMissingError
from ckstore.format.ids import chunk_id, commit_id, object_key
from ckstore.format.manifest import canonical_json
from ckstore.format.pack_build import PackBuilder
from ckstore.remote.names import RemoteSpec, open_spec
from ckstore.repo import Repo
from ckstore.repository.reader import (
    MANIFEST_FREE,
    MAX_CHAIN_DEPTH,
    VerifiedReader,
    delta_closure,
    verified_commit,
)
from tests.reliability.helpers import assert_clean_error, run_cli

SIZE = 4096


def _raw(i: int) -> bytes:
    return bytes([i % 251]) * (SIZE - 2) + i.to_bytes(2, "little")


def _delta(raw: bytes, base: bytes) -> bytes:
    data = encode_chunk(raw, 3, 1, chunk_id(base), base, allowed=frozenset({Encoding.DELTA}))
    return data


def _chain(n: int) -> tuple[dict[str, bytes], list[bytes]]:
    """Objects 0..n: object i a delta of object i + 1, object n whole; (stored, raws)."""
    raws = [_raw(i) for i in range(n + 1)]
    stored = {chunk_id(raws[i]): _delta(raws[i], raws[i + 1]) for i in range(n)}
    stored[chunk_id(raws[n])] = encode(raws[n], Kind.CHUNK, 3)
    return stored, raws


def _reader(stored: dict[str, bytes], **kwargs: int) -> VerifiedReader:
    return VerifiedReader(lambda oid, context: stored[oid], **kwargs)


def test_a_chain_within_the_limit_reads_and_one_link_more_is_refused() -> None:
    stored, raws = _chain(MAX_CHAIN_DEPTH)
    assert _reader(stored).chunk(chunk_id(raws[0]), SIZE) == raws[0]
    stored, raws = _chain(MAX_CHAIN_DEPTH + 1)
    with pytest.raises(IntegrityError, match=f"delta chain longer than {MAX_CHAIN_DEPTH}"):
        _reader(stored).chunk(chunk_id(raws[0]), SIZE)


def test_a_cycle_is_refused_by_name() -> None:
    a, b = _raw(1), _raw(2)
    stored = {chunk_id(a): _delta(a, b), chunk_id(b): _delta(b, a)}
    with pytest.raises(ObjectCorruptError, match="cycle") as err:
        _reader(stored).chunk(chunk_id(a), SIZE)
    assert err.value.oid == chunk_id(a)


def test_a_cached_base_keeps_its_chain_length() -> None:
    """Reading the middle of a long chain caches it; a read from the top through that cached base
    still counts every link below it."""
    stored, raws = _chain(MAX_CHAIN_DEPTH + 1)
    reader = _reader(stored, base_cache=1 << 30)
    assert reader.chunk(chunk_id(raws[2]), SIZE) == raws[2]  # 63 links: fine, and caches raws[3..]
    with pytest.raises(IntegrityError, match=f"delta chain longer than {MAX_CHAIN_DEPTH}"):
        reader.chunk(chunk_id(raws[0]), SIZE)


def test_decoded_bytes_are_counted_against_the_budget() -> None:
    stored, raws = _chain(3)
    assert _reader(stored, budget=4 * SIZE).chunk(chunk_id(raws[0]), SIZE) == raws[0]
    with pytest.raises(IntegrityError, match="memory"):
        _reader(stored, budget=3 * SIZE).chunk(chunk_id(raws[0]), SIZE)


def test_bytes_that_are_not_the_name_and_missing_bases_are_named() -> None:
    stored, raws = _chain(1)
    top, base = chunk_id(raws[0]), chunk_id(raws[1])
    stored[base] = encode(_raw(9), Kind.CHUNK, 3)
    with pytest.raises(ObjectCorruptError, match=f"object {base} \\(delta base of {top}\\) is corrupt: .*hash") as err:
        _reader(stored).chunk(top, SIZE)
    assert err.value.oid == base
    del stored[base]
    with pytest.raises(ObjectMissingError, match=f"object {base} is missing \\(delta base of {top}\\)"):
        _reader(stored).chunk(top, SIZE)


def test_a_manifest_bomb_is_refused_from_its_header() -> None:
    raw = b"[" + b"[]," * ((MANIFEST_FREE + 3) // 3) + b"[]]"
    data = encode(raw, Kind.COMMIT, 3)
    with pytest.raises(IntegrityError, match="more than a real manifest"):
        verified_commit(commit_id(raw), data)


def test_chain_checks_hold_under_python_O() -> None:
    script = (
        "from tests.repository.test_reader import _chain, _reader\n"
        "from ckstore.errors import IntegrityError\n"
        "stored, raws = _chain(70)\n"
        "from ckstore.format.ids import chunk_id\n"
        "try:\n    _reader(stored).chunk(chunk_id(raws[0]), 4096)\nexcept IntegrityError as e:\n    print('refused', e)\n"
    )
    out = subprocess.run([sys.executable, "-O", "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.startswith("refused") and "longer than" in out


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, MAX_CHAIN_DEPTH + 6), loop_to=st.one_of(st.none(), st.integers(0, MAX_CHAIN_DEPTH + 6)))
def test_any_chain_reads_right_or_is_refused_cleanly(n: int, loop_to: int | None) -> None:
    """A chain of n links, optionally closed into a loop: the bytes named or an IntegrityError,
    never a RecursionError or a wrong result."""
    stored, raws = _chain(n)
    if loop_to is not None and loop_to <= n:
        stored[chunk_id(raws[n])] = _delta(raws[n], raws[loop_to])
    try:
        assert _reader(stored).chunk(chunk_id(raws[0]), SIZE) == raws[0]
        assert n <= MAX_CHAIN_DEPTH and (loop_to is None or loop_to > n)
    except IntegrityError:
        assert n > MAX_CHAIN_DEPTH or (loop_to is not None and loop_to <= n)


def test_the_closure_follows_bases_and_skips_what_is_not_there() -> None:
    bases = {"a": ("b",), "b": ("c",), "c": (), "x": ("a", "gone")}
    assert delta_closure(["x"], lambda o: bases[o], follow=lambda o: o in bases) == {"x", "a", "b", "c", "gone"}

    def damaged(oid: str) -> tuple[str, ...]:
        raise IntegrityError(f"object {oid} is corrupt: bad header")

    with pytest.raises(IntegrityError, match="object x is corrupt: bad header; stopped"):
        delta_closure(["x"], damaged)


def _float_chain(seed: int, n: int = 3, size: int = 1 << 16) -> tuple[dict[str, bytes], list[bytes]]:
    """Like ``_chain``, of float32 epochs that drift a little: object i a zigzag-difference delta
    of object i + 1 (byte-grouped width 4), object n whole and byte-grouped."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=size // 4).astype("<f4")
    raws = []
    for _ in range(n + 1):
        raws.append(x.tobytes())
        x = (x + rng.normal(scale=1e-3, size=x.size)).astype("<f4")
    raws.reverse()
    stored = {
        chunk_id(raws[i]): encode_chunk(
            raws[i], 3, 4, chunk_id(raws[i + 1]), raws[i + 1], allowed=frozenset({Encoding.DELTA})
        )
        for i in range(n)
    }
    stored[chunk_id(raws[n])] = encode_chunk(raws[n], 3, 4)
    assert {parse_header(s).encoding for s in stored.values()} == {Encoding.DELTA, Encoding.GROUPED}
    return stored, raws


@pytest.mark.parametrize("base_cache", [0, 1 << 30])
def test_reads_that_reuse_decode_memory_never_change_an_earlier_result_or_a_cached_base(base_cache: int) -> None:
    # Bases are decoded into arrays each thread reuses chain after chain: a result handed out, or
    # a base kept in the cache, must never be one of them.
    chains = [_float_chain(seed) for seed in range(4)]
    reader = VerifiedReader(lambda oid, context: next(s[oid] for s, _ in chains if oid in s), base_cache=base_cache)
    results = [(reader.chunk(chunk_id(raws[i]), len(raws[i])), raws[i]) for _, raws in chains for i in range(len(raws))]
    assert all(bytes(got) == raw for got, raw in results)
    assert all(chunk_id(raw) == oid for oid, (raw, _) in reader._cache.items())
    assert len(reader._cache) == (3 * len(chains) if base_cache else 0)


def test_a_chunk_decodes_into_the_array_the_caller_gives() -> None:
    import numpy as np

    stored, raws = _float_chain(7)
    reader = _reader(stored)
    for raw in raws:  # the top of the chain (3 deltas deep) down to the whole one
        out = np.full(len(raw), 0xAB, np.uint8)
        got = reader.chunk(chunk_id(raw), len(raw), out=out)
        assert bytes(got) == raw and np.shares_memory(np.frombuffer(got, np.uint8), out)
    wrong = np.zeros(len(raws[0]) - 4, np.uint8)  # not the chunk's size: not used
    got = reader.chunk(chunk_id(raws[0]), len(raws[0]), out=wrong)
    assert bytes(got) == raws[0] and not wrong.any()


def test_a_corrupt_base_deep_in_a_chain_is_named_and_every_object_reported_is_verified() -> None:
    stored, raws = _chain(3)
    top, middle = chunk_id(raws[0]), chunk_id(raws[2])
    seen: list[str] = []
    assert _reader(stored, on_verified=lambda oid, data: seen.append(oid)).chunk(top, SIZE) == raws[0]
    assert sorted(seen) == sorted(chunk_id(r) for r in raws)  # lazy reads cache each of them
    stored[middle] = encode(_raw(9), Kind.CHUNK, 3)  # well formed, the wrong bytes
    for reader in (_reader(stored), _reader(stored, base_cache=1 << 30)):
        with pytest.raises(
            ObjectCorruptError, match=f"object {middle} \\(delta base of .*\\) is corrupt: .*hash"
        ) as err:
            reader.chunk(top, SIZE)
        assert err.value.oid == middle


# ---- file lists stored apart (version-4 manifests) -------------------------------------------


def _zstd_chunk(raw: bytes) -> bytes:
    """A chunk object (plain zstd) as any writer may store one, however well ``raw`` compresses."""
    import zstandard

    body = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(raw)
    return HEADER.pack(MAGIC, OBJECT_VERSION, Kind.CHUNK, Encoding.ZSTD, 0, len(raw)) + body


def _v4_manifest(pieces: list[tuple[str, int]]) -> bytes:
    doc = {
        "ckstore": 4,
        "parents": [],
        "time": "2026-01-01T00:00:00.000000+00:00",
        "branch": "main",
        "message": "file list bomb",
        "metadata": {},
        "provenance": {},
        "logical_bytes": 0,
        "added_bytes": 0,
        "state": None,
        "base": None,
        "file_list": [[oid, size] for oid, size in pieces],
    }
    return canonical_json(doc)


def _file_list_bomb(size: int) -> bytes:
    """The text of a file list of ``size`` bytes that compresses about 10,000:1 and parses into
    13 bytes of Python objects per byte: ``["ab","ab",…]``."""
    n = (size - 2) // 5
    return b"[" + b'"ab",' * (n - 1) + b'"ab"]'


def test_a_file_list_that_compresses_like_a_bomb_is_refused_before_it_is_decoded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = Repo.init(tmp_path / "repo")
    text = _file_list_bomb(MANIFEST_FREE + (8 << 20))
    piece = chunk_id(text)
    repo.backend.put_new(object_key(piece), _zstd_chunk(text))
    manifest = _v4_manifest([(piece, len(text))])
    oid = repo.store.put_commit(manifest).id
    repo.backend.replace("refs/heads/main", f"{oid}\n".encode())
    decoded: list[int] = []
    real = VerifiedReader.chunk
    monkeypatch.setattr(
        VerifiedReader, "chunk", lambda self, oid, size, *a, **k: decoded.append(size) or real(self, oid, size, *a, **k)
    )
    with pytest.raises(IntegrityError, match=r"file list declares .* more than a real file list can compress"):
        Repo(tmp_path / "repo").read_commit(oid)
    assert decoded == []  # refused from the piece's stored length alone


def test_clone_of_a_remote_holding_a_file_list_bomb_is_refused_within_the_memory_limit(tmp_path: Path) -> None:
    seed = Repo.init(tmp_path / "seed")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("seed\n")
    seed.commit(tmp_path / "d", message="seed", branch="seed")
    remote_dir = tmp_path / "remote"
    assert run_cli("remote", "add", "origin", remote_dir, repo=tmp_path / "seed").returncode == 0
    assert run_cli("push", "origin", "seed", repo=tmp_path / "seed").returncode == 0
    text = _file_list_bomb(1 << 27)  # 128 MiB of text in about 13 KB: 1.7 GB once parsed
    piece, piece_stored, size = chunk_id(text), _zstd_chunk(text), len(text)
    del text
    manifest = _v4_manifest([(piece, size)])
    commit, commit_stored = commit_id(manifest), encode(manifest, Kind.COMMIT, 3)
    remote = open_spec(RemoteSpec("origin", str(remote_dir)))
    builder = PackBuilder()
    parts: list[bytes | memoryview] = [builder.header]
    for oid, stored in ((piece, piece_stored), (commit, commit_stored)):
        builder.add(oid, stored)
        parts.append(stored)
    tail, index = builder.close()
    remote.upload_pack(builder.pack_id, [*parts, tail], index.to_bytes)
    _, token = remote.read_ref("refs/heads/main")
    assert remote.swap_ref("refs/heads/main", commit, token)
    proc = run_cli("clone", remote_dir, tmp_path / "clone", limit_memory=True, timeout=300)
    assert_clean_error(proc, IntegrityError.exit_code, "more than a real file list can compress")
