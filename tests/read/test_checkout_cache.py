"""A checkout larger than a share of the memory the kernel can cache writes its files through,
out of the page cache (read/checkout.py ``WRITE_THROUGH_SHARE``); a smaller one leaves them cached."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckstore.read.checkout as checkout
from ckstore.repo import Repo
from tests.helpers import save_st, tree_digest
from tests.pagecache import cached_bytes, cached_clean, needs_fadvise


def _committed(tmp_path: Path, mib: int = 24) -> tuple[Repo, dict[str, str]]:
    src = tmp_path / "ckpt"
    save_st(src / "model.safetensors", {"w": torch.randn(mib << 18, generator=torch.Generator().manual_seed(0))})
    repo = Repo.init(tmp_path / "repo")
    repo.commit([src], message="epoch 1")
    repo.wait()  # its compaction reads the tip back into the cache (compact._warm_tip): not during the checkout
    return repo, tree_digest(src)


@needs_fadvise
def test_a_checkout_larger_than_the_cache_share_leaves_its_files_out_of_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Left cached, a 10 GB checkout's unsynced output evicted the pack pages it had not read yet;
    and the pack pages it read, read twice, held the cache against the next epoch's checkpoint."""
    # Past two 64 MiB steps of the pack's drop: at one step, reads out of order (the checkout's
    # threads) had left ranges that dropped only half of a 96 MiB pack, now and then.
    repo, digest = _committed(tmp_path, mib=160)
    (pack,) = (tmp_path / "repo" / "objects" / "pack").glob("*.pack")
    if cached_bytes(pack) < pack.stat().st_size // 2:
        pytest.skip("this file system does not keep written files in the page cache")
    monkeypatch.setattr(checkout, "WRITE_THROUGH_SHARE", 0.0)
    repo.checkout("HEAD", tmp_path / "out")
    written = tmp_path / "out" / "model.safetensors"
    assert cached_bytes(written) < written.stat().st_size // 8
    assert cached_bytes(pack) < pack.stat().st_size // 2  # all but the last step's remainder
    assert tree_digest(tmp_path / "out") == digest


@needs_fadvise
def test_a_small_checkout_stays_cached_for_the_read_that_follows(tmp_path: Path) -> None:
    repo, digest = _committed(tmp_path)
    cached_clean(tmp_path / "ckpt" / "model.safetensors")  # skips where files are not kept cached
    repo.checkout("HEAD", tmp_path / "out")
    written = tmp_path / "out" / "model.safetensors"
    assert cached_bytes(written) > written.stat().st_size // 2
    assert tree_digest(tmp_path / "out") == digest


@needs_fadvise
def test_a_mid_size_checkout_is_written_out_as_it_goes_and_stays_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past WRITE_OUT_SHARE of the cacheable memory the files are written out as they are written
    (the kernel throttled a 3 GB checkout's writers once its dirty pages passed its background
    threshold), and still kept cached for the read that follows (a resume)."""
    repo, digest = _committed(tmp_path, mib=48)
    cached_clean(tmp_path / "ckpt" / "model.safetensors")  # skips where files are not kept cached
    flushed: list[int] = []
    original = checkout.write_out
    monkeypatch.setattr(checkout, "write_out", lambda fd: (flushed.append(fd), original(fd))[1])
    monkeypatch.setattr(checkout, "WRITE_OUT_SHARE", 0.0)
    repo.checkout("HEAD", tmp_path / "out")
    written = tmp_path / "out" / "model.safetensors"
    assert flushed  # an early flush every 16 MiB, one at a time (a busy machine skips some)
    assert cached_bytes(written) > written.stat().st_size // 2
    assert tree_digest(tmp_path / "out") == digest
    monkeypatch.setattr(checkout, "WRITE_OUT_SHARE", 1.0)
    flushed.clear()
    repo.checkout("HEAD", tmp_path / "out2")
    assert flushed == []  # a small checkout is left to the kernel's writeback
