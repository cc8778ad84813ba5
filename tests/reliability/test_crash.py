"""Crash consistency: real ``ckstore`` processes killed with SIGKILL at every write step and at
random moments; after each kill the repository must keep every promise (helpers.verify_repo).

Every k: a clean run with ``CKSTORE_FAULT_COUNT`` counts the mutating steps N of a command (the
backend's writes, fsyncs, links, renames, unlinks and mkdirs, and checkout's output files); then
for k = 1..N the command runs again on a fresh copy with ``CKSTORE_FAULT=kill@k`` and SIGKILLs
itself just before step k. Random moments: the command runs on a larger checkpoint and the test
SIGKILLs it after a random delay within its write phase (measured by a clean run).

After each kill: ``fsck --read-data`` is clean; every ref holds its old or its new value; every
reachable commit checks out byte-identical; an output directory holds, under final names, only
complete files (old or new version). Then recovery as documented: a ref lock left by the killed
process is broken by the next ref update (the process is proven gone), the next checkout
removes dead temporaries, the next gc removes ``tmp/`` leftovers, and all of the above holds again.
"""

from __future__ import annotations

import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from .helpers import cli_env, count
from .scenarios import (
    RANDOM_SCENARIOS,
    SCENARIOS,
    Scenario,
    Template,
    argv,
    build_template,
    check_after,
    copy_template,
    count_steps,
)

pytestmark = pytest.mark.slow

RANDOM_KILLS_PER_SCENARIO = 40


@pytest.fixture(scope="module")
def large(tmp_path_factory: pytest.TempPathFactory) -> Template:
    return build_template(tmp_path_factory.mktemp("large"), 30_000, (11, 12, 13))


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_kill_at_every_step(scenario: Scenario, small_template: Template, tmp_path: Path) -> None:
    work = tmp_path / "work"
    steps, _ = count_steps(scenario, small_template, work)
    count(f"steps_{scenario.name}", steps)
    kills = 0
    for k in range(1, steps + 1):
        copy_template(small_template, work)
        proc = subprocess.run(
            argv(scenario, small_template, work),
            env=cli_env(CKSTORE_FAULT=f"kill@{k}"),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if proc.returncode == 0:  # threads can order steps differently; a run may finish under k
            continue
        assert proc.returncode == -signal.SIGKILL, (k, proc.returncode, proc.stderr)
        kills += 1
        check_after(scenario, small_template, work)
    assert kills >= steps * 0.8  # the step count of a run with threads varies a little
    count("kills_every_step", kills)


@pytest.mark.parametrize("scenario", RANDOM_SCENARIOS, ids=lambda s: s.name)
def test_kill_at_random_moments(scenario: Scenario, large: Template, tmp_path: Path) -> None:
    work = tmp_path / "work"
    steps, duration = count_steps(scenario, large, work)
    rng = random.Random(scenario.name)  # the same delays each run; where they land still varies with speed
    mid_operation = 0
    for _ in range(RANDOM_KILLS_PER_SCENARIO):
        copy_template(large, work)
        counter = work / "steps"
        proc = subprocess.Popen(
            argv(scenario, large, work),
            env=cli_env(CKSTORE_FAULT_COUNT=str(counter)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        while not counter.exists() and proc.poll() is None:
            time.sleep(0.0005)
        time.sleep(rng.uniform(0, duration))
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode in (0, -signal.SIGKILL), err
        if proc.returncode == -signal.SIGKILL:
            done = int(counter.read_text() or 0) if counter.exists() else 0
            mid_operation += done < steps
            count("kills_random")
        check_after(scenario, large, work)
    count(f"kills_random_mid_operation_{scenario.name}", mid_operation)
    assert mid_operation >= RANDOM_KILLS_PER_SCENARIO // 6, mid_operation  # most land mid-write
