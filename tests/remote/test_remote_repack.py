"""A remote keeps pace with the local store: push and remote gc send again the objects that local
compaction re-encoded smaller (with the rest of their pack) and delete the packs so superseded,
two-phase; every epoch still reads back bit-exact from a clone."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from ckstore.remote import supersede
from ckstore.remote.gc import MTIME_RESOLUTION
from ckstore.remote.names import open_remote
from ckstore.repo import Repo
from ckstore.repository.context import open_context
from tests.remote.epochs import CHUNK, digests

GRACE = 0.2


def fine_tune_epoch(folder: Path, epoch: int, n: int = 192 << 10) -> Path:
    """A full fine-tune after ``epoch`` epochs: every weight and moment drifts a little, so each
    epoch is a small delta of the next one (what compaction turns the older epochs into)."""
    rng = np.random.default_rng(0)
    w, m = rng.standard_normal(n, dtype=np.float32), rng.standard_normal(n, dtype=np.float32) * 1e-3
    for e in range(1, epoch + 1):
        step = np.random.default_rng(e)
        w += 1e-4 * step.standard_normal(n, dtype=np.float32)
        m += 1e-7 * step.standard_normal(n, dtype=np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({"model.w": w, "optim.m": m}, str(folder / f"epoch-{epoch}.safetensors"))
    return folder


def remote_bytes(repo: Repo) -> int:
    return sum(info.size for info in open_remote(open_context(repo.path)).transport.list(""))


def gc_twice(repo: Repo) -> int:
    """Re-send and condemn what is superseded, then (after the grace period) delete it; bytes
    re-sent."""
    time.sleep(GRACE + MTIME_RESOLUTION + 0.1)
    first = repo.gc_remote(grace=GRACE)
    time.sleep(GRACE + 0.1)
    return first.resent_bytes + repo.gc_remote(grace=GRACE).resent_bytes


def test_remote_stays_within_a_tenth_of_the_local_store_over_many_epochs(
    tmp_path: Path, remote_url: tuple[str, str | None]
) -> None:
    url, endpoint = remote_url
    repo = Repo.init(tmp_path / "a", chunk_size=CHUNK)
    repo.add_remote("origin", url, endpoint)
    folders, ids, sent, resent = [], [], [], []
    for epoch in range(1, 6):
        folders.append(fine_tune_epoch(tmp_path / "work" / f"e{epoch}", epoch))
        ids.append(repo.commit(folders[-1], message=f"epoch {epoch}"))
        repo.wait()
        pushed = repo.push()
        sent.append(pushed.bytes - pushed.resent_bytes)
        resent.append(pushed.resent_bytes + gc_twice(repo))
        local = repo.stats().stored_bytes
        assert remote_bytes(repo) <= 1.1 * local, (epoch, remote_bytes(repo), local)
    # A push sends the new epoch and the previous one's deltas again, never the history.
    assert max(sent[1:]) <= 1.1 * sent[0], sent
    assert resent[0] == 0 and 0 < max(resent[1:]) <= 0.9 * sent[0], resent
    clone, _ = Repo.clone(url, tmp_path / "b", endpoint_url=endpoint)
    assert clone.fsck(read_data=True) == []
    for i, (commit, folder) in enumerate(zip(ids, folders)):
        clone.checkout(commit, tmp_path / f"out{i}")
        assert digests(tmp_path / f"out{i}") == digests(folder)


def test_a_push_between_condemnation_and_sweep_does_not_rescue_a_superseded_pack(
    tmp_path: Path, remote_url: tuple[str, str | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A superseded pack a push only condemned (as a push before deletion at once did, or one
    holding equal copies does) stays condemned through later pushes and goes at the sweep."""
    url, endpoint = remote_url
    repo = Repo.init(tmp_path / "a", chunk_size=CHUNK)
    repo.add_remote("origin", url, endpoint)
    remote = open_remote(open_context(repo.path))
    folders = [fine_tune_epoch(tmp_path / "work" / f"e{e}", e) for e in range(1, 4)]
    repo.commit(folders[0])
    repo.wait()
    repo.push()
    first = remote.pack_ids()
    repo.commit(folders[1])
    repo.wait()
    # Epoch 1's pack is superseded: its objects go again as deltas, and (this push deleting
    # nothing at once) it is condemned.
    with monkeypatch.context() as patch:
        patch.setattr(supersede, "drop_superseded", lambda *_, **__: {})
        assert set(repo.push().condemned) == first
    repo.commit(folders[2])
    repo.wait()
    repo.push()  # relies on the new copies, not on the condemned pack
    time.sleep(GRACE + 0.1)
    # (with the pack of epoch 2, which that push found superseded in turn)
    assert first <= set(repo.gc_remote(grace=GRACE).deleted)
    assert not remote.pack_ids() & first
    clone, _ = Repo.clone(url, tmp_path / "b", endpoint_url=endpoint)
    assert clone.fsck(read_data=True) == []
    for i, folder in enumerate(folders):
        clone.checkout(f"main~{2 - i}", tmp_path / f"out{i}")
        assert digests(tmp_path / f"out{i}") == digests(folder)
