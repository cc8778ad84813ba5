"""The system test's model: its settings, what it records (commit attempts, acknowledgements,
retention runs) and its report (system.py runs the lanes, system_check.py judges at the end)."""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from dataclasses import dataclass, field
from statistics import median

OID = re.compile(r"^[0-9a-f]{64}$", re.M)
STANDS = re.compile(r"interrupted after commit ([0-9a-f]{64}) was recorded")
STALE_LOCK = re.compile(r"stale lock (\S+) left by process (\d+)")
OP_TIMEOUT = 600.0
REMOTES = ("s3", "dir")


@dataclass(frozen=True)
class Settings:
    seed: int
    max_operations: int = 150
    max_seconds: float = 90.0
    kill_probability: float = 0.15
    gc_kill_probability: float = 0.3  # gc, repack and remote gc: the operations a user interrupts most
    sigint_share: float = 0.4  # of the interruptions of a CLI command, the share that is a Ctrl-C
    fresh_share: float = 0.3  # of the CLI commands not Ctrl-C'd, the share run in a process of their own
    parallel: int = 1  # copies of the cli and py lanes, each on a branch of its own
    disk_bytes: int = 0  # the size of the tmpfs the ``disk`` lane's repository fills (0: no such lane)
    tensor_size: int = 512
    disk_tensor_size: int = 128 << 10  # the disk lane's checkpoints: ~0.5 MiB, to fill its disk fast
    remote_grace: float = 15.0
    progress_every: int = 0  # print a line every N operations (0: quiet)


@dataclass
class Attempt:
    """A commit started on ``repo``/``branch`` (acknowledged or not): what retention may have seen."""

    repo: str
    branch: str
    started: float
    loss: float


@dataclass
class Acked:
    oid: str
    repo: str
    branch: str
    kind: str
    started: float
    loss: float
    content: dict[str, str] | int  # tree digest of the files, or the seed of a state
    op: int


@dataclass
class Retention:
    repo: str
    started: float
    ended: float
    keep_last: int | None = None
    keep_best: int | None = None


@dataclass
class Report:
    seed: int
    operations: Counter[str] = field(default_factory=Counter)
    kills: Counter[str] = field(default_factory=Counter)
    interrupts: Counter[str] = field(default_factory=Counter)  # Ctrl-C (SIGINT) delivered before the end
    disk: Counter[str] = field(default_factory=Counter)  # the full-disk lane's events
    errors: Counter[str] = field(default_factory=Counter)
    acknowledged: Counter[str] = field(default_factory=Counter)
    excused: int = 0
    verified: int = 0
    stale_locks: int = 0
    losses: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0
    loads: list[float] = field(default_factory=list)  # the 1-minute load average at each progress line

    @property
    def total(self) -> int:
        return sum(self.operations.values())

    def summary(self) -> str:
        lines = [
            f"seed {self.seed}: {self.total} operations in {self.seconds:.0f} s, "
            f"{sum(self.kills.values())} SIGKILLs, {len(self.losses)} losses, {len(self.failures)} failures"
        ]
        if self.loads:
            lines.append(f"load average {min(self.loads):.1f}-{max(self.loads):.1f} (median {median(self.loads):.1f})")
        lines.append("operations: " + ", ".join(f"{k} {v}" for k, v in sorted(self.operations.items())))
        lines.append("killed:     " + ", ".join(f"{k} {v}" for k, v in sorted(self.kills.items())))
        lines.append(
            f"Ctrl-C'd:   {sum(self.interrupts.values())}: "
            + ", ".join(f"{k} {v}" for k, v in sorted(self.interrupts.items()))
        )
        if self.disk:
            lines.append("full disk:  " + ", ".join(f"{k} {v}" for k, v in sorted(self.disk.items())))
        lines.append(
            "acknowledged: "
            + ", ".join(f"{k} {v}" for k, v in sorted(self.acknowledged.items()))
            + f"; verified bit-exact {self.verified}, excused by retention {self.excused}, "
            f"stale ref locks removed {self.stale_locks}"
        )
        if self.errors:
            lines.append(
                "clean errors (exit code, first words): "
                + "; ".join(f"{k} ×{v}" for k, v in self.errors.most_common(12))
            )
        lines += [f"LOSS: {x}" for x in self.losses] + [f"FAILURE: {x}" for x in self.failures]
        return "\n".join(lines)


def acked_oid(result: subprocess.CompletedProcess[str] | None) -> str | None:
    """The commit a command acknowledged: the id it printed on success, or the one an interrupted
    command says was recorded and stands."""
    if result is None:
        return None
    if result.returncode == 0:
        m = OID.search(result.stdout)
        return m.group(0) if m else None
    m = STANDS.search(result.stderr)
    return m.group(1) if m else None


class Stop(Exception):
    """The operation or time budget is spent."""
