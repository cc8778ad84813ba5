"""The ckstore command: the main workflow, and the one-line error contract for bad input."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from ckstore.cli import main
from ckstore.errors import (
    IntegrityError,
    InvalidInputError,
    NotFoundError,
    SafetensorsFormatError,
)

from ckstore.repo import Repo

from helpers import checkpoint, flip_bit, leftover_temp_files, object_count, object_file, sha256, tree_digest

HEX64 = re.compile(r"[0-9a-f]{64}")
Cli = Callable[..., Result]  # run(*args, code=expected exit code, repo=pass --repo)


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Cli:
    """Run ckstore in-process against ``tmp_path/repo``; checks every run against the error contract."""
    monkeypatch.delenv("CKSTORE_REPO", raising=False)
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()

    def run(*args: str, code: int = 0, repo: bool = True) -> Result:
        argv = (["--repo", str(tmp_path / "repo")] if repo else []) + list(args)
        result = runner.invoke(main, argv, prog_name="ckstore")
        assert result.exit_code == code, (argv, result.output, result.stderr)
        if code not in (0, 2):  # usage errors are click's own
            assert_one_line_error(result.stderr)
            assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit)
        return result

    return run


def assert_one_line_error(stderr: str) -> None:
    assert stderr.startswith("ckstore: ") and stderr.count("\n") == 1, stderr
    assert "Traceback" not in stderr


def test_gc_lists_the_commits_it_deletes_oldest_first(cli: Cli, tmp_path: Path) -> None:
    cli("init", str(tmp_path / "repo"), repo=False)
    ids = []
    for i in range(6):
        checkpoint(tmp_path / f"ep{i}" / "model.safetensors", seed=i)
        ids.append(cli("commit", str(tmp_path / f"ep{i}"), "-m", f"epoch {i}").stdout.strip())
    lines = [line for line in cli("gc", "--keep-last", "1", "--dry-run").stdout.splitlines()
             if line.startswith("would delete commit")]
    assert [line.split()[3] for line in lines] == [oid[:12] for oid in ids[:5]]


def test_main_workflow(cli: Cli, tmp_path: Path) -> None:
    cli("init", str(tmp_path / "repo"), repo=False)
    ids = []
    for i in range(3):
        path = checkpoint(tmp_path / f"ep{i}" / "model.safetensors", seed=i)
        (tmp_path / f"ep{i}" / "config.json").write_text('{"layers": 2}')
        out = cli("commit", str(tmp_path / f"ep{i}"), "-m", f"epoch {i}", "--meta", f"epoch={i}",
                  "--meta", "lr=0.001", "--meta", "final=false", "--meta", "name=run 1").stdout
        assert HEX64.fullmatch(out.strip()), out
        ids.append(out.strip())
        assert path.exists()
    log = json.loads(cli("log", "--json").stdout)
    assert [e["id"] for e in log] == ids[::-1]
    assert log[0]["metadata"] == {"epoch": 2, "lr": 0.001, "final": False, "name": "run 1"}
    assert log[0]["message"] == "epoch 2" and log[0]["added_bytes"] > 0 and log[0]["logical_bytes"] > 0
    assert "epoch 1" in cli("log").stdout
    show = json.loads(cli("show", "HEAD~1", "--json").stdout)
    assert show["id"] == ids[1]
    tensors = {t["name"]: t for f in show["files"] for t in f["tensors"]}
    assert tensors["model.w"]["dtype"] == "F32" and tensors["model.w"]["shape"] == [4096]
    assert "provenance" in show and "model.w" in cli("show", "--tensors").stdout
    assert ids[0] in cli("tag", "v0", ids[0][:8]).stdout
    cli("branch", "exp", "HEAD~1")
    assert "exp" in cli("branch").stdout and "v0" in cli("tag").stdout
    diff = json.loads(cli("diff", "HEAD~1", "HEAD", "--json").stdout)
    statuses = {(d["path"], d["name"]): d["status"] for d in diff["changes"]}
    assert statuses[("model.safetensors", "model.w")] == "changed"
    assert statuses[("config.json", None)] == "unchanged"
    assert "changed" in cli("diff", "HEAD~1", "HEAD").stdout
    cli("checkout", "HEAD~2", "-o", str(tmp_path / "out"))
    assert tree_digest(tmp_path / "out") == tree_digest(tmp_path / "ep0")
    cli("checkout", "main", "-o", str(tmp_path / "out"), code=6)  # files differ: refused
    cli("checkout", "main", "-o", str(tmp_path / "out"), "--force")
    assert tree_digest(tmp_path / "out") == tree_digest(tmp_path / "ep2")
    cli("checkout", "main", "-o", str(tmp_path / "only"), "--only", "model.*")
    stats = json.loads(cli("stats", "--json").stdout)
    assert stats["commits"] == 3 and stats["logical_bytes"] > 0 and stats["stored_bytes"] > 0
    assert "would delete 0 commit" in cli("gc", "--keep-last", "1", "--dry-run").stdout  # exp keeps ids[1]
    cli("branch", "-d", "exp")
    dry = cli("gc", "--keep-last", "1", "--dry-run").stdout
    assert "would delete commit " + ids[1][:12] + " epoch 1" in dry and "would free" in dry
    assert json.loads(cli("stats", "--json").stdout) == stats
    assert "deleted commit " + ids[1][:12] in cli("gc", "--keep-last", "1").stdout
    after = json.loads(cli("stats", "--json").stdout)
    assert after["commits"] == 2 and after["stored_bytes"] < stats["stored_bytes"]
    assert "pruned" in cli("log").stdout
    assert "no problems" in cli("fsck", "--read-data").stdout
    cli("tag", "-d", "v0")
    cli("tag", "-d", "v0", code=NotFoundError.exit_code)


@pytest.fixture
def inited(cli: Cli, tmp_path: Path) -> Cli:
    cli("init", str(tmp_path / "repo"), repo=False)
    cli("commit", str(checkpoint(tmp_path / "good.safetensors", 0)))
    return cli


def overlapping_header_file(path: Path) -> Path:
    header = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                         "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(12))
    return path


def bad_inputs(tmp_path: Path) -> dict[str, Path]:
    not_st = tmp_path / "bad" / "notes.safetensors"
    not_st.parent.mkdir(exist_ok=True)
    not_st.write_text("this is not a safetensors file at all")
    good = checkpoint(tmp_path / "bad" / "src.safetensors", 5).read_bytes()
    truncated = tmp_path / "bad" / "truncated.safetensors"
    truncated.write_bytes(good[:-100])
    header_only = tmp_path / "bad" / "cut_header.safetensors"
    header_only.write_bytes(good[:20])
    return {"not safetensors": not_st, "truncated": truncated, "cut header": header_only,
            "overlap": overlapping_header_file(tmp_path / "bad" / "overlap.safetensors")}


@pytest.mark.parametrize("case", ["not safetensors", "truncated", "cut header", "overlap"])
def test_bad_safetensors_refused_and_repo_unchanged(inited: Cli, tmp_path: Path, case: str) -> None:
    repo = Repo(tmp_path / "repo")
    before = (repo.branches(), object_count(repo))
    folder = tmp_path / "folder"
    checkpoint(folder / "a_good.safetensors", 7)  # a valid file next to the bad one stores nothing either
    shutil.copy(bad_inputs(tmp_path)[case], folder / "z.safetensors")
    result = inited("commit", str(folder), code=SafetensorsFormatError.exit_code)
    assert "z.safetensors" in result.stderr
    assert (repo.branches(), object_count(repo)) == before
    assert leftover_temp_files(tmp_path / "repo") == []


def test_bad_arguments(inited: Cli, tmp_path: Path) -> None:
    inited("checkout", "nope", "-o", str(tmp_path / "o"), code=NotFoundError.exit_code)
    inited("log", "HEAD~9", code=NotFoundError.exit_code)
    inited("branch", "a..b", code=InvalidInputError.exit_code)
    inited("tag", "--", "-bad", code=InvalidInputError.exit_code)
    inited("commit", str(tmp_path / "good.safetensors"), "--meta", "novalue", code=InvalidInputError.exit_code)
    inited("commit", str(tmp_path / "missing.bin"), code=InvalidInputError.exit_code)
    inited("commit", str(tmp_path / "good.safetensors"), "--branch", "x.lock", code=InvalidInputError.exit_code)
    inited("gc", "--keep-last", "0", code=InvalidInputError.exit_code)
    assert len(json.loads(inited("log", "--json").stdout)) == 1  # nothing above committed


def test_no_repository(cli: Cli, tmp_path: Path) -> None:
    result = cli("log", code=NotFoundError.exit_code, repo=False)
    assert "no ckstore repository" in result.stderr
    cli("log", code=NotFoundError.exit_code)  # --repo naming a folder that is no repository


def test_fsck_reports_damage_with_exit_code(inited: Cli, tmp_path: Path) -> None:
    repo = Repo(tmp_path / "repo")
    chunk = next(repo.read_commit(repo.resolve("HEAD")).all_chunks()).id
    flip_bit(object_file(repo, chunk), -1)
    result = inited("fsck", "--read-data", code=IntegrityError.exit_code)
    assert chunk in result.stdout and "1 problem" in result.stderr
    inited("checkout", "HEAD", "-o", str(tmp_path / "o"), code=IntegrityError.exit_code)
    assert not (tmp_path / "o" / "good.safetensors").exists()


def test_real_subprocess(tmp_path: Path) -> None:
    exe = shutil.which("ckstore")
    argv0 = [exe] if exe else [sys.executable, "-m", "ckstore.cli"]
    env = {k: v for k, v in os.environ.items() if k != "CKSTORE_REPO"}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*argv0, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)

    assert run("init").returncode == 0 and (tmp_path / ".ckstore" / "config.json").is_file()
    path = checkpoint(tmp_path / "m.safetensors", 0)
    commit = run("commit", str(path), "-m", "first")
    assert commit.returncode == 0 and HEX64.fullmatch(commit.stdout.strip())
    assert json.loads(run("log", "--json").stdout)[0]["id"] == commit.stdout.strip()
    assert run("checkout", "HEAD", "-o", "out").returncode == 0
    assert sha256(tmp_path / "out" / "m.safetensors") == sha256(path)
    bad = overlapping_header_file(tmp_path / "bad.safetensors")
    failed = run("commit", str(bad))
    assert failed.returncode == SafetensorsFormatError.exit_code and failed.stdout == ""
    assert_one_line_error(failed.stderr)
    missing = subprocess.run([*argv0, "log"], cwd="/", env=env, capture_output=True, text=True, timeout=120)
    assert missing.returncode == NotFoundError.exit_code
    assert_one_line_error(missing.stderr)
