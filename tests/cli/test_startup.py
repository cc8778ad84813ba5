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
from tests.helpers import checkpoint

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
    repo.wait_background()  # at rest: a `ckstore wait` then has nothing to settle
    return root / "repo"


HEAVY = ("numpy", "torch", "tqdm")


def imported_by(repo: Path, *args: str, tmp: Path, watch: tuple[str, ...] = HEAVY, ok: bool = True) -> list[str]:
    """Which of the ``watch`` modules the command ``ckstore ARGS`` imported (``ok``: it succeeded)."""
    out = tmp / "modules.json"
    env = {**os.environ, "CKSTORE_REPO": str(repo)}
    proc = subprocess.run([sys.executable, "-c", _PROBE, str(out), *args], capture_output=True, text=True, env=env)
    assert (proc.returncode == 0) == ok, proc.stderr
    loaded = set(json.loads(out.read_text()))
    return [m for m in watch if m in loaded]


@pytest.mark.parametrize(
    "args",
    [
        ("log",),
        ("log", "--json"),
        ("show",),
        ("show", "HEAD~1"),
        ("branch",),
        ("tag",),
        ("stats",),
        ("best", "loss"),
        ("fsck",),
    ],
)
def test_reading_commands_import_neither_numpy_nor_torch(
    small_repo: Path, tmp_path: Path, args: tuple[str, ...]
) -> None:
    assert imported_by(small_repo, *args, tmp=tmp_path) == []


def test_the_probe_sees_numpy_when_chunks_are_decoded(small_repo: Path, tmp_path: Path) -> None:
    # The probe must be able to fail: a checkout decodes delta chunks, which needs numpy.
    assert "numpy" in imported_by(small_repo, "checkout", "HEAD~1", "-o", str(tmp_path / "out"), tmp=tmp_path)


# What a command that writes or maintains nothing must not load (issue 22, item 5): the operations
# ``Repo`` delegates to are imported where they are called.
OPERATIONS = HEAVY + (
    "ckstore.write.commit",
    "ckstore.compaction.compact",
    "ckstore.write.ingest",
    "ckstore.read.checkout",
    "ckstore.read.export",
    "ckstore.remote.fetch",
    "ckstore.training.state",
    "ckstore.maintenance.repack",
)
# What status computes (gc's kept set, for what gc would free) is an operation the others skip.
STATUS_ONLY = (
    "ckstore.maintenance.gc",
    "ckstore.maintenance.kept",
    "ckstore.maintenance.sizes",
    "ckstore.repository.overlay",
)


@pytest.mark.parametrize("args", [("--help",), ("log", "-n", "1"), ("wait",), ("branch",), ("status",)])
def test_commands_that_start_often_load_no_operation_they_do_not_run(
    small_repo: Path, tmp_path: Path, args: tuple[str, ...]
) -> None:
    watch = OPERATIONS if args == ("status",) else OPERATIONS + STATUS_ONLY
    assert imported_by(small_repo, *args, tmp=tmp_path, watch=watch) == []


def test_the_probe_sees_the_operation_a_command_runs(small_repo: Path, tmp_path: Path) -> None:
    assert "ckstore.read.checkout" in imported_by(
        small_repo, "checkout", "HEAD", "-o", str(tmp_path / "out"), tmp=tmp_path, watch=OPERATIONS
    )


# What a checkout of a plain commit (no LoRA merge, no distributed checkpoint) does without: each
# is paid by every `ckstore checkout` process otherwise (docs/benchmarks.md, "Checkout of the
# newest commit, settled or as committed"). hashlib loads OpenSSL; manifests are read without it.
PLAIN_CHECKOUT_SKIPS = (
    "ckstore.read.lora",
    "ckstore.read.consolidate",
    "ckstore.format.dcp_record",
    "hashlib",
    "click.shell_completion",
)


def test_a_plain_checkout_loads_no_merging_consolidation_or_hashlib(small_repo: Path, tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    assert imported_by(small_repo, "checkout", "HEAD", "-o", out, tmp=tmp_path, watch=PLAIN_CHECKOUT_SKIPS) == []


# Start-up costs in CPU time (scripts/bench_startup.py, docs/benchmarks.md "Startup"): what
# `log -n 1` and `status` read needs none of these; they load with the writes that use them.
WRITERS_ONLY = (
    "concurrent.futures",
    "subprocess",
    "socket",
    "getpass",
    "secrets",
    "ckstore.runtime.pipeline",
    "ckstore.format.dcp_record",
    "ckstore.history.lanes",
)
# `--help` and a usage error open no repository: none of the repository layer.
REPOSITORY = (
    "ckstore.repo",
    "ckstore.repository.context",
    "ckstore.backend.local",
    "ckstore.format.manifest",
    "ckstore.codecs.objects",
    "zstandard",
    "blake3",
    "dataclasses",
)


@pytest.mark.parametrize("args", [("log", "-n", "1"), ("log", "--oneline"), ("show",)])
def test_reading_commands_load_nothing_only_writers_need(
    small_repo: Path, tmp_path: Path, args: tuple[str, ...]
) -> None:
    assert imported_by(small_repo, *args, tmp=tmp_path, watch=WRITERS_ONLY) == []


def test_status_loads_no_writer_but_what_its_remotes_need(small_repo: Path, tmp_path: Path) -> None:
    # Remote layouts use a thread pool (remote/layout.py): status lists the remotes' branches.
    watch = tuple(m for m in WRITERS_ONLY if m != "concurrent.futures")
    assert imported_by(small_repo, "status", tmp=tmp_path, watch=watch) == []


@pytest.mark.parametrize(
    "args, ok",
    [
        (("--help",), True),
        (("log", "--help"), True),
        (("--no-such-option",), False),
        (("no-such-command",), False),
    ],
)
def test_help_and_usage_errors_load_no_repository_code(
    small_repo: Path, tmp_path: Path, args: tuple[str, ...], ok: bool
) -> None:
    assert imported_by(small_repo, *args, tmp=tmp_path, watch=REPOSITORY, ok=ok) == []


def test_the_probe_sees_what_a_commit_loads(tmp_path: Path) -> None:
    # The watch lists above can fail: a commit loads the writers' modules.
    Repo.init(tmp_path / "repo")
    checkpoint(tmp_path / "ep" / "model.safetensors", seed=1)
    loaded = imported_by(
        tmp_path / "repo", "commit", str(tmp_path / "ep"), tmp=tmp_path, watch=WRITERS_ONLY + REPOSITORY
    )
    assert {"concurrent.futures", "ckstore.runtime.pipeline", "ckstore.repo", "zstandard"} <= set(loaded)


def test_every_command_is_listed_with_its_module() -> None:
    # The group imports a command's module by this table: a command missing from it would be
    # neither listed by --help nor found.
    import importlib

    from ckstore.cli.base import COMMAND_MODULES, main

    for module in set(COMMAND_MODULES.values()):
        importlib.import_module(f"ckstore.cli.{module}")
    defined = {name: (cmd.callback.__module__ if cmd.callback else "") for name, cmd in main.commands.items()}
    assert set(defined) - {"wait"} == set(COMMAND_MODULES)
    assert all(defined[name] == f"ckstore.cli.{module}" for name, module in COMMAND_MODULES.items())
