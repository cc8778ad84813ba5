"""A DCP save or load that fails at any step, on the coordinator or on another rank: every rank
gets CheckpointException, no branch moves, gc is not kept waiting by the failed save's lock, and
the next save and a bit-exact load work (two ranks, gloo, tests/dcp/fault_worker.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import ckstore
from tests.helpers import torchrun_script

WORKER = Path(__file__).parent / "fault_worker.py"


@pytest.mark.slow
def test_every_failed_step_of_a_save_or_load_leaves_the_repository_usable(tmp_path: Path) -> None:
    repo = ckstore.Repo.init(tmp_path / "repo")
    torchrun_script(WORKER, 2, str(repo.path), str(tmp_path))
    report = json.loads((tmp_path / "report.json").read_text())
    cases = [r["case"] for r in report]
    assert len(cases) == 31 and "save finish_plan on rank 1" in cases and "load read_data on rank 0" in cases
    assert {r["case"]: r["problems"] for r in report if r["problems"]} == {}
    assert ckstore.Repo(repo.path).fsck(read_data=True) == []
