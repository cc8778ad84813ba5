"""The system test's full-disk lane: a repository on a small tmpfs that its commits fill up.

Lane ``disk`` (the CLI, repository ``disk``, branch ``d``) commits checkpoints larger than the
other lanes' until a commit fails for want of space; now and then another program (a filler file
beside the repository) takes all the space or all but a few KiB of it. A commit refused with
ENOSPC must leave nothing visible: the branch where it was, and ``fsck`` clean at once. Then the
user's remedy: plain ``gc`` (sometimes) and ``gc --keep-last N`` (with or without
``--prune-now``), each SIGKILLed or Ctrl-C'd at random like every command; a gc that ends must
exit 0 on the full disk (or, with no reserve left by an earlier interrupted gc and not one free
byte, refuse with the documented exit 7 and delete nothing), and the space it frees is measured.
Sometimes the filler is deleted afterwards (the user freeing space elsewhere). Commits after that
are acknowledged and checked bit-exact at the end like every other lane's (system.py ``check``),
retention excusing what ``--keep-last`` may drop.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from .helpers import checkpoint_bytes, tree_digest
from .system_model import Retention, acked_oid

if TYPE_CHECKING:
    from .system import System

BRANCH = "d"
RESERVE = "reserve"  # the space gc sets aside for a full disk (ckstore/backend/local.py)
NO_SPACE = "No space left"


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@contextmanager
def small_disk(folder: Path, size: int) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes mounted at ``folder`` (root only), unmounted afterwards."""
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        raise RuntimeError(f"cannot mount a {size}-byte tmpfs at {folder}: {mounted.stderr.strip()} (needs root)")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True, check=False)


class DiskLane:
    """The full-disk lane of one ``System``."""

    def __init__(self, system: System) -> None:
        self.system = system
        self.repo = system.repos["disk"]
        self.disk = self.repo.parent
        self.filler = self.disk / "filler"
        self.src = system.work / "src-disk"
        self.after_remedy = False  # the last remedy's gc ended with exit 0: the next commit is judged

    @property
    def events(self) -> dict[str, int]:
        return self.system.report.disk

    def count(self, event: str, n: int = 1) -> None:
        with self.system.lock:
            self.events[event] += n

    def run(self, rng: random.Random) -> None:
        while True:
            roll = rng.random()
            if self.filler.exists() and roll < 0.06:
                self.release_filler()
            elif roll < 0.08:
                self.fill_up(rng)
            elif roll < 0.14:
                self.gc(rng, ["gc"], "disk gc")
            else:
                self.commit(rng)

    def branch_value(self) -> str | None:
        try:
            return (self.repo / "refs" / "heads" / BRANCH).read_text().strip()
        except FileNotFoundError:
            return None

    def commit(self, rng: random.Random) -> None:
        system = self.system
        seed, loss = system.new_seed(rng), system.loss_value(rng)
        folder = self.src / str(seed)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "model.safetensors").write_bytes(checkpoint_bytes(seed, system.settings.disk_tensor_size))
        content = tree_digest(folder)
        before = self.branch_value()
        started = system.attempt("disk", BRANCH, loss)
        op, result = system.cli(
            rng, "disk commit", "disk", "commit", str(folder), "--branch", BRANCH, "--meta", f"loss={loss}"
        )
        shutil.rmtree(folder)
        if oid := acked_oid(result):
            system.acknowledge("disk commit", oid, "disk", BRANCH, started, loss, content, op)
            if self.after_remedy:
                self.count("commits acknowledged right after a remedy")
            self.after_remedy = False
            return
        if result is None or NO_SPACE not in result.stderr:
            return
        self.count("commits refused with ENOSPC")
        if self.after_remedy:
            self.count("commits refused again right after a remedy")
        self.after_remedy = False
        self.nothing_visible(rng, op, before)
        self.remedy(rng)

    def nothing_visible(self, rng: random.Random, op: int, before: str | None) -> None:
        """A refused commit leaves its branch where it was and the repository fsck-clean."""
        after = self.branch_value()
        if after != before:
            self.system.fail(f"op {op} disk commit refused with ENOSPC, yet branch {BRANCH} moved {before} -> {after}")
        fop, result = self.system.cli(rng, "disk fsck", "disk", "fsck", killable=False)
        if result is not None and result.returncode != 0:
            self.system.fail(
                f"op {fop} fsck right after a commit refused with ENOSPC: exit {result.returncode}: "
                f"{(result.stdout + result.stderr).strip()[:400]}"
            )
        else:
            self.count("fsck clean right after a refused commit")

    def remedy(self, rng: random.Random) -> None:
        """What a user does on a full disk: gc, and gc with a retention policy."""
        if rng.random() < 0.4:
            self.gc(rng, ["gc"], "disk gc (full)")
        keep = rng.randint(1, 3)
        prune = ["--prune-now"] if rng.random() < 0.5 else []
        ok = self.gc(rng, ["gc", "--keep-last", str(keep), *prune], "disk gc --keep-last (full)", keep_last=keep)
        if self.filler.exists() and rng.random() < 0.5:
            self.release_filler()
        self.after_remedy = ok

    def gc(self, rng: random.Random, args: list[str], kind: str, keep_last: int | None = None) -> bool:
        """One gc; True when it ended with exit 0. Judged: a gc that ends must not fail on a full
        disk, unless no reserve was left and not one byte is free (documented, exit 7)."""
        system = self.system
        had_reserve = (self.repo / RESERVE).exists()
        free_before = free_bytes(self.disk)
        started = system.now()
        op, result = system.cli(rng, kind, "disk", *args)
        if keep_last is not None:
            with system.lock:
                system.retention.append(Retention("disk", started, system.now(), keep_last=keep_last))
        if result is None or result.returncode == 130:
            return False
        if result.returncode == 0:
            freed = free_bytes(self.disk) - free_before
            if "(full)" in kind:
                self.count(f"{kind}: exit 0")
                self.count(f"{kind}: KiB freed", max(freed, 0) >> 10)
                if freed <= 0:
                    self.count(f"{kind}: freed nothing")
            if "for want of space" in result.stdout + result.stderr:
                self.count("gc left objects for want of space (exit 0)")
            return True
        if NO_SPACE in result.stderr and not had_reserve and free_before == 0:
            self.count("gc refused on a disk with no free byte and no reserve (documented)")
            return False
        system.fail(f"op {op} {kind} failed: exit {result.returncode}: {result.stderr.strip()[:300]}")
        return False

    def fill_up(self, rng: random.Random) -> None:
        """Another program takes all the free space, or all but a few KiB."""
        leave = rng.choice((0, 0, 4 << 10, 64 << 10))
        block = b"\0" * (1 << 20)
        with open(self.filler, "ab", buffering=0) as f:
            while len(block) >= 4096:
                try:
                    f.write(block)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    block = block[: len(block) // 2]
            size = f.tell()
        os.truncate(self.filler, max(0, size - leave))
        self.count("disk filled by another program")

    def release_filler(self) -> None:
        self.filler.unlink(missing_ok=True)
        self.count("filler deleted (space freed elsewhere)")
