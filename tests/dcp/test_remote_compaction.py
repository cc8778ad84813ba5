"""DCP saves to a remote are compacted there (dcp/remote_compaction.py): after each save lands,
the previous save's chunks become deltas of the new ones, so the bucket holds about what a
compacted local repository would, and every save still loads bit-identical."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

import ckstore.dcp
from ckstore.errors import InvalidInputError
from ckstore.remote.compaction import RemoteCompactReport
from ckstore.repo import Repo
from ckstore.transport import open_transport
from ckstore.transport.base import RemoteOptions
from tests.remote.epochs import adamw_fine_tune


def _states(tmp_path: Path, epochs: int) -> list[dict[str, torch.Tensor]]:
    """What a training script's state dict holds at each of ``epochs`` epochs of a real AdamW
    fine-tune (weights and both moments)."""
    out = []
    for folder in adamw_fine_tune(tmp_path / "epochs", epochs, steps=8):
        (file,) = folder.iterdir()
        out.append(load_file(file))
    return out


def _url(remote_url: tuple[str, str | None]) -> tuple[str, str | None]:
    url, endpoint = remote_url
    return (url if url.startswith("s3://") else Path(url).as_uri()), endpoint


def _bucket_bytes(url: str, endpoint: str | None) -> int:
    return sum(info.size for info in open_transport(url, RemoteOptions(endpoint_url=endpoint)).list(""))


def _save(state: dict[str, torch.Tensor], url: str, endpoint: str | None, compact: str) -> ckstore.dcp.Writer:
    writer = ckstore.dcp.Writer(url, endpoint_url=endpoint, compact=compact)
    dcp.save(state, storage_writer=writer)
    return writer


def _load(url: str, endpoint: str | None, ref: str, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    target = {k: torch.empty_like(v) for k, v in like.items()}
    dcp.load(target, storage_reader=ckstore.dcp.Reader(url, ref=ref, endpoint_url=endpoint))
    return target


def test_saves_compacted_on_the_remote_hold_a_local_repositorys_bytes_and_load_bit_identical(
    tmp_path: Path, remote_url: tuple[str, str | None]
) -> None:
    url, endpoint = _url(remote_url)
    whole_url = url.rstrip("/") + "-whole"
    states = _states(tmp_path, 4)
    commits, reports = [], []
    for state in states:
        writer = _save(state, url, endpoint, "inline")
        _save(state, whole_url, endpoint, "off")
        assert writer.commit_id is not None
        commits.append(writer.commit_id)
        reports.append(writer.compaction)
    assert all(isinstance(r, RemoteCompactReport) for r in reports)
    assert reports[0].parent is None  # type: ignore[union-attr]  # checked just above
    assert all(r.deltas > 0 for r in reports[1:])  # type: ignore[union-attr]

    local = Repo.init(tmp_path / "local")
    for state in states:
        dcp.save(state, storage_writer=ckstore.dcp.Writer(local.path))
    local.wait()
    compacted, whole = _bucket_bytes(url, endpoint), _bucket_bytes(whole_url, endpoint)
    held = local.stats().stored_bytes
    assert compacted <= 1.1 * held, (compacted, held)
    assert compacted < 0.8 * whole, (compacted, whole)

    for commit, state in zip(commits, states):
        loaded = _load(url, endpoint, commit, state)
        assert all(torch.equal(loaded[k], state[k]) for k in state), commit


def test_the_background_compaction_is_a_detached_process_that_shrinks_the_remote(
    tmp_path: Path, remote_url: tuple[str, str | None]
) -> None:
    url, endpoint = _url(remote_url)
    whole_url = url.rstrip("/") + "-whole"
    first, second = _states(tmp_path, 2)
    for state in (first, second):
        _save(state, whole_url, endpoint, "off")
    _save(first, url, endpoint, "off")
    writer = _save(second, url, endpoint, "background")
    assert writer.compaction is not None and not isinstance(writer.compaction, RemoteCompactReport)
    assert writer.compaction.wait(timeout=300) == 0
    # The first save is a delta of the second now, where the uncompacted remote keeps both whole.
    compacted, whole = _bucket_bytes(url, endpoint), _bucket_bytes(whole_url, endpoint)
    assert compacted < 0.9 * whole, (compacted, whole)
    assert writer.commit_id is not None
    loaded = _load(url, endpoint, writer.commit_id, second)
    assert all(torch.equal(loaded[k], second[k]) for k in second)


def test_an_unknown_compaction_mode_is_refused_before_any_save() -> None:
    with pytest.raises(InvalidInputError, match="compact='sometimes'"):
        ckstore.dcp.Writer("s3://bucket/prefix", compact="sometimes")
