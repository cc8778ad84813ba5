"""The copies a remote counts on must never form a delta cycle (open: docs/reliability.md, "The
review's scripts on this code").

``c1_detached_stress.py`` of the 2026-12 review (pushes racing detached compactions, repack and
remote gc) left a folder remote whose chosen copies formed ten delta cycles: every commit was
whole locally, the clone failed, and the only whole copy that broke one cycle was in a condemned
pack. This is its smallest form: a push reads the objects it sends one by one, and a compaction
re-encodes two of them between two reads, so the pack holds copies of two moments that no local
state ever held together (Z -> Y and Y -> X as read first, X -> Z as read after).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import ckstore.remote.push as push
from ckstore.codecs.objects import Kind, delta_bases, encode, encode_delta
from ckstore.format.manifest import ChunkRef
from ckstore.repo import Repo


@pytest.mark.xfail(strict=True, reason="open: a push that races a re-encoding can send a delta cycle")
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
        if oid == y.id:  # a compaction re-encodes between two of the push's reads: X -> Z, Y whole
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
