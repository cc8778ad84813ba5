"""``python tests/fault_cli.py ARGS…``: the ckstore CLI with test-only fault injection.

The environment variable ``CKSTORE_FAULT=ACTION@K`` makes the K-th mutating file-system step of
the process (every write, fsync, link, rename, unlink and mkdir of the local backend and of
checkout's output files; see ckstore/backend/fsio.py) do ACTION instead: ``kill`` (SIGKILL itself),
``enospc`` or ``eio`` (raise that OSError). ``CKSTORE_FAULT_COUNT=PATH`` writes the running step
count to PATH, so a harness can enumerate every K. ``CKSTORE_TEST_PACK_MIN_BYTES=N`` makes batches
of N bytes or more write local packs (backend/local_packs.py), so small test data takes that path.
``CKSTORE_TEST_BARRIER=DIR:N`` makes the process, once it has imported ckstore, wait (a minute at
most) until N processes have reached that point, then sleep ``CKSTORE_TEST_DELAY`` seconds: two
commands raced by a test start together however long each took to start on a loaded machine.
The production code only offers the seams.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from pathlib import Path


def _interrupted_while_starting(signum: int, frame: object) -> None:
    # As the ckstore command's own start-up (ckstore/cli/__init__.py): a Ctrl-C before the
    # command runs is a one-line message and exit 130, here while this wrapper imports ckstore.
    os.write(2, b"ckstore: interrupted\n")
    os._exit(130)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, _interrupted_while_starting)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout under test

from ckstore.backend import fsio  # noqa: E402
from ckstore.cli import CTRL_C, run  # noqa: E402

if __name__ == "__main__":
    signal.signal(signal.SIGINT, CTRL_C)  # the command's own handler, with no moment between the two


class FaultPlan:
    def __init__(self, spec: str, count_file: str | None) -> None:
        self.action, _, k = spec.partition("@")
        self.at = int(k) if k.isdigit() else 0
        self.count_file = count_file
        self.steps = 0

    def __call__(self) -> None:
        self.steps += 1
        if self.count_file:
            with open(self.count_file, "w") as f:
                f.write(str(self.steps))
        if self.steps != self.at:
            return
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.action == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if self.action == "eio":
            raise OSError(errno.EIO, os.strerror(errno.EIO))


def wait_at_barrier(spec: str, delay: float) -> None:
    """Arrive (a file of this process's own in DIR), wait for N arrivals, then ``delay``."""
    folder, _, count = spec.rpartition(":")
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / str(os.getpid())).touch()
    deadline = time.monotonic() + 60
    while len(os.listdir(folder)) < int(count) and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(delay)


if __name__ == "__main__":
    if "CKSTORE_TEST_PACK_MIN_BYTES" in os.environ:
        from ckstore.backend.local import LocalBackend

        LocalBackend.pack_min_bytes = int(os.environ["CKSTORE_TEST_PACK_MIN_BYTES"])
    # The harness counts and faults every mutating step of the command, the compaction after a
    # commit included: keep it in this process (the real CLI detaches it, compaction/detached.py, into
    # a process these faults would not reach).
    from ckstore.write.background import BackgroundWork

    BackgroundWork.detach_compaction = property(lambda self: False, lambda self, value: None)  # type: ignore[assignment]
    fsio.observe_steps(FaultPlan(os.environ.get("CKSTORE_FAULT", ""), os.environ.get("CKSTORE_FAULT_COUNT")))
    if os.environ.get("CKSTORE_TEST_BARRIER"):
        wait_at_barrier(os.environ["CKSTORE_TEST_BARRIER"], float(os.environ.get("CKSTORE_TEST_DELAY", "0")))
    run()
