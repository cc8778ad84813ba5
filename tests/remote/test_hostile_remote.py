"""A hostile folder remote (issue 21, findings F1, F8, F9, F10, F11 of the reliability review):
every object that arrives is decoded and verified against its name before it is stored or used,
everything read from a remote is size-bounded before it is read, and broken delta chains are a
clean IntegrityError (exit 4, one line, also under ``python -O``), never a traceback or an
exhausted memory."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

import numpy as np
import pytest

from ckstore.codecs.objects import HEADER_SIZE, Encoding, Kind, decode, encode, encode_chunk, encode_delta, parse_header
from ckstore.errors import IntegrityError
from ckstore.format.ids import chunk_id, commit_id
from ckstore.format.manifest import ChunkRef, FileEntry, decode_commit, encode_commit
from ckstore.format.pack import object_bytes, parse_pack
from ckstore.format.pack_build import pack_objects
from ckstore.remote.layout import PACKS, index_key, pack_key, pack_name
from ckstore.repo import Repo
from ckstore.transport import open_transport
from tests.reliability.helpers import assert_clean_error, cli_env, run_cli

from .test_verify import rewrite_as_version_1

MIB = 1 << 20


def _pushed(tmp_path: Path, files: dict[str, bytes]) -> tuple[Repo, Path, str]:
    """Repository ``a`` with one commit of ``files`` pushed to a folder remote: (a, remote, commit)."""
    work = tmp_path / "work"
    work.mkdir()
    for name, data in files.items():
        (work / name).write_bytes(data)
    a = Repo.init(tmp_path / "a")
    oid = a.commit(work, message="m")
    a.wait()
    remote = tmp_path / "remote"
    a.add_remote("origin", str(remote))
    a.push()
    return a, remote, oid


def _rewrite(
    remote: Path, replace: Mapping[str, bytes] = MappingProxyType({}), add: Mapping[str, bytes] = MappingProxyType({})
) -> None:
    """Repack the remote with some objects' stored bytes replaced and others added, with valid
    version 2 digests of the new bytes: what anyone who can write to a shared bucket can do."""
    t = open_transport(str(remote))
    objects: dict[str, bytes] = {}
    for info in list(t.list(PACKS)):
        data = t.get(info.key)
        pid = pack_name(info.key)
        for e in parse_pack(data, pid).entries:
            objects[e.id] = bytes(object_bytes(data, e))
        t.delete(index_key(pid))
        t.delete(info.key)
    objects.update(replace)
    objects.update(add)
    for built in pack_objects(objects.items()):
        t.put(pack_key(built.name), built.data)
        t.put(index_key(built.name), built.index_data)


def _cli(*args: str | os.PathLike[str], optimize: bool = False) -> subprocess.CompletedProcess[str]:
    env = cli_env(**({"PYTHONOPTIMIZE": "1"} if optimize else {}))
    return run_cli(*args, env=env, limit_memory=True)


# ---- F1: a planted object is refused by its name, not trusted by its digest ------------------


def test_clone_refuses_an_object_whose_bytes_are_not_its_name(tmp_path: Path) -> None:
    zeros = bytes(MIB)
    _, remote, _ = _pushed(tmp_path, {"zeros.bin": zeros})
    planted = chunk_id(zeros)
    _rewrite(remote, replace={planted: encode(b"\xff" * MIB, Kind.CHUNK, 3)})
    with pytest.raises(IntegrityError, match=f"object {planted} is corrupt: .*do not hash to its name") as err:
        Repo.clone(str(remote), tmp_path / "clone")
    assert err.value.exit_code == 4
    assert not (tmp_path / "clone").exists()  # a failed clone removes what it made
    b = Repo.init(tmp_path / "b")  # the same through a fetch, whose repository stays
    b.add_remote("origin", str(remote))
    with pytest.raises(IntegrityError, match=f"object {planted} is corrupt: .*do not hash to its name"):
        b.fetch()
    # Nothing unverified stays behind to be a dedup target: the victim's own later commit of a
    # zero megabyte stores it and reads back.
    assert not b.store.has(planted)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "zeros.bin").write_bytes(zeros)
    oid = b.commit(mine, message="victim")
    b.checkout(oid, tmp_path / "out")
    assert (tmp_path / "out" / "zeros.bin").read_bytes() == zeros
    assert b.fsck(read_data=True) == []


# ---- F11: delta cycles and overlong chains ---------------------------------------------------


def _cycle(tmp_path: Path) -> tuple[Path, str, str]:
    """A remote whose commit names chunk A, stored as a delta of B, itself a delta of A."""
    rng = np.random.default_rng(1)
    raw_a = rng.integers(0, 4, MIB, dtype=np.uint8).tobytes()
    raw_b = bytes(x ^ 1 for x in raw_a[:16]) + raw_a[16:]
    _, remote, _ = _pushed(tmp_path, {"a.bin": raw_a})
    ida, idb = chunk_id(raw_a), chunk_id(raw_b)
    da = encode_delta(raw_a, 3, 1, idb, raw_b, 1 << 30)
    db = encode_delta(raw_b, 3, 1, ida, raw_a, 1 << 30)
    assert da is not None and db is not None
    _rewrite(remote, replace={ida: da}, add={idb: db})
    return remote, ida, idb


@pytest.mark.parametrize("optimize", [False, True])
def test_clone_of_a_delta_cycle_is_a_clean_integrity_error(tmp_path: Path, optimize: bool) -> None:
    remote, ida, idb = _cycle(tmp_path)
    proc = _cli("clone", remote, tmp_path / "b", optimize=optimize)
    line = assert_clean_error(proc, 4)
    assert ida in line or idb in line


def test_lazy_checkout_of_a_delta_cycle_is_a_clean_integrity_error(tmp_path: Path) -> None:
    remote, ida, idb = _cycle(tmp_path)
    b = Repo.init(tmp_path / "b")
    b.add_remote("origin", str(remote))
    proc = _cli("--repo", tmp_path / "b", "checkout", "origin/main", "-o", tmp_path / "out", "--remote", "origin")
    assert "cycle" in assert_clean_error(proc, 4, ida)


def test_lazy_checkout_of_an_overlong_chain_is_a_clean_integrity_error(tmp_path: Path) -> None:
    """200 deltas, each of the next: the lazy reader's chain depth spans its remote reads."""
    raws = [bytes([i]) * 4096 for i in range(201)]
    _, remote, _ = _pushed(tmp_path, {"top.bin": raws[0]})
    chain = {
        chunk_id(raws[i]): encode_delta(raws[i], 3, 1, chunk_id(raws[i + 1]), raws[i + 1], 1 << 30) for i in range(200)
    }
    chain[chunk_id(raws[200])] = encode(raws[200], Kind.CHUNK, 3)
    assert all(chain.values())
    _rewrite(remote, replace=chain)  # type: ignore[arg-type]
    b = Repo.init(tmp_path / "b")
    b.add_remote("origin", str(remote))
    proc = _cli("--repo", tmp_path / "b", "checkout", "origin/main", "-o", tmp_path / "out", "--remote", "origin")
    assert_clean_error(proc, 4, "delta chain longer than 64")
    proc = _cli("clone", remote, tmp_path / "c")
    assert_clean_error(proc, 4, "delta chain longer than 64")


