"""The copies a remote counts on must never form a delta cycle (docs/format.md 15.7, "Delta
cycles"), and where writers at different moments made one, readers and remote gc keep the copy
that breaks it.

``c1_detached_stress.py`` of the 2026-12 review (pushes racing detached compactions, repack and
remote gc) left a folder remote whose chosen copies formed ten delta cycles: every commit was
whole locally, the clone failed, and the only whole copy that broke one cycle was in a condemned
pack. Its smallest form: a push reads the objects it sends one by one, and a compaction re-encodes
two of them between two reads, so the pack would hold copies of two moments that no local state
ever held together (Z -> Y and Y -> X as read first, X -> Z as read after).
"""

from __future__ import annotations

import time
from pathlib import Path

import blake3
import numpy as np
import pytest
from safetensors.numpy import save_file

import ckstore.remote.push as push
from ckstore.codecs.objects import Kind, delta_bases, encode, encode_delta
from ckstore.format.manifest import ChunkRef
from ckstore.remote.chains import chain_closure
from ckstore.remote.names import open_remote
from ckstore.remote.uploads import PackUploads
from ckstore.repo import Repo
from ckstore.repository.context import open_context


def two_chunks(tmp_path: Path) -> tuple[Repo, ChunkRef, ChunkRef, dict[str, bytes]]:
    """A repository with a remote and one commit of two similar one-chunk tensors X and Y."""
    rng = np.random.default_rng(1)
    v = rng.standard_normal(1024).astype(np.float32)
    save_file({"a": v, "b": v + 1e-3 * rng.standard_normal(1024).astype(np.float32)}, str(tmp_path / "src.safetensors"))
    repo = Repo.init(tmp_path / "repo", chunk_size=4096)
    repo.add_remote("origin", str(tmp_path / "remote"))
    commit = repo.read_commit(repo.commit(tmp_path / "src.safetensors"))
    repo.wait_background()
    x, y = ([c for f in commit.files for t in f.tensors if t.name == n for c in t.chunks][0] for n in "ab")
    return repo, x, y, {c.id: repo.store.get_chunk(c.id, c.size) for c in (x, y)}


def store_as(repo: Repo, raw: dict[str, bytes], c: ChunkRef, base: ChunkRef | None) -> None:
    """Store ``c`` here as a delta of ``base`` (whole when None), as a compaction would."""
    repo.store.replace_chunk(c.id, encode(raw[c.id], Kind.CHUNK, 3) if base is None else delta_of(raw, c, base))


def chosen_cycles(repo: Repo) -> set[str]:
    remote = open_remote(open_context(repo.path))
    where = remote.holdings()
    return chain_closure(remote, where, set(where.complete()))[1]


def test_a_pair_compaction_flipped_goes_up_again_together_and_replaces_the_old_pack_without_a_cycle(
    tmp_path: Path,
) -> None:
    repo, x, y, raw = two_chunks(tmp_path)
    store_as(repo, raw, y, x)
    repo.push()  # the remote: X whole, Y -> X
    store_as(repo, raw, y, None)
    store_as(repo, raw, x, y)  # here since: Y whole, X -> Y (smaller than the remote's X)
    repo.push()  # X -> Y sent again would be read with the remote's Y -> X: a cycle
    assert chosen_cycles(repo) == set()
    clone, _ = Repo.clone(str(tmp_path / "remote"), tmp_path / "clone")
    assert clone.fsck(read_data=True) == []


def test_a_push_never_sends_again_a_copy_whose_bases_lead_back_to_it(tmp_path: Path) -> None:
    repo, x, y, raw = two_chunks(tmp_path)
    repo.push()  # one pack: X whole, Y whole, the commit
    send_pack(repo, [(y.id, delta_of(raw, y, x))])  # the remote counts on its Y -> X now
    store_as(repo, raw, y, None)
    store_as(repo, raw, x, y)  # here: X -> Y, much smaller than the remote's X
    repo.push()  # sending X -> Y again, alone, would meet the remote's Y -> X
    assert chosen_cycles(repo) == set()
    clone, _ = Repo.clone(str(tmp_path / "remote"), tmp_path / "clone")
    assert clone.fsck(read_data=True) == []


def delta_of(raw: dict[str, bytes], c: ChunkRef, base: ChunkRef) -> bytes:
    data = encode_delta(raw[c.id], 3, 4, base.id, raw[base.id], 1 << 20, sample_test=False)
    assert data is not None
    return data


def send_pack(repo: Repo, objects: list[tuple[str, bytes]]) -> None:
    """Put a pack of these stored objects on the remote, as another writer would have."""
    with PackUploads(open_remote(open_context(repo.path))) as uploads:
        for oid, data in objects:
            uploads.add(oid, data, blake3.blake3(data).digest())


