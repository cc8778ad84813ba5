"""Preemption under a real Slurm: a one-node cluster (slurmctld and slurmd on loopback, started
here) runs the plain training loop as a ``--requeue`` batch job; the signal a scheduler sends
before it preempts (``scancel --batch --signal=USR1``, as ``--signal=B:USR1@90`` would) makes one
commit at the end of the step in progress, ``slurm_requeue`` puts the job back in the queue, and
the requeued run resumes from that commit and ends bit-exact with a run never stopped."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ckstore.repo import Repo
from tests.integrations.loops import LOOP, ROOT, STEPS, differences, final_state, run_loop

pytestmark = pytest.mark.skipif(
    shutil.which("slurmctld") is None or shutil.which("slurmd") is None,
    reason="Slurm is not installed (.ci/run and the README's set-up install slurm-wlm)",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(folder: Path) -> Path:
    """One node, this machine, no munge (auth/none: the daemons listen on loopback only)."""
    host = socket.gethostname().split(".")[0]
    for sub in ("state", "spool"):
        (folder / sub).mkdir()
    lines = [
        "ClusterName=ckstore-test",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={_free_port()}",
        f"SlurmdPort={_free_port()}",
        "AuthType=auth/none",
        "CredType=cred/none",
        f"SlurmUser={os.environ.get('USER', 'root') if os.geteuid() else 'root'}",
        f"StateSaveLocation={folder / 'state'}",
        f"SlurmdSpoolDir={folder / 'spool'}",
        f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
        f"SlurmdPidFile={folder / 'slurmd.pid'}",
        f"SlurmctldLogFile={folder / 'slurmctld.log'}",
        f"SlurmdLogFile={folder / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "MpiDefault=none",
        "SwitchType=switch/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "ReturnToService=2",
        "JobRequeue=1",
        f"NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} RealMemory=1000 State=UNKNOWN",
        "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
    ]
    conf = folder / "slurm.conf"
    conf.write_text("\n".join(lines) + "\n")
    return conf


def _until(what: str, check: Callable[[], bool], seconds: float = 120, state: Callable[[], object] = str) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {state()}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The environment that points Slurm's commands at a cluster started for these tests."""
    folder = tmp_path_factory.mktemp("slurm")
    conf = _config(folder)
    env = {**os.environ, "SLURM_CONF": str(conf), "PYTHONPATH": str(ROOT)}
    logs = folder / "daemons.err"
    with logs.open("w") as err:  # both daemons' start-up errors, where a failed start shows why
        daemons = [
            subprocess.Popen([command, "-D", *extra, "-f", str(conf)], env=env, stdout=subprocess.DEVNULL, stderr=err)
            for command, extra in (("slurmctld", ["-c", "-i"]), ("slurmd", []))
        ]
    try:

        def idle() -> bool:
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, check=False)
            return out.stdout.strip() == "idle"

        _until(f"the node to come up (see {logs})", idle, 60)
        yield env
    finally:
        for daemon in daemons:
            daemon.terminate()
        for daemon in daemons:
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                daemon.kill()


def _job(env: dict[str, str], job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "-o", "show", "job", job], env=env, capture_output=True, text=True, check=True)
    return dict(field.split("=", 1) for field in out.stdout.split() if "=" in field)


@pytest.mark.slow  # two Slurm daemons, a job run twice and a reference run
def test_a_signalled_slurm_job_commits_requeues_itself_and_resumes_bit_exact(
    slurm: dict[str, str], tmp_path: Path
) -> None:
    reference = run_loop(tmp_path / "reference")
    assert reference.wait(timeout=300) == 0, reference.communicate()
    expected = final_state(tmp_path / "reference")

    repo, out = tmp_path / "repo", tmp_path / "job.out"
    script = tmp_path / "train.sh"
    script.write_text(
        f"#!/bin/bash\nexec {sys.executable} {LOOP} {repo} {STEPS} --sleep 0.02 --signal USR1 --slurm-requeue\n"
    )
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--requeue", "--open-mode=append", "-o", str(out), "-D", str(tmp_path), str(script)],
        env=slurm,
        capture_output=True,
        text=True,
        check=True,
    )
    job = submitted.stdout.strip().split(";")[0]

    def lines() -> list[str]:
        return out.read_text().splitlines() if out.exists() else []

    _until("the job to start training", lambda: any(line.startswith("ready") for line in lines()))
    time.sleep(1.0)  # some way into the run, mid-step
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=slurm, check=True)

    # Slurm holds a requeued job back before it starts it again (its requeue delay, about two
    # minutes): starting it sooner with ``scontrol update StartTime=now`` can race slurmd's cleanup
    # of the first run ("Job credential revoked"), so the test waits as a cluster's user would.
    def details() -> dict[str, str]:
        return {k: v for k, v in _job(slurm, job).items() if k in ("JobState", "Reason", "Restarts", "StartTime")}

    _until("the job to be requeued", lambda: _job(slurm, job).get("Restarts") == "1", 120, details)
    _until("the requeued job to finish", lambda: _job(slurm, job)["JobState"] == "COMPLETED", 480, details)

    starts = [int(line.split()[1]) for line in lines() if line.startswith("ready")]
    assert starts[0] == 0 and len(starts) == 2 and 0 < starts[1] < STEPS, lines()
    history = Repo(repo).log("main")
    preempted = [e for e in history if Repo(repo).read_commit(e.id).decoded_metadata().get("preempted")]
    assert len(preempted) == 1 and Repo(repo).read_commit(preempted[0].id).decoded_metadata()["step"] == starts[1] - 1
    assert not Repo(repo).fsck(read_data=True)
    assert differences(final_state(repo), expected) == []
