"""Checkpoint paths as DCP call sites pass them (``dcp.save(..., checkpoint_id=PATH)``):
``<repo>`` is the current branch / HEAD, ``<repo>/<name>`` a branch, tag or commit."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckstore
from ckstore.dcp import CheckpointPath, Reader, Writer, checkpoint_path, saved_commit
from ckstore.errors import InvalidInputError


def _state(scale: float) -> dict[str, Any]:
    return {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4) * scale, "step": int(scale)}


def _save(path: Any, scale: float, **kwargs: Any) -> str:
    with pytest.warns(UserWarning, match="single process"):
        return saved_commit(dcp.save(_state(scale), checkpoint_id=path, storage_writer=Writer(**kwargs)))


def _load(path: Any, reader: Reader | None = None) -> dict[str, Any]:
    target = {"w": torch.zeros(3, 4), "step": -1}
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(target, checkpoint_id=path, storage_reader=reader or Reader())
    return target


def test_the_repository_path_saves_on_the_current_branch_and_loads_head(tmp_path: Path) -> None:
    repo = ckstore.Repo.init(tmp_path / "ckpt")
    first = _save(repo.path, 1.0)
    second = _save(str(repo.path), 2.0)
    assert repo.branches() == {"main": second} and repo.read_commit(second).parents == (first,)
    loaded = _load(repo.path, Reader(repo))  # a Reader given the repository takes the path too
    assert loaded["step"] == 2 and torch.equal(loaded["w"], _state(2.0)["w"])


def test_a_name_after_the_repository_tags_the_save_and_loads_it_back(tmp_path: Path) -> None:
    repo = ckstore.Repo.init(tmp_path / "ckpt")
    step1 = _save(repo.path / "step-1", 1.0)
    step2 = _save(repo.path / "runs/step-2", 2.0)
    assert repo.tags() == {"step-1": step1, "runs/step-2": step2}
    assert repo.branches() == {"main": step2}  # the commits went on the current branch, in order
    assert _load(repo.path / "step-1")["step"] == 1
    assert _load(repo.path / "runs/step-2")["step"] == 2
    assert _load(repo.path / step1)["step"] == 1  # a commit id names the same save
    again = _save(repo.path / "step-1", 3.0)  # saving to the same name again replaces it
    assert repo.tags()["step-1"] == again and _load(repo.path / "step-1")["step"] == 3


def test_a_name_that_is_a_branch_commits_on_that_branch(tmp_path: Path) -> None:
    repo = ckstore.Repo.init(tmp_path / "ckpt")
    base = _save(repo.path, 1.0)
    repo.create_branch("exp", base)
    on_exp = _save(repo.path / "exp", 2.0)
    assert repo.branches() == {"main": base, "exp": on_exp} and repo.tags() == {}
    new = _save(repo.path / "fresh", 3.0, branch="fresh")  # the Writer's own branch, new
    assert repo.branches()["fresh"] == new and repo.tags() == {}
    assert _load(repo.path / "exp")["step"] == 2


def test_a_folder_holding_a_default_repository_and_relative_paths(tmp_path: Path, monkeypatch: Any) -> None:
    ckstore.Repo.init(tmp_path / "proj" / ".ckstore")
    monkeypatch.chdir(tmp_path / "proj")
    oid = _save("step-7", 7.0)  # relative: the current folder holds .ckstore
    assert ckstore.Repo(tmp_path / "proj").tags() == {"step-7": oid}
    assert checkpoint_path("step-7") == CheckpointPath(Path("."), "step-7")
    assert checkpoint_path(tmp_path / "proj") == CheckpointPath(tmp_path / "proj", None)
    assert checkpoint_path(tmp_path / "elsewhere" / "x") is None
    assert checkpoint_path("s3://bucket/prefix") is None
    assert _load(os.path.join("..", "proj", "step-7"))["step"] == 7


def test_paths_outside_any_repository_and_bad_names_are_refused(tmp_path: Path) -> None:
    repo = ckstore.Repo.init(tmp_path / "ckpt")
    with pytest.raises(InvalidInputError, match="not in a ckstore repository"):
        Writer().reset(tmp_path / "nothing" / "step-1")
    with pytest.raises(InvalidInputError, match="not in a ckstore repository"):
        Reader().reset(tmp_path / "nothing")
    with pytest.raises(InvalidInputError, match="checkpoint name"):
        Writer().reset(repo.path / "bad..name")
    with pytest.raises(InvalidInputError, match=r"'\.' or '\.\.'"):
        Writer().reset(f"{repo.path}/a/../b")
    with pytest.raises(InvalidInputError, match="no repository"):
        Writer().set_up_storage_writer(True)
    assert repo.branches() == {}


def test_a_reader_given_a_repository_still_takes_a_ref_as_checkpoint_id(tmp_path: Path) -> None:
    repo = ckstore.Repo.init(tmp_path / "ckpt")
    oid = _save(repo.path, 1.0)
    _save(repo.path, 2.0)
    assert _load(oid, Reader(repo))["step"] == 1  # not a path: a revision of the Reader's repository
    assert _load("main~1", Reader(repo))["step"] == 1


def test_a_remote_url_is_a_remote_target_not_a_repository_path(tmp_path: Path) -> None:
    for url in ("s3://bucket/runs/x", f"file://{tmp_path}"):
        assert Writer(url).remote_url == url and Writer(url).location is None  # no request yet
        assert Reader(url).remote_url == url and Reader(url).location is None
        assert Writer.validate_checkpoint_id(url) and Reader.validate_checkpoint_id(url)
