"""The ckstore command: the main workflow, and the one-line error contract for bad input."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ckstore.cli.base import COMMIT_STANDS
from ckstore.errors import (
    IntegrityError,
    InvalidInputError,
    NotFoundError,
    SafetensorsFormatError,
)
from ckstore.repo import Repo
from tests.helpers import (
    Cli,
    assert_one_line_error,
    checkpoint,
    flip_bit,
    leftover_temp_files,
    object_count,
    object_file,
    sha256,
    tree_digest,
)

HEX64 = re.compile(r"[0-9a-f]{64}")


def test_gc_lists_the_commits_it_deletes_oldest_first(cli: Cli, tmp_path: Path) -> None:
    cli("init", str(tmp_path / "repo"), repo=False)
    ids = []
    for i in range(6):
        checkpoint(tmp_path / f"ep{i}" / "model.safetensors", seed=i)
        ids.append(cli("commit", str(tmp_path / f"ep{i}"), "-m", f"epoch {i}").stdout.strip())
    lines = [
        line
        for line in cli("gc", "--keep-last", "1", "--dry-run").stdout.splitlines()
        if line.startswith("would delete commit")
    ]
    assert [line.split()[3] for line in lines] == [oid[:12] for oid in ids[:5]]


def test_main_workflow(cli: Cli, tmp_path: Path) -> None:
    cli("init", str(tmp_path / "repo"), repo=False)
    ids = []
    for i in range(3):
        path = checkpoint(tmp_path / f"ep{i}" / "model.safetensors", seed=i)
        (tmp_path / f"ep{i}" / "config.json").write_text('{"layers": 2}')
        out = cli(
            "commit",
            str(tmp_path / f"ep{i}"),
            "-m",
            f"epoch {i}",
            "--meta",
            f"epoch={i}",
            "--meta",
            "lr=0.001",
            "--meta",
            "final=false",
            "--meta",
            "name=run 1",
        ).stdout
        assert HEX64.fullmatch(out.strip()), out
        ids.append(out.strip())
        assert path.exists()
    cli("wait")  # the compactions run detached: the stored-size figures below must hold still
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
    cli("checkout", "main", "-o", str(tmp_path / "durable"), "--fsync")
    assert tree_digest(tmp_path / "durable") == tree_digest(tmp_path / "ep2")
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
    header = json.dumps(
        {
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
        }
    ).encode()
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
    return {
        "not safetensors": not_st,
        "truncated": truncated,
        "cut header": header_only,
        "overlap": overlapping_header_file(tmp_path / "bad" / "overlap.safetensors"),
    }


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


# ---- Ctrl-C and the detached compaction (issue 22) ----------------------------------------------


def _start(repo: Path, *args: str, cwd: Path | None = None) -> subprocess.Popen[str]:
    """The real ``ckstore`` command in a process of its own, as a user or a script runs it."""
    return subprocess.Popen(
        [sys.executable, "-m", "ckstore.cli", "--repo", str(repo), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
    )


def _wait_until_blocked_on(proc: subprocess.Popen[str], lock: Path) -> None:
    """Until ``proc`` has ``lock`` open (it waits for the repository lock there)."""
    fds = Path(f"/proc/{proc.pid}/fd")
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        try:
            if any(os.readlink(fd) == str(lock) for fd in fds.iterdir()):
                return
        except OSError:
            pass  # a descriptor closed while we looked
        time.sleep(0.02)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to see the command wait for the lock")
def test_ctrl_c_before_the_commit_is_durable_cancels_it_cleanly(tmp_path: Path) -> None:
    path = tmp_path / "repo"
    repo = Repo.init(path, chunk_size=4096)
    first = repo.commit(checkpoint(tmp_path / "a" / "model.safetensors", 0))
    repo.wait()  # this process's compaction of the first commit, before we look for temporary files
    with repo.backend.exclusive_lock():  # as gc holds it: the commit waits before storing anything durable
        proc = _start(path, "commit", str(checkpoint(tmp_path / "b" / "model.safetensors", 1)))
        _wait_until_blocked_on(proc, path / "lock")
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
        proc.send_signal(signal.SIGINT)  # a second Ctrl-C while it unwinds: still no traceback
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and out == "" and err == "ckstore: interrupted\n", err
    again = Repo(path)
    assert [e.id for e in again.log()] == [first] and again.fsck() == []
    assert leftover_temp_files(path) == []


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to see the command wait for the lock")
def test_a_burst_of_ctrl_c_never_hangs_the_command(tmp_path: Path) -> None:
    """Signals that arrive while the handler of an earlier one still runs re-enter it (Python
    runs a handler between any two bytecodes, its own included): it must neither wait on a lock
    its outer call holds nor do work that such a call can interrupt halfway."""
    path = tmp_path / "repo"
    Repo.init(path, chunk_size=4096)
    for attempt in range(3):
        with Repo(path).backend.exclusive_lock():
            # Run outside any git work tree, as a training script often is (the provenance is
            # then quick to collect: the timing that showed the fault).
            proc = _start(
                path, "commit", str(checkpoint(tmp_path / f"b{attempt}" / "model.safetensors", attempt)), cwd=tmp_path
            )
            _wait_until_blocked_on(proc, path / "lock")
            for _ in range(400):  # a held key, a script's kill loop
                if proc.poll() is not None:
                    break
                proc.send_signal(signal.SIGINT)
                time.sleep(0.0005)
            out, err = proc.communicate(timeout=60)
        assert proc.returncode == 130 and out == "" and err == "ckstore: interrupted\n", err
    assert Repo(path).branches() == {} and leftover_temp_files(path) == []


def test_ctrl_c_while_chunks_are_written_leaves_either_no_commit_or_a_whole_one(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    path = tmp_path / "repo"
    Repo.init(path, chunk_size=1 << 16)
    big = tmp_path / "big"
    big.mkdir()
    save_file(
        {"w": np.random.default_rng(0).standard_normal(1 << 23).astype(np.float32)}, str(big / "model.safetensors")
    )  # 32 MiB: many batches of chunks
    objects = path / "objects"
    proc = _start(path, "commit", str(big))
    deadline = time.monotonic() + 300
    while not any(objects.rglob("*")) and proc.poll() is None:  # chunks are being written
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert "Traceback" not in err
    again = Repo(path)
    if proc.returncode == 130:  # cancelled: no commit, no temporary file
        assert err == "ckstore: interrupted\n" and out == ""
        assert again.branches() == {} and leftover_temp_files(path) == []
    else:  # the commit was durable before the signal came: it stands, whole
        assert proc.returncode == 0 and again.log()[0].id == out.strip()
        again.checkout("HEAD", tmp_path / "out")
        assert sha256(tmp_path / "out" / "model.safetensors") == sha256(big / "model.safetensors")
    assert again.fsck(read_data=True) == []


def test_ctrl_c_after_the_commit_is_printed_keeps_it_and_compaction_goes_on(tmp_path: Path) -> None:
    path = tmp_path / "repo"
    repo = Repo.init(path, chunk_size=4096)
    repo.commit(checkpoint(tmp_path / "a" / "model.safetensors", 0))
    with repo.backend.compaction_lock(10):  # the compaction after the commit waits for us
        proc = _start(path, "commit", str(checkpoint(tmp_path / "b" / "model.safetensors", 1)))
        assert proc.stdout is not None
        oid = proc.stdout.readline().strip()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0 and HEX64.fullmatch(oid) and out == "", err
        assert "Traceback" not in err and err in ("", COMMIT_STANDS + "\n")
        assert Repo(path).log()[0].id == oid
        assert Repo(path).background_work().compaction_pending  # the user's Ctrl-C did not reach it
    done = subprocess.run([sys.executable, "-m", "ckstore.cli", "--repo", str(path), "wait"], timeout=300)
    assert done.returncode == 0
    assert "compacted 'main'" in (path / "compact.log").read_text()
    assert Repo(path).fsck() == []


# ---- start-up and closed descriptors ----------------------------------------------------------

# The console script's own first line, with a Ctrl-C that arrives while a given module is being
# imported (deterministically: the import itself sends it).
_INTERRUPTED_IMPORT = """
import os, signal, sys
module = sys.argv[1]
class Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == module:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, Interrupt())
sys.argv = ["ckstore", *sys.argv[2:]]
from ckstore.cli import run
run()
"""


# ckstore.cli: the console script loading it, once ckstore/__init__.py has run (the long soak's
# one traceback); click and ckstore.cli.base: while ``run`` imports the command.
@pytest.mark.parametrize("module", ["ckstore.cli", "click", "ckstore.cli.base"])
def test_ctrl_c_while_the_command_starts_is_one_line_and_exit_130(tmp_path: Path, module: str) -> None:
    Repo.init(tmp_path / "repo")
    proc = subprocess.run(
        [sys.executable, "-c", _INTERRUPTED_IMPORT, module, "--repo", str(tmp_path / "repo"), "log"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (proc.returncode, proc.stderr) == (130, "ckstore: interrupted\n"), proc.stderr


def test_commands_work_with_stderr_closed(tmp_path: Path) -> None:
    path = tmp_path / "repo"
    Repo.init(path, chunk_size=4096)
    source = checkpoint(tmp_path / "a" / "model.safetensors", 0)
    ck = f"{shlex.quote(sys.executable)} -m ckstore.cli --repo {shlex.quote(str(path))}"
    commit = subprocess.run(
        f"{ck} commit {shlex.quote(str(source))} -m e1 2>&-", shell=True, capture_output=True, text=True, timeout=300
    )
    assert commit.returncode == 0 and HEX64.fullmatch(commit.stdout.strip())
    out = tmp_path / "out"
    checkout = subprocess.run(f"{ck} checkout HEAD -o {shlex.quote(str(out))} 2>&-", shell=True, timeout=300)
    assert checkout.returncode == 0 and sha256(out / "model.safetensors") == sha256(source)
    assert Repo.find(path).resolve("HEAD") == commit.stdout.strip()


def _sh(command: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.run(command, shell=True, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_or_closed_stdout_is_exit_7_and_one_line_and_a_recorded_commit_is_named_on_stderr(
    tmp_path: Path,
) -> None:
    path = tmp_path / "repo"
    Repo.init(path, chunk_size=4096)
    ck = f"{shlex.quote(sys.executable)} -m ckstore.cli --repo {shlex.quote(str(path))}"
    source = checkpoint(tmp_path / "a" / "model.safetensors", 0)
    # The commit is done when only printing its id fails: exit 0 (a retry would record it twice),
    # the id said on stderr.
    commit = _sh(f"{ck} commit {shlex.quote(str(source))} -m e1 >/dev/full")
    assert commit.returncode == 0
    recorded = Repo.find(path).resolve("HEAD")
    assert commit.stderr == (
        f"ckstore: warning: cannot write to standard output: No space left on device; commit {recorded} was recorded\n"
    )
    for redirect, why in ((">/dev/full", "No space left on device"), (">&-", "it is closed")):
        for command in ("log", "status", "show HEAD"):
            run = _sh(f"{ck} {command} {redirect}")
            assert (run.returncode, run.stderr) == (7, f"ckstore: cannot write to standard output: {why}\n"), command
    both = _sh(f"{ck} log >/dev/full 2>&-")  # nowhere to say it: the exit code alone
    assert both.returncode == 7


def test_an_unexpected_error_is_one_line_and_exit_1(cli: Cli, monkeypatch: pytest.MonkeyPatch) -> None:
    cli("init", str(Path.cwd() / "repo"), repo=False)

    def broken(*args: object, **kwargs: object) -> None:
        raise ValueError("a bug")

    monkeypatch.setattr(Repo, "status", broken)
    result = cli("status", code=1)
    assert result.stderr == "ckstore: internal error: ValueError: a bug (please report it)\n"
