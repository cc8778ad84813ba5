"""The bundled test server as the README uses it: start in the background, exports that point
``s3://ckstore/...`` at it, a push and a clone through them, stop (and the watchdog's stop)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckstore.repo import Repo
from tests.remote.epochs import make_repo


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _server(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ckstore.transport.testserver", *args, str(folder)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_start_push_clone_stop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "s3-server"
    started = _server(folder, "start")
    assert started.returncode == 0, started.stderr
    pid = json.loads((folder / "server.json").read_text())["pid"]
    try:
        exports = dict(shlex.split(line)[1].split("=", 1) for line in started.stdout.splitlines())
        assert (folder / "env.sh").read_text() == started.stdout
        assert exports["AWS_ENDPOINT_URL"].startswith("http://127.0.0.1:")
        for name, value in exports.items():
            monkeypatch.setenv(name, value)
        a, ids = make_repo(tmp_path / "a", tmp_path / "work", range(1, 3))
        a.add_remote("origin", "s3://ckstore/runs/demo")  # the endpoint comes from AWS_ENDPOINT_URL
        a.push()
        b, _ = Repo.clone("s3://ckstore/runs/demo", tmp_path / "b")
        assert b.resolve("main") == ids[-1] and b.fsck(read_data=True) == []
        assert "already recorded" in _server(folder, "start").stderr
    finally:
        stopped = _server(folder, "stop")
    assert stopped.returncode == 0, stopped.stderr
    assert not _alive(pid) and not (folder / "server.json").exists()
    assert "no test server" in _server(folder, "stop").stderr


def test_the_watchdog_stops_a_forgotten_server(tmp_path: Path) -> None:
    folder = tmp_path / "s3-server"
    assert _server(folder, "start", "--after", "1").returncode == 0
    pid = json.loads((folder / "server.json").read_text())["pid"]
    deadline = time.monotonic() + 90  # a loaded machine: the watchdog and the stop take their time
    # The watchdog stops the server, then removes server.json: wait for both.
    while (_alive(pid) or (folder / "server.json").exists()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _alive(pid) and not (folder / "server.json").exists()


def _running(pid: int) -> bool:
    """Alive and not a zombie (a reparented child may wait for a reaper that never comes)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_killing_the_process_that_launched_the_server_stops_it(tmp_path: Path) -> None:
    """A killed pytest (SIGKILL: no finally runs) must not leave its SeaweedFS behind."""
    script = (
        "import sys, time; from pathlib import Path; from ckstore.transport.testserver import launch\n"
        "proc, _ = launch(Path(sys.argv[1])); print(proc.pid, flush=True); time.sleep(600)\n"
    )
    (tmp_path / "s3").mkdir()
    parent = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "s3")], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        assert _running(pid)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 30
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = _running(pid)
    if alive:
        os.kill(pid, 9)
    assert not alive
