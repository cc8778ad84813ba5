"""The long randomized run (scripts/reliability_soak.py), bounded: a few hundred operations by all
six lanes, gc, repack and remote gc SIGKILLed and Ctrl-C'd among them, and the full-disk lane on
a 4 MiB tmpfs (root only; without root the run goes on without that lane). Fails on any broken
promise: a loss, an fsck problem, a traceback, a gc that failed on the full disk, a commit refused
for want of space that left anything visible. As root the repositories live on a tmpfs too: a
SIGKILL leaves the same bytes in the page cache on any filesystem, and a loaded machine's fsyncs
would otherwise take most of the time.

``CKSTORE_SOAK_SEED=N`` replays a seed (the test prints the one it used).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckstore.transport.testserver import S3Server, ServerStartError, seaweedfs

from .helpers import count
from .system import Settings, run_system
from .system_disk import small_disk

SEED = int(os.environ.get("CKSTORE_SOAK_SEED", "39"))
CAN_MOUNT = os.geteuid() == 0 and shutil.which("mount") is not None


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    try:
        with seaweedfs(tmp_path_factory.mktemp("seaweedfs")) as server:
            yield server
    except ServerStartError as exc:
        pytest.fail(str(exc))


@pytest.mark.slow
def test_bounded_soak_with_interrupted_gc_and_a_full_disk_loses_nothing(tmp_path: Path, s3_server: S3Server) -> None:
    settings = Settings(
        seed=SEED,
        max_operations=300,
        max_seconds=240.0,
        kill_probability=0.2,
        gc_kill_probability=0.4,
        disk_bytes=(4 << 20) if CAN_MOUNT else 0,
    )
    if CAN_MOUNT:
        with small_disk(tmp_path / "ram", 1 << 30) as ram:
            report, log = run_system(settings, ram / "work", s3_server)
    else:
        report, log = run_system(settings, tmp_path / "work", s3_server)
    print(report.summary())
    count("soak (bounded): operations", report.total)
    count("soak (bounded): SIGKILLs", sum(report.kills.values()))
    count("soak (bounded): Ctrl-C", sum(report.interrupts.values()))
    count("soak (bounded): commits refused with ENOSPC", report.disk["commits refused with ENOSPC"])
    detail = report.summary() + "\n\noperation log:\n" + "\n".join(log)
    assert not report.losses and not report.failures, detail
    # the lanes really ran, gc among them (the count depends on the machine's load)
    assert report.total >= 40, detail
    assert sum(n for kind, n in report.operations.items() if kind.startswith(("gc", "repack"))) >= 3, detail
    assert report.verified >= 10, detail
    if CAN_MOUNT:
        assert report.operations["disk commit"] >= 5, detail
        assert report.disk["commits refused with ENOSPC"] >= 1, detail
