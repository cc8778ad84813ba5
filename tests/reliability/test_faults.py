"""Fault injection: ENOSPC, then EIO, at the k-th mutating step of each command, for every k.

The command must exit 7 (StorageError, documented in errors.py and README) with one line naming
the failure and no traceback; the repository must stay consistent (helpers.verify_repo); a failed
command must not leave a ref lock behind; and the next gc removes every leftover temporary file.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from .helpers import assert_clean_error, cli_env, count
from .scenarios import SCENARIOS, Scenario, Template, argv, check_after, copy_template, count_steps

pytestmark = pytest.mark.slow

MESSAGES = {"enospc": "No space left on device", "eio": "Input/output error"}


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_fault_at_every_step(scenario: Scenario, small_template: Template, tmp_path: Path) -> None:
    work = tmp_path / "work"
    steps, _ = count_steps(scenario, small_template, work)
    for action, message in MESSAGES.items():
        for k in range(1, steps + 1):
            copy_template(small_template, work)
            proc = subprocess.run(
                argv(scenario, small_template, work),
                env=cli_env(CKSTORE_FAULT=f"{action}@{k}"),
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            if proc.returncode == 0:  # threads may order steps differently; the run ended under k
                continue
            assert_clean_error(proc, 7, message)
            count(f"faults_{action}")
            check_after(scenario, small_template, work, stale_locks_ok=False)