def test_a_cycle_other_writers_made_is_read_through_and_the_copy_breaking_it_kept(tmp_path: Path) -> None:
    repo, x, y, raw = two_chunks(tmp_path)
    repo.push()  # pack P: X whole, Y whole, the commit and its manifest
    remote = open_remote(open_context(repo.path))
    (p,) = remote.catalogue()
    # Two writers at different moments, each sound: X -> Y in one pack, Y -> X in another, and
    # the commit's objects again; the copies chosen by size chain X -> Y -> X, and P holds no
    # chosen copy any more: its whole X and Y are all that break the cycle.
    send_pack(repo, [(x.id, delta_of(raw, x, y))])
    send_pack(repo, [(y.id, delta_of(raw, y, x))])
    send_pack(
        repo, [(e.id, repo.store.read_raw(e.id)) for e in remote.catalogue()[p].entries if e.id not in (x.id, y.id)]
    )
    assert chosen_cycles(repo) == {x.id, y.id}
    time.sleep(1.1)  # older than the resolution of pack times: gc may condemn P
    for collect in (lambda: repo.gc_remote(grace=0), lambda: repo.push(grace=0)):
        for _ in range(2):  # with no grace, twice: a pack condemned the first time goes the second
            collect()
            time.sleep(0.05)
            assert p in open_remote(open_context(repo.path)).catalogue()
    clone, _ = Repo.clone(str(tmp_path / "remote"), tmp_path / "clone")
    assert clone.fsck(read_data=True) == []
    lazy = Repo.init(tmp_path / "lazy")
    lazy.add_remote("origin", str(tmp_path / "remote"))
    lazy.use_remote("origin")
    lazy.checkout("origin/main", tmp_path / "out")
    assert (tmp_path / "out" / "src.safetensors").read_bytes() == (tmp_path / "src.safetensors").read_bytes()


def test_a_push_racing_a_re_encoding_never_leaves_the_remote_a_delta_cycle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(0)
    v = rng.standard_normal(1024).astype(np.float32)
    tensors = {
        "a": v,
        **{n: v + k * 1e-3 * rng.standard_normal(1024).astype(np.float32) for k, n in ((1, "b"), (2, "c"))},
    }
    save_file(tensors, str(tmp_path / "src.safetensors"))
    repo = Repo.init(tmp_path / "repo", chunk_size=4096)  # one chunk per tensor
    repo.add_remote("origin", str(tmp_path / "remote"))
    commit = repo.read_commit(repo.commit(tmp_path / "src.safetensors"))
    repo.wait_background()
    # Roles by the order the push reads them (the manifest's: a, b, c): Z first, then Y, then X.
    z, y, x = ([c for f in commit.files for t in f.tensors if t.name == n for c in t.chunks][0] for n in "abc")
    raw = {c.id: repo.store.get_chunk(c.id, c.size) for c in (x, y, z)}

    def as_delta(c: ChunkRef, base: ChunkRef) -> None:
        data = encode_delta(raw[c.id], 3, 4, base.id, raw[base.id], len(repo.store.read_raw(c.id)), sample_test=False)
        assert data is not None
        repo.store.replace_chunk(c.id, data)

    as_delta(y, x)
    as_delta(z, y)  # the state a push starts from: X whole, Y -> X, Z -> Y
    stored = push._Verifier.stored
    read: list[str] = []

    def reading(self: push._Verifier, oid: str) -> tuple[str, bytes, bytes, tuple[str, ...]]:
        out = stored(self, oid)
        read.append(oid)
        if oid == y.id and read.count(oid) == 1:  # a compaction re-encodes between two reads: X -> Z, Y whole
            as_delta(x, z)
            repo.store.replace_chunk(y.id, encode(raw[y.id], Kind.CHUNK, 3))
        return out

    monkeypatch.setattr(push, "VERIFY_AHEAD", 1)  # one read at a time: the moment is exact
    monkeypatch.setattr(push._Verifier, "stored", reading)
    repo.push()
    monkeypatch.undo()
    assert read.index(z.id) < read.index(y.id) < read.index(x.id)
    assert repo.fsck(read_data=True) == []  # here: X -> Z -> Y, no cycle
    assert delta_bases(repo.store.read_raw(x.id)) == (z.id,)
    repo.push()  # nothing to repair it with: the remote's copies are all it has
    clone, _ = Repo.clone(str(tmp_path / "remote"), tmp_path / "clone")
    assert clone.fsck(read_data=True) == []
