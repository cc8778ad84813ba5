"""Mistakes are not accepted silently (issue 10, point 4): a pickle given to commit, an --only that
matches nothing, checkout onto a file in the way, a closed output pipe, and init run twice."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

from ckstore.errors import (
    CkstoreWarning,
    InvalidInputError,
    OutputExistsError,
    PickleCheckpointError,
    RefExistsError,
    TensorNotFoundError,
)
from ckstore.repo import Repo
from ckstore.write.ingest import pickle_format
from tests.helpers import Cli, checkpoint, save_st, sha256, tree_digest

# ---- a pickle given to commit --------------------------------------------------------------------


def _pickles(folder: Path) -> dict[str, Path]:
    """One file per way PyTorch (or pickle itself) writes a checkpoint."""
    folder.mkdir(parents=True, exist_ok=True)
    sd = {"w": torch.arange(6.0)}
    out = {
        "zip.pt": folder / "zip.pt",
        "legacy.pth": folder / "legacy.pth",
        "proto2.bin": folder / "proto2.bin",
        "proto5.ckpt": folder / "proto5.ckpt",
    }
    torch.save(sd, out["zip.pt"])
    torch.save(sd, out["legacy.pth"], _use_new_zipfile_serialization=False)
    out["proto2.bin"].write_bytes(pickle.dumps({"a": 1}, protocol=2))
    out["proto5.ckpt"].write_bytes(pickle.dumps({"a": [1, 2, 3]}, protocol=5))
    return out


def test_pickle_detection_by_magic_bytes_only(tmp_path: Path) -> None:
    files = _pickles(tmp_path)
    assert pickle_format(files["zip.pt"]) == "zip"
    for name in ("legacy.pth", "proto2.bin", "proto5.ckpt"):
        assert pickle_format(files[name]) == "pickle", name
    for protocol in (2, 3, 4, 5):
        tiny = tmp_path / f"tiny{protocol}"
        tiny.write_bytes(pickle.dumps(None, protocol=protocol))
        assert pickle_format(tiny) == "pickle", protocol
    # Not pickles: a zip that is not a torch archive, random bytes named .pt, text, empty.
    with zipfile.ZipFile(tmp_path / "data.zip", "w") as z:
        z.writestr("data.csv", "a,b\n1,2\n")
    (tmp_path / "random.pt").write_bytes(bytes([0x80, 0x02, 0xFF, 0x00]) + os.urandom(100))
    (tmp_path / "config.json").write_text('{"a": 1}')
    (tmp_path / "empty.bin").write_bytes(b"")
    for name in ("data.zip", "random.pt", "config.json", "empty.bin"):
        assert pickle_format(tmp_path / name) is None, name


def test_commit_of_a_pickle_file_is_refused_without_raw(cli: Cli, tmp_path: Path) -> None:
    cli("init", str(tmp_path / "repo"), repo=False)
    files = _pickles(tmp_path / "in")
    for path in files.values():
        err = cli("commit", str(path), code=5).stderr
        assert "ckstore import" in err and "--raw" in err and path.name in err
    cli("log", code=3)  # nothing was committed: the branch has no commits
    oid = cli("commit", str(files["zip.pt"]), "--raw").stdout.strip()
    cli("checkout", oid, "-o", str(tmp_path / "out"))
    assert sha256(tmp_path / "out" / "zip.pt") == sha256(files["zip.pt"])


def test_library_refuses_a_pickle_file_and_warns_about_pickles_in_a_folder(repo: Repo, tmp_path: Path) -> None:
    files = _pickles(tmp_path / "run")
    with pytest.raises(PickleCheckpointError, match="import"):
        repo.commit(files["zip.pt"])
    assert isinstance(PickleCheckpointError("x"), InvalidInputError)
    checkpoint(tmp_path / "run" / "model.safetensors", seed=0)
    with pytest.warns(CkstoreWarning, match=r"4 pickle file\(s\).*legacy\.pth"):
        oid = repo.commit(tmp_path / "run")  # a Trainer folder holds optimizer.pt, rng_state.pth…
    repo.checkout(oid, tmp_path / "out")
    assert tree_digest(tmp_path / "out") == tree_digest(tmp_path / "run")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        repo.commit(tmp_path / "run", raw=True)  # raw: stored as they are, no warning
        repo.commit(tmp_path / "run" / "model.safetensors")


def test_cli_prints_the_folder_warning_on_one_line(cli: Cli, tmp_path: Path) -> None:
    cli("init", str(tmp_path / "repo"), repo=False)
    _pickles(tmp_path / "run")
    result = cli("commit", str(tmp_path / "run"))
    assert result.stderr.startswith("ckstore: warning: ") and result.stderr.count("\n") == 1, result.stderr
    assert "ckstore import" in result.stderr


# ---- checkout --only that matches nothing ----------------------------------------------------------


def test_only_pattern_matching_no_tensor_is_an_error(repo: Repo, tmp_path: Path, cli: Cli) -> None:
    folder = tmp_path / "m"
    save_st(folder / "model.safetensors", {"model.w": torch.ones(3), "model.b": torch.zeros(2)})
    (folder / "config.json").write_text("{}")
    oid = repo.commit(folder)
    with pytest.raises(TensorNotFoundError, match="'optimizer.\\*'"):
        repo.checkout(oid, tmp_path / "a", only=["optimizer.*"])
    assert not (tmp_path / "a").exists()  # nothing written
    with pytest.raises(TensorNotFoundError, match="'nope'"):  # each pattern must match something
        repo.checkout(oid, tmp_path / "b", only=["model.w", "nope"])
    with pytest.raises(TensorNotFoundError):
        repo.checkout(oid, tmp_path / "c", only=["nope"], shard_size="1MB")
    repo.checkout(oid, tmp_path / "d", only=["model.w"])
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["config.json", "model.safetensors"]
    cli("checkout", oid, "-o", str(tmp_path / "e"), "--only", "x*", code=3)


# ---- checkout onto a file in the way ------------------------------------------------------------------


def test_checkout_onto_a_file_in_the_way_is_a_conflict(repo: Repo, tmp_path: Path, cli: Cli) -> None:
    folder = tmp_path / "m"
    checkpoint(folder / "sub" / "model.safetensors", seed=1)
    (folder / "config.json").write_text("{}")
    oid = repo.commit(folder)
    target = tmp_path / "out.txt"
    target.write_text("mine")
    for force in (False, True):  # --force overwrites different files, never a file where a folder goes
        with pytest.raises(OutputExistsError, match="not a directory"):
            repo.checkout(oid, target, force=force)
    assert target.read_text() == "mine"
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "sub").write_text("mine")
    with pytest.raises(OutputExistsError, match="sub"):
        repo.checkout(oid, blocked, force=True)
    assert (blocked / "sub").read_text() == "mine" and not (blocked / "config.json").exists()
    cli("checkout", oid, "-o", str(target), code=6)
    cli("checkout", oid, "-o", str(blocked), code=6)


# ---- a closed output pipe -----------------------------------------------------------------------------


def test_closed_output_pipe_exits_quietly(tmp_path: Path) -> None:
    repo = Repo.init(tmp_path / "repo")
    for i in range(3):
        repo.commit(checkpoint(tmp_path / f"e{i}" / "model.safetensors", seed=i), message=f"epoch {i}")
    env = {**os.environ, "CKSTORE_REPO": str(tmp_path / "repo")}
    env.pop("PYTHONUNBUFFERED", None)  # block-buffered stdout, as in a terminal pipeline
    for argv in (["log"], ["show"], ["log", "--json"]):
        read, write = os.pipe()
        os.close(read)  # the reader is gone before the first byte (what `| head -1` does later)
        proc = subprocess.run(
            [sys.executable, "-m", "ckstore.cli", *argv], stdout=write, stderr=subprocess.PIPE, env=env, text=True
        )
        os.close(write)
        assert proc.stderr == "", proc.stderr
        assert proc.returncode == 141, argv  # 128 + SIGPIPE, as git: the shell reports nothing
    shell = subprocess.run(
        ["bash", "-c", f"{sys.executable} -m ckstore.cli log | head -1"], capture_output=True, text=True, env=env
    )
    assert shell.returncode == 0 and shell.stderr == "" and shell.stdout.count("\n") == 1


def test_a_command_started_with_its_output_closed_still_runs_and_exits_quietly(tmp_path: Path) -> None:
    """A training script that closed its stdout (or a shell's ``>&-``) before running ``ckstore
    commit``: the commit is recorded and compacts, the command exits 0, and nothing is printed."""
    env = {**os.environ, "CKSTORE_REPO": str(tmp_path / "repo")}
    Repo.init(tmp_path / "repo")
    for i in range(2):
        folder = checkpoint(tmp_path / f"e{i}" / "model.safetensors", seed=i).parent
        done = subprocess.run(
            ["bash", "-c", f"{sys.executable} -m ckstore.cli commit {folder} >&-"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert done.returncode == 0 and done.stderr == "", done.stderr
    again = Repo(tmp_path / "repo")
    again.wait_background()
    assert len(again.log()) == 2
    assert again.fsck() == []


# ---- init run twice -------------------------------------------------------------------------------------


def test_init_exist_ok_opens_the_existing_repository(tmp_path: Path) -> None:
    path = tmp_path / "runs" / ".ckstore"
    first = Repo.init(path, chunk_size=8192)
    oid = first.commit(checkpoint(tmp_path / "m" / "model.safetensors", seed=0))
    with pytest.raises(RefExistsError):
        Repo.init(path)
    again = Repo.init(path, exist_ok=True)  # the training-loop snippet, run a second time
    assert again.resolve("HEAD") == oid and again.config.chunk_size == 8192
    assert Repo.init(path, exist_ok=True, chunk_size=8192).resolve("HEAD") == oid
    with pytest.raises(InvalidInputError, match="chunk_size"):
        Repo.init(path, exist_ok=True, chunk_size=4096)  # a setting that differs is not ignored
    fresh = Repo.init(tmp_path / "new", exist_ok=True)  # creates when absent
    assert fresh.branches() == {}
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("not a repository")
    with pytest.raises(OutputExistsError, match="not an empty directory"):  # exit 6, as init over a repository
        Repo.init(tmp_path / "full", exist_ok=True)


def test_a_symlink_leading_outside_the_folder_is_stored_with_a_warning(cli: Cli, tmp_path: Path) -> None:
    cli("init", str(tmp_path / "repo"), repo=False)
    outside = tmp_path / "secret.txt"
    outside.write_text("not part of the run\n")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine\n")
    (folder / "inside").symlink_to(folder / "notes.txt")  # inside the folder: nothing to say
    (folder / "leak").symlink_to(outside)
    result = cli("commit", str(folder), "-m", "x")
    assert result.stderr == (
        "ckstore: warning: storing the target of 1 symlink(s) that lead outside the folder, as plain files"
        f" (leak -> {outside.resolve()})\n"
    )
