"""submitit's LocalExecutor runs a real job process; the preemption signal sent to it (USR2, what
submitit's jobs get on preemption) becomes one durable commit at the end of the step in progress,
submitit's own handler then calls the task's checkpoint hook and requeues it, and the requeued job
resumes from that commit bit-exact."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckstore.repo import Repo
from tests.helpers import Cli

submitit = pytest.importorskip("submitit")
from ckstore.integrations.submitit import preemption_signal  # noqa: E402
from tests.integrations.submitit_task import Train  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STEPS, SLEEP = 150, 0.04
pytestmark = pytest.mark.slow  # two job processes and a requeue: about 20 s


def submit(tmp_path: Path, name: str) -> tuple[object, Path]:
    folder = tmp_path / name
    folder.mkdir()
    executor = submitit.LocalExecutor(folder=tmp_path / "jobs" / name)
    executor.update_parameters(timeout_min=10)
    return executor.submit(
        Train(), str(tmp_path / "repo" if name == "preempted" else folder / "repo"), STEPS, str(folder), SLEEP
    ), folder


def wait_for(what: str, check: object, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def attempts(folder: Path) -> list[dict]:
    path = folder / "progress"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def step_of(folder: Path) -> int:
    try:
        return int((folder / "step").read_text() or -1)
    except (FileNotFoundError, ValueError):
        return -1


def test_a_preempted_job_commits_requeues_and_resumes_bit_exact(
    tmp_path: Path, cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    reference, ref_folder = submit(tmp_path, "reference")  # the same job, never signalled
    job, folder = submit(tmp_path, "preempted")
    wait_for("the job's first steps", lambda: step_of(folder) >= 20)
    first = attempts(folder)[0]
    os.kill(first["pid"], preemption_signal())  # the signal a preempted submitit job gets
    wait_for("the requeued job", job.done, timeout=600)
    wait_for("the reference job", reference.done, timeout=600)
    result = job.result()  # the requeued attempt's: it ran to the end
    assert reference.result()["start"] == 0

    repo = Repo(tmp_path / "repo")
    [saved] = repo.log("main")  # the preemption save, the only commit
    meta = repo.read_commit(saved.id).decoded_metadata()
    assert meta["preempted"] == signal.Signals(preemption_signal()).name
    assert 20 <= meta["step"] < STEPS - 1
    runs = attempts(folder)
    assert len(runs) == 2 and runs[0]["start"] == 0 and runs[1]["pid"] != runs[0]["pid"]
    # The requeued job (a new process) found the commit on disk and started right after its step.
    assert result == runs[1] and result["resume"] == saved.id and result["start"] == meta["step"] + 1
    expected = load_file(str(ref_folder / "final.safetensors"))
    got = load_file(str(folder / "final.safetensors"))
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        assert torch.equal(value, got[key]), key
    assert "no problems found" in cli("fsck", "--read-data").output
