"""Commands that decode no tensor start without numpy or torch (issue 10, point 8).

numpy alone took 0.14 s of `ckstore log`'s 0.4 s start; the timing itself is a benchmark
(scripts/bench_startup.py, docs/benchmarks.md), not a test: here we check which modules load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckstore.repo import Repo

from helpers import checkpoint

# Runs the real entry point, then reports which heavy modules the command imported.
_PROBE = """
import atexit, json, sys
report = sys.argv[1]
atexit.register(lambda: open(report, "w").write(json.dumps(sorted(sys.modules))))
sys.argv = ["ckstore"] + sys.argv[2:]
from ckstore.cli import run
run()
"""


@pytest.fixture(scope="module")
def small_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("startup")
    repo = Repo.init(root / "repo", chunk_size=4096)
    # Two commits, so the second stores chunks as deltas: reading them would need numpy.
    for i in range(2):
        folder = root / f"ep{i}"
        checkpoint(folder / "model.safetensors", seed=i)
        (folder / "config.json").write_text(json.dumps({"epoch": i}))
        repo.commit(folder, message=f"epoch {i}", metadata={"loss": 1.0 / (i + 1)})
    repo.create_tag("first", "HEAD~1")
    return root / "repo"


HEAVY = ("numpy", "torch", "tqdm")


def imported_by(repo: Path, *args: str, tmp: Path, watch: tuple[str, ...] = HEAVY) -> list[str]:
    """Which of the ``watch`` modules the command ``ckstore ARGS`` imported."""
    out = tmp / "modules.json"
    env = {**os.environ, "CKSTORE_REPO": str(repo)}
    proc = subprocess.run([sys.executable, "-c", _PROBE, str(out), *args], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    loaded = set(json.loads(out.read_text()))
    return [m for m in watch if m in loaded]


@pytest.mark.parametrize("args", [
    ("log",), ("log", "--json"), ("show",), ("show", "HEAD~1"), ("branch",), ("tag",), ("stats",),
    ("best", "loss"), ("fsck",),
])
def test_reading_commands_import_neither_numpy_nor_torch(small_repo: Path, tmp_path: Path, args: tuple[str, ...]) -> None:
    assert imported_by(small_repo, *args, tmp=tmp_path) == []


def test_the_probe_sees_numpy_when_chunks_are_decoded(small_repo: Path, tmp_path: Path) -> None:
    # The probe must be able to fail: a checkout decodes delta chunks, which needs numpy.
    assert "numpy" in imported_by(small_repo, "checkout", "HEAD~1", "-o", str(tmp_path / "out"), tmp=tmp_path)


# What a command that writes or maintains nothing must not load (issue 22, item 5): the operations
# ``Repo`` delegates to are imported where they are called.
OPERATIONS = HEAVY + (
    "ckstore.write.commit", "ckstore.write.compact", "ckstore.write.ingest", "ckstore.read.checkout",
    "ckstore.read.export", "ckstore.maintenance.gc", "ckstore.maintenance.sizes", "ckstore.repository.overlay",
    "ckstore.remote.fetch", "ckstore.training.state",
)


@pytest.mark.parametrize("args", [("--help",), ("log", "-n", "1"), ("wait",), ("branch",)])
def test_commands_that_start_often_load_no_operation_they_do_not_run(
    small_repo: Path, tmp_path: Path, args: tuple[str, ...]
) -> None:
    assert imported_by(small_repo, *args, tmp=tmp_path, watch=OPERATIONS) == []


def test_the_probe_sees_the_operation_a_command_runs(small_repo: Path, tmp_path: Path) -> None:
    assert "ckstore.read.checkout" in imported_by(small_repo, "checkout", "HEAD", "-o", str(tmp_path / "out"),
                                                  tmp=tmp_path, watch=OPERATIONS)