# ---- F8: a manifest bomb ---------------------------------------------------------------------


def _bomb(size: int) -> tuple[str, bytes]:
    """A commit object of ``size`` bytes of ``[[],[],…]`` that hashes to its name."""
    raw = b"[" + b"[]," * ((size - 4) // 3) + b"[]]"
    data = encode(raw, Kind.COMMIT, 3)
    return commit_id(raw), data


def test_clone_refuses_a_manifest_bomb_without_decoding_it(tmp_path: Path) -> None:
    """A 256 MiB manifest in a tiny object: refused from its header, within 1 GiB of memory
    (parsed, it takes over 5 GB)."""
    _, remote, good = _pushed(tmp_path, {"x.bin": b"x" * 100})
    oid, data = _bomb(256 * MIB)
    assert len(data) < 64 * 1024
    _rewrite(remote, add={oid: data})
    t = open_transport(str(remote))
    t.put("refs/heads/main", f"{oid}\n".encode())
    proc = _cli("clone", remote, tmp_path / "b")
    assert_clean_error(proc, 4, oid, "more than a real manifest")


def test_a_dense_manifest_is_refused_before_it_is_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    from ckstore.format import manifest

    def no_parse(*args: object, **kwargs: object) -> None:
        raise AssertionError("parsed")

    monkeypatch.setattr(manifest.json, "loads", no_parse)
    with pytest.raises(IntegrityError, match="JSON lists and objects"):
        manifest.decode_commit(b"[" + b"[]," * 200_000 + b"[]]")


def test_a_writer_never_stores_a_manifest_readers_refuse(tmp_path: Path) -> None:
    """Metadata that compresses beyond what readers accept is stored raw: it reads back."""
    repo = Repo.init(tmp_path / "r")
    work = tmp_path / "w"
    work.mkdir()
    (work / "f.bin").write_bytes(b"f")
    oid = repo.commit(work, metadata={"note": "a" * (20 * MIB)})
    data = repo.store.read_raw(oid)
    assert parse_header(data).encoding == Encoding.RAW
    assert (
        decode_commit(repo.store.get_commit(oid)).metadata
        == decode_commit(encode_commit(decode_commit(repo.store.get_commit(oid)))).metadata
    )
    assert "a" * (20 * MIB) in repo.store.get_commit(oid).decode()
    assert repo.fsck(read_data=True) == []


# ---- F10: sparse and huge files in a folder remote -------------------------------------------


@pytest.mark.parametrize("where", ["ref", "index", "pruned", "condemned", "marker"])
def test_huge_sparse_files_in_a_folder_remote_are_never_read_whole(tmp_path: Path, where: str) -> None:
    _, remote, _ = _pushed(tmp_path, {"x.bin": b"x" * 100})
    if where == "ref":
        path = remote / "refs" / "heads" / "evil"
    elif where == "index":
        path = next((remote / "indexes").iterdir())
    elif where == "pruned":
        path = remote / "gc" / "pruned"
    elif where == "condemned":
        path = remote / "gc" / "condemned.json"
    else:
        path = remote / "ckstore-remote.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as f:
        f.truncate(6 << 30)  # 6 GiB that use no disk: read whole, it exhausts the 1 GiB limit
    proc = _cli("clone", remote, tmp_path / "b")
    assert proc.returncode in (4, 6) if where == "marker" else proc.returncode == 4, proc.stderr
    assert_clean_error(proc, proc.returncode)


# ---- F9: decoded delta bases do not pile up --------------------------------------------------


def test_fetch_holds_decoded_bases_within_its_bound(tmp_path: Path) -> None:
    """Twenty 64 MiB chunks that compress to almost nothing, each the base of a tiny delta the
    commit names, the deltas placed first (so each waits for its base), in a version 1 pack: the
    clone verifies them all within 1 GiB of memory (kept whole until their deltas came, the
    bases took 1.25 GiB)."""
    k, size = 20, 64 * MIB
    a, remote, good = _pushed(tmp_path, {"x.bin": b"x" * 100})
    bases = [bytes([2 * i + 2]) * size for i in range(k)]
    tops = [b[:-1] + bytes([b[-1] ^ 1]) for b in bases]
    # One delta encoding serves every pair (the same residual): only the base's name differs.
    first = encode_chunk(tops[0], 3, 1, chunk_id(bases[0]), bases[0], allowed=frozenset({Encoding.DELTA}))
    assert parse_header(first).encoding == Encoding.DELTA and len(first) < 64 * 1024
    deltas = {
        chunk_id(t): first[:HEADER_SIZE] + bytes.fromhex(chunk_id(b)) + first[HEADER_SIZE + 32 :]
        for t, b in zip(tops, bases)
    }
    assert decode(deltas[chunk_id(tops[-1])], Kind.CHUNK, size, fetch_base=lambda _, n: bases[-1]) == tops[-1]
    files = tuple(
        FileEntry(f"t{i}.bin", "blob", size, chunks=(ChunkRef(chunk_id(t), size),)) for i, t in enumerate(tops)
    )
    commit = replace(decode_commit(a.store.get_commit(good)), files=files, parents=())
    manifest = encode_commit(commit)
    _rewrite(
        remote,
        add={
            **deltas,
            **{chunk_id(b): encode(b, Kind.CHUNK, 3) for b in bases},  # type: ignore[dict-item]
            commit_id(manifest): encode(manifest, Kind.COMMIT, 3),
        },
    )
    open_transport(str(remote)).put("refs/heads/main", f"{commit_id(manifest)}\n".encode())
    rewrite_as_version_1(open_transport(str(remote)))  # no digests: every object is decoded to be checked
    proc = _cli("clone", remote, tmp_path / "b")
    assert proc.returncode == 0, proc.stderr
    assert Repo(tmp_path / "b").fsck() == []


def test_a_refused_fetched_object_is_named_once_in_the_message(tmp_path: Path) -> None:
    zeros = bytes(MIB)
    _, remote, _ = _pushed(tmp_path, {"zeros.bin": zeros})
    planted = chunk_id(zeros)
    _rewrite(remote, replace={planted: encode(b"\xff" * MIB, Kind.CHUNK, 3)})
    proc = _cli("clone", remote, tmp_path / "clone")
    line = assert_clean_error(proc, IntegrityError.exit_code, "do not hash to its name", "fetched from")
    assert line.count(f"object {planted}") == 1 and line.count("is corrupt") == 1, line
