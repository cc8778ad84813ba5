"""Chunks read on the pipeline's workers into reused buffers (write/spans.py), and a source file
that changes while it is committed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ckstore.write.commit
from ckstore.errors import InvalidInputError
from ckstore.repo import Repo
from ckstore.write.spans import OpenSource, read_span, recycle

from helpers import leftover_temp_files, save_st


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


@pytest.mark.parametrize("change, message", [
    (lambda p: p.write_bytes(p.read_bytes() + b"more"), "got longer"),
    (lambda p: p.write_bytes(p.read_bytes()[:1_500_000]), "got shorter"),
])
def test_a_file_that_changes_while_committed_is_refused_and_nothing_lands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: Any, message: str,
) -> None:
    repo, folder, first = _commit_while(tmp_path, monkeypatch, change)
    with pytest.raises(InvalidInputError, match=f"notes.bin changed while being committed \\(it {message}\\)"):
        repo.commit([folder], message="second")
    assert repo.resolve("HEAD") == first
    assert not leftover_temp_files(repo.path)
    assert repo.fsck(read_data=True) == []
