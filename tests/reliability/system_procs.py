"""How the system test runs one CLI command: in a process of its own (tests/fault_cli.py) or in a
long-lived command server (cli_server.py), interrupted at a chosen moment by SIGKILL or SIGINT.

A process of its own is the user's path end to end, start-up included, and the only one a Ctrl-C
is sent to (the command's own handler answers it, as in a terminal). The server saves the start-up
of the interpreter and of ckstore, which costs more CPU than a small command, and is SIGKILLed
mid-command the same way; the next command starts a new one.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from .helpers import CLI

SERVER = Path(__file__).with_name("cli_server.py")
ROOT = Path(__file__).resolve().parents[2]
FRAME = re.compile(r'^\s*File "([^"]+)"', re.M)


@dataclass(frozen=True)
class Interruption:
    delay: float
    signum: int  # signal.SIGKILL or signal.SIGINT


@dataclass(frozen=True)
class Ran:
    """A command's end: ``code`` None when SIGKILL ended it (no answer, nothing to judge)."""

    code: int | None
    out: str = ""
    err: str = ""
    interrupted: int | None = None  # the signal sent, if it was sent before the command ended


def run_fresh(args: list[str], env: dict[str, str], interruption: Interruption | None, timeout: float) -> Ran:
    """``ckstore ARGS`` in a process of its own, signalled ``interruption.delay`` s after its start."""
    proc = subprocess.Popen([*CLI, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=interruption.delay if interruption else timeout)
        return Ran(proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        if interruption is None:
            proc.kill()
            proc.communicate()
            raise
    proc.send_signal(interruption.signum)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    if interruption.signum == signal.SIGKILL:
        return Ran(None, interrupted=signal.SIGKILL)
    return Ran(proc.returncode, out, err, interrupted=interruption.signum)


class Server:
    """One lane's command server; ``run`` starts one when there is none (or it was killed)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.proc: subprocess.Popen[str] | None = None
        self.started = 0

    def run(self, args: list[str], pack_min_bytes: int | None, kill_after: float | None, timeout: float) -> Ran:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(
                [sys.executable, str(SERVER)],
                env=self.env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            self.started += 1
        proc = self.proc
        fired = threading.Event()

        def kill() -> None:
            fired.set()
            proc.kill()

        timer = threading.Timer(kill_after if kill_after is not None else timeout, kill)
        try:
            proc.stdin.write(json.dumps({"args": args, "pack_min_bytes": pack_min_bytes}) + "\n")  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
            timer.start()
            line = proc.stdout.readline()  # type: ignore[union-attr]
        except (BrokenPipeError, OSError):
            line = ""
        finally:
            timer.cancel()
            if timer.is_alive():
                timer.join()
        if fired.is_set():
            proc.wait(timeout=timeout)  # a kill landing just after the answer: this server is done
            if kill_after is None:
                raise subprocess.TimeoutExpired(args, timeout)
        if not line:
            proc.wait(timeout=timeout)
            if kill_after is None or not fired.is_set():
                return Ran(1, err=f"Traceback: the command server died without being killed (exit {proc.returncode})")
            return Ran(None, interrupted=signal.SIGKILL)
        answer = json.loads(line)
        return Ran(answer["code"], answer["out"], answer["err"], interrupted=signal.SIGKILL if fired.is_set() else None)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()  # type: ignore[union-attr]
            self.proc.wait(timeout=60)


def traceback_in_ckstore(err: str) -> bool:
    """Whether a traceback on stderr passes through this checkout's code (ckstore, or the tests'
    CLI wrapper): a Ctrl-C inside the interpreter's own start-up (site, encodings) is not ckstore's."""
    return any(Path(f).resolve().is_relative_to(ROOT) for f in FRAME.findall(err) if not f.startswith("<"))
