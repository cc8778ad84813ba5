"""Chunks read on the pipeline's workers into reused buffers (write/spans.py), and a source file
that changes while it is committed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ckstore.write.commit
from ckstore.errors import InvalidInputError
from ckstore.repo import Repo
from ckstore.write.spans import OpenSource, read_span, recycle
from tests.helpers import leftover_temp_files, save_st
from tests.pagecache import cached_bytes, cached_bytes_of, cached_clean, needs_fadvise


def _file(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    return path


def test_spans_read_their_bytes_and_reuse_the_buffer(tmp_path: Path) -> None:
    data = bytes(range(256)) * 64
    source = OpenSource(_file(tmp_path, data), len(data))
    try:
        first = read_span(source.span(100, 5000))
        assert bytes(first) == data[100:5100]
        buffer = first.obj
        recycle(first)
        second = read_span(source.span(7000, 3000))
        assert bytes(second) == data[7000:10000]
        assert second.obj is buffer  # nothing held the first view: the same memory serves again
        recycle(second)
    finally:
        source.close()


def test_a_buffer_still_viewed_is_never_overwritten(tmp_path: Path) -> None:
    """A store or a statistic that kept a view of a chunk (an array, a slice) keeps its bytes:
    the next read goes to a new buffer."""
    data = np.arange(4096, dtype=np.uint32).tobytes()
    source = OpenSource(_file(tmp_path, data), len(data))
    try:
        first = read_span(source.span(0, 4096))
        kept = np.frombuffer(first, dtype=np.uint32)
        recycle(first)
        second = read_span(source.span(8192, 4096))
        assert second.obj is not kept.base.obj
        assert bytes(kept.tobytes()) == data[:4096]
        assert bytes(second) == data[8192:12288]
        recycle(second)
    finally:
        source.close()


def _commit_while(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: Any) -> tuple[Repo, Path, str]:
    """Commit a safetensors file and a blob; ``change`` alters the blob after it was listed
    (its size taken) and before its chunks are read."""
    repo = Repo.init(tmp_path / "repo")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_st(folder / "model.safetensors", {"w": torch.arange(300_000, dtype=torch.float32)})
    blob = folder / "notes.bin"
    blob.write_bytes(b"x" * 3_000_000)
    first = repo.commit([folder], message="first")
    real = ckstore.write.commit.ingest

    def changed_then_ingest(*args: Any, **kwargs: Any) -> Any:
        change(blob)
        return real(*args, **kwargs)

    monkeypatch.setattr(ckstore.write.commit, "ingest", changed_then_ingest)
    return repo, folder, first


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda p: p.write_bytes(p.read_bytes() + b"more"), "got longer"),
        (lambda p: p.write_bytes(p.read_bytes()[:1_500_000]), "got shorter"),
    ],
)
def test_a_file_that_changes_while_committed_is_refused_and_nothing_lands(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    change: Any,
    message: str,
) -> None:
    repo, folder, first = _commit_while(tmp_path, monkeypatch, change)
    with pytest.raises(InvalidInputError, match=f"notes.bin changed while being committed \\(it {message}\\)"):
        repo.commit([folder], message="second")
    assert repo.resolve("HEAD") == first
    assert not leftover_temp_files(repo.path)
    assert repo.fsck(read_data=True) == []


@needs_fadvise
def test_a_committed_checkpoint_leaves_the_page_cache(tmp_path: Path) -> None:
    """Read twice (saved, then committed), a checkpoint's pages would sit on the kernel's active
    list and push the next epoch's checkpoint out of memory before its commit reads it."""
    path = tmp_path / "ckpt" / "model.safetensors"
    path.parent.mkdir()
    save_st(path, {"w": torch.arange(2 << 20, dtype=torch.float32)})  # 8 MiB
    cached_clean(path)
    before = cached_bytes(path)
    repo = Repo.init(tmp_path / "repo")
    repo.commit([path.parent], message="epoch 1")
    after = cached_bytes(path)
    assert after < path.stat().st_size // 8, (before, after)
    repo.checkout("HEAD", tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == path.read_bytes()


@needs_fadvise
def test_the_stored_prefix_leaves_the_page_cache_while_the_commit_goes(tmp_path: Path) -> None:
    """Spans stored out of order (two workers), not aligned to the kernel's folios: the pages
    before the stored prefix go, those of spans not yet stored stay."""
    chunk, count = (1 << 20) + 80, 72  # 72 MiB and a bit: past one drop step
    path = _file(tmp_path, os.urandom(chunk * count))
    cached_clean(path)
    source = OpenSource(path, chunk * count)
    try:
        spans = [source.span(i * chunk, chunk) for i in range(count)]
        for i in [*range(1, count - 4, 2), *range(0, count - 4, 2)]:  # the odd ones first
            source.stored(spans[i])
        head = cached_bytes_of(path, 0, (count - 8) * chunk)
        tail = cached_bytes_of(path, (count - 4) * chunk, 4 * chunk)
        assert head < 16 << 20, head  # what the last step has not reached yet, at most
        assert tail >= 4 * chunk - (1 << 20), tail  # not stored: left alone
    finally:
        source.close()


def test_a_source_deleted_before_it_is_read_is_the_input_error_of_a_missing_path(tmp_path: Path) -> None:
    from ckstore.write.spans import OpenSource

    with pytest.raises(InvalidInputError, match="disappeared while being committed") as info:
        OpenSource(tmp_path / "trainer_state.json", 10)
    assert info.value.exit_code == 5  # as `commit nosuch`, not 7 (a storage failure)
