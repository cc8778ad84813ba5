"""The system test's Python lane: one long-lived ``system_driver.py`` process on repository
``base`` (system.py), on a branch of its own: ``commit_state`` in the foreground and in the
background, folder commits, compaction and pushes, one request at a time over its stdin, the
driver SIGKILLed at random moments; what it answered in full is acknowledged.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .helpers import tree_digest
from .system_model import OP_TIMEOUT, REMOTES

if TYPE_CHECKING:
    from .system import System

DRIVER = Path(__file__).with_name("system_driver.py")


class DriverLane:
    """The Python lane of one ``System`` on ``branch``."""

    def __init__(self, system: System, branch: str) -> None:
        self.system = system
        self.branch = branch

    def run(self, rng: random.Random) -> None:
        s, branch = self.system, self.branch
        driver: subprocess.Popen[str] | None = None
        try:
            while True:
                if driver is None or driver.poll() is not None:
                    driver = subprocess.Popen(
                        [sys.executable, str(DRIVER), str(s.repos["base"])],
                        env=s.env,
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.DEVNULL,
                        text=True,
                    )
                roll = rng.random()
                seed, loss = s.new_seed(rng), s.loss_value(rng)
                if roll < 0.55:
                    background = rng.random() < 0.5
                    kind = "commit_state (background)" if background else "commit_state"
                    request = {
                        "op": "state",
                        "seed": seed,
                        "n": s.settings.tensor_size,
                        "branch": branch,
                        "background": background,
                        "loss": loss,
                    }
                    content: dict[str, str] | int | None = seed
                elif roll < 0.75:
                    folder = s.source(seed, rng.choice(("both", "model")))
                    kind, content = "commit (driver)", tree_digest(folder)
                    request = {"op": "commit", "dir": str(folder), "seed": seed, "branch": branch, "loss": loss}
                elif roll < 0.85:
                    kind, content, request = "compact", None, {"op": "compact", "branch": branch}
                else:
                    remote = rng.choice(REMOTES)
                    kind, content, request = f"push {remote}", None, {"op": "push", "remote": remote, "ref": branch}
                started = s.attempt("base", branch, loss) if request["op"] in ("state", "commit") else s.now()
                op = s.next_op(kind)
                answer = self.ask(driver, rng, op, kind, request)
                if answer is not None and answer["ok"] and request["op"] in ("state", "commit"):
                    s.acknowledge(kind.split(" ")[0], answer["oid"], "base", branch, started, loss, content, op)  # type: ignore[arg-type]
                elif answer is not None and answer["ok"] and request["op"] == "push":
                    with s.lock:
                        s.pushed.append((request["remote"], f"refs/heads/{branch}", answer["oid"], op, started))
                shutil.rmtree(s.work / "src" / str(seed), ignore_errors=True)
        finally:
            if driver is not None and driver.poll() is None:
                driver.stdin.close()  # type: ignore[union-attr]
                driver.wait(timeout=OP_TIMEOUT)

    def ask(
        self, driver: subprocess.Popen[str], rng: random.Random, op: int, kind: str, request: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Send one request; SIGKILL the driver at a random moment; the answer, or None."""
        s = self.system
        delay = s.kill_delay(rng, kind)
        fired = threading.Event()

        def kill() -> None:
            fired.set()
            driver.send_signal(signal.SIGKILL)

        timer = threading.Timer(delay, kill) if delay is not None else None
        start = time.monotonic()
        try:
            driver.stdin.write(json.dumps(request) + "\n")  # type: ignore[union-attr]
            driver.stdin.flush()  # type: ignore[union-attr]
            if timer is not None:
                timer.start()
            line = driver.stdout.readline()  # type: ignore[union-attr]
        except (BrokenPipeError, OSError):
            line = ""
        finally:
            if timer is not None:
                timer.cancel()
                timer.join()  # a kill already under way completes before ``fired`` is read
        if fired.is_set():
            # The kill may land just after the answer was read: the operation is acknowledged, and
            # the lane must see the driver dead before its next request, not blame the next one.
            driver.wait(timeout=OP_TIMEOUT)
        if not line:
            driver.wait(timeout=OP_TIMEOUT)
            if delay is None:
                s.fail(f"op {op} {kind}: the driver died without being killed (exit {driver.returncode})")
            else:
                s.killed(op, kind, request)
            return None
        s.learn(kind, time.monotonic() - start)
        answer: dict[str, Any] = json.loads(line)
        s.outcome(
            op,
            kind,
            request,
            0 if answer["ok"] else answer["code"],
            "" if answer["ok"] else f"ckstore: {answer['error']}",
        )
        return answer
