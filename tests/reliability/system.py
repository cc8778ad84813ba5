"""A randomized whole-system test in the spirit of Jepsen (issue 21, item 5).

Several processes work on three repositories and two remotes at once, for a bounded number of
operations and seconds, and are SIGKILLed at random moments:

* lane ``cli`` (the ``ckstore`` CLI, repository ``base``, branch ``a``): commits of folders (some
  forced into a local pack), pushes of ``a`` to the S3 and the folder remote, and tags of an
  older acknowledged commit pushed to a remote (the F4 path);
* lane ``py`` (one long-lived ``system_driver.py`` process on ``base``, branch ``b``, system_lane_py.py):
  ``commit_state`` in the foreground and in the background, folder commits, compaction, pushes;
* lane ``overlay`` (CLI, repository ``ovl``): overlay commits on a recent acknowledged commit of
  ``base`` (the F3 path), and gc of ``ovl`` with retention;
* lane ``mirror`` (CLI, repository ``mirror``, a clone of the S3 remote): fetch and pull from both
  remotes (the F2 path), its own commits on branch ``m``, and plain gc;
* lane ``maint`` (CLI): gc of ``base`` (plain, ``--keep-last``, ``--keep-best``, ``--prune-now``,
  ``--repack``), ``repack``, and ``gc --remote`` of both remotes with a short grace period.

The model records what was acknowledged: a commit whose process answered its id (exit 0 and the
id printed, or the driver's answer read in full), a ref pushed by an exit-0 push, a tag created
by an exit-0 ``tag``. A commit is excused only when a gc with a retention policy that ran after
it started could have dropped it: keep-last N when N commits of its branch were attempted after
it (acknowledged or not), keep-best N when N attempted commits of its branch had a better loss.
At the end every stale ref lock is removed (the documented recovery), then:

* ``fsck --read-data`` is clean on every repository and on a fresh clone of every remote;
* every ref of every repository and of every clone resolves and checks out;
* every acknowledged commit that no retention policy excuses checks out bit-exact (files
  against the source bytes' SHA-256, states against the arrays committed);
* every acknowledged push (branch or tag) reads back bit-exact from a fresh clone of its remote.

Each broken promise is one entry in ``losses`` (data the user was told is safe, gone or wrong)
or ``failures`` (a repository that fails fsck or a ref that does not resolve; a traceback; an
integrity error during normal work). Everything random comes from the seed, printed first; the
interleaving of processes depends on timing, so a replay with the seed runs the same operations
and kills in the same order per lane, and the report lists the operations behind every finding.
Bounded: loopback addresses only, every loop ends by count or by time, every process has a timeout.
"""

from __future__ import annotations

import functools
import os
import random
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ckstore.repo import Repo
from ckstore.transport.testserver import S3Server, seaweedfs

from .helpers import CLI, checkpoint_bytes, cli_env, tree_digest
from .system_check import Checks
from .system_lane_py import DriverLane
from .system_model import (
    OP_TIMEOUT,
    REMOTES,
    STALE_LOCK,
    Acked,
    Attempt,
    Report,
    Retention,
    Settings,
    Stop,
    acked_oid,
)
from .system_procs import Interruption, Server, run_fresh, traceback_in_ckstore

ROOT = Path(__file__).resolve().parents[2]


class System(Checks):
    """The repositories, the remotes, the model, and the lanes that drive them."""

    def __init__(self, settings: Settings, work: Path, server: S3Server) -> None:
        self.settings = settings
        self.work = work
        self.server = server
        self.rng = random.Random(settings.seed)
        self.report = Report(settings.seed)
        self.lock = threading.Lock()
        self.deadline = time.monotonic() + settings.max_seconds
        self.started = time.monotonic()
        self.repos = {name: work / name for name in ("base", "ovl", "mirror")}
        self.urls = {
            "s3": f"s3://{server.bucket}/soak/{settings.seed}-{uuid.uuid4().hex[:8]}",
            "dir": str(work / "remote-dir"),
        }
        scrubbed = {k: v for k, v in cli_env().items() if not k.startswith("AWS_")}  # none of the developer's
        self.env = {
            **scrubbed,
            **server.env,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        self.attempts: list[Attempt] = []
        self.acked: list[Acked] = []
        self.retention: list[Retention] = []
        self.pushed: list[tuple[str, str, str, int, float]] = []  # remote, ref, oid, op, when its value was read
        self.contents: dict[str, dict[str, str] | int] = {}
        self.durations: dict[str, float] = {}
        self.log: list[str] = []
        self.local = threading.local()
        self.servers: list[Server] = []
        if settings.disk_bytes:
            self.repos["disk"] = work / "disk" / "repo"

    # ---- running operations ------------------------------------------------------------------

    def now(self) -> float:
        return time.monotonic() - self.started

    def next_op(self, kind: str) -> int:
        with self.lock:
            if self.report.total >= self.settings.max_operations or time.monotonic() >= self.deadline:
                raise Stop
            self.report.operations[kind] += 1
            total = self.report.total
            if self.settings.progress_every and total % self.settings.progress_every == 0:
                load = os.getloadavg()[0]
                self.report.loads.append(load)
                print(
                    f"{self.now():7.0f} s: {total} operations, {sum(self.report.kills.values())} kills, "
                    f"{sum(self.report.interrupts.values())} Ctrl-C, {sum(self.report.acknowledged.values())} "
                    f"acknowledged, {self.report.disk['commits refused with ENOSPC']} ENOSPC, "
                    f"{len(self.report.losses)} losses, {len(self.report.failures)} failures, load {load:.1f}",
                    flush=True,
                )
            return total

    def kill_delay(self, rng: random.Random, kind: str) -> float | None:
        """None (let it run), or a moment within the operation's usual duration to SIGKILL it."""
        if rng.random() >= self.settings.kill_probability:
            return None
        return rng.uniform(0.0, 1.2 * self.durations.get(kind, 1.5))

    def interruption(self, rng: random.Random, kind: str) -> Interruption | None:
        """None (let it run), or a moment within its usual duration to SIGKILL it or (a share of
        the time) to Ctrl-C it; gc, repack and remote gc are interrupted more often."""
        gc_like = kind.startswith(("gc", "repack"))
        chance = self.settings.gc_kill_probability if gc_like else self.settings.kill_probability
        if rng.random() >= chance:
            return None
        delay = rng.uniform(0.0, 1.2 * self.durations.get(kind, 1.5))
        ctrl_c = rng.random() < self.settings.sigint_share
        return Interruption(delay, signal.SIGINT if ctrl_c else signal.SIGKILL)

    def learn(self, kind: str, seconds: float) -> None:
        with self.lock:
            old = self.durations.get(kind, seconds)
            self.durations[kind] = 0.8 * old + 0.2 * seconds

    def command_server(self) -> Server:
        """This lane's command server (one per thread)."""
        server: Server | None = getattr(self.local, "server", None)
        if server is None:
            server = self.local.server = Server(self.env)
            with self.lock:
                self.servers.append(server)
        return server

    def cli(
        self,
        rng: random.Random,
        kind: str,
        repo: str | None,
        *args: str,
        pack_min_bytes: int | None = None,
        killable: bool = True,
    ) -> tuple[int, subprocess.CompletedProcess[str] | None]:
        """Run one CLI operation, maybe SIGKILLed or Ctrl-C'd; (op number, the result or None
        when SIGKILL ended it). A Ctrl-C and a share of the rest run in a process of their own."""
        op = self.next_op(kind)
        interruption = self.interruption(rng, kind) if killable else None
        argv = [*(["--repo", str(self.repos[repo])] if repo else []), *args]
        fresh = rng.random() < self.settings.fresh_share or (
            interruption is not None and interruption.signum == signal.SIGINT
        )
        start = time.monotonic()
        try:
            if fresh:
                env = (
                    self.env
                    if pack_min_bytes is None
                    else {**self.env, "CKSTORE_TEST_PACK_MIN_BYTES": str(pack_min_bytes)}
                )
                ran = run_fresh(argv, env, interruption, OP_TIMEOUT)
            else:
                ran = self.command_server().run(
                    argv, pack_min_bytes, interruption.delay if interruption else None, OP_TIMEOUT
                )
        except subprocess.TimeoutExpired:
            self.fail(f"op {op} {kind} ({' '.join(args)}) did not end in {OP_TIMEOUT:.0f} s")
            return op, None
        if ran.code is None:
            self.killed(op, kind, args)
            return op, None
        if ran.interrupted == signal.SIGINT:
            with self.lock:
                self.report.interrupts[kind] += 1
        else:
            self.learn(kind, time.monotonic() - start)
        result = subprocess.CompletedProcess(argv, ran.code, ran.out, ran.err)
        self.outcome(op, kind, args, result.returncode, ran.err, ctrl_c=ran.interrupted == signal.SIGINT)
        return op, result

    def killed(self, op: int, kind: str, what: object) -> None:
        with self.lock:
            self.report.kills[kind] += 1
            self.log.append(f"{self.now():7.2f} op {op} {kind} {what} KILLED")

    def outcome(self, op: int, kind: str, what: object, code: int, err: str, ctrl_c: bool = False) -> None:
        first = err.strip().splitlines()[0] if err.strip() else ""
        with self.lock:
            mark = " (Ctrl-C)" if ctrl_c else ""
            self.log.append(f"{self.now():7.2f} op {op} {kind} {what}{mark} -> {code} {first[:160]}")
            if code == 0:
                return
            if ctrl_c and "Traceback" in err and not traceback_in_ckstore(err):
                self.report.errors[f"{kind}: Ctrl-C inside the interpreter's own start-up"] += 1
                return
            if "Traceback" in err:
                frames = " | ".join(line.strip() for line in err.strip().splitlines()[-8:])  # where, not only what
                self.report.failures.append(f"op {op} {kind} {what}: traceback: {frames}")
            elif code == 4:
                self.report.failures.append(f"op {op} {kind} {what}: integrity error during normal work: {first}")
            self.report.errors[f"{kind} exit {code}: {' '.join(first.split()[1:5])}"] += 1
        self.recover_stale_lock(err)

    def recover_stale_lock(self, err: str) -> None:
        """The documented recovery: a ref lock whose process is gone is deleted."""
        match = STALE_LOCK.search(err)
        if match is None:
            return
        path, pid = Path(match.group(1)), int(match.group(2))
        try:
            os.kill(pid, 0)
            return  # alive: not stale after all
        except ProcessLookupError:
            pass
        path.unlink(missing_ok=True)
        with self.lock:
            self.report.stale_locks += 1

    def fail(self, message: str) -> None:
        with self.lock:
            self.report.failures.append(message)

    # ---- the model ---------------------------------------------------------------------------

    def source(self, seed: int, files: str = "both") -> Path:
        """A checkpoint folder for ``seed``: model.safetensors, and config.json unless ``files``
        is "model"."""
        folder = self.work / "src" / str(seed)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "model.safetensors").write_bytes(checkpoint_bytes(seed, self.settings.tensor_size))
        if files == "both":
            (folder / "config.json").write_text(f'{{"seed": {seed}}}\n')
        return folder

    def attempt(self, repo: str, branch: str, loss: float) -> float:
        started = self.now()
        with self.lock:
            self.attempts.append(Attempt(repo, branch, started, loss))
        return started

    def acknowledge(
        self,
        kind: str,
        oid: str,
        repo: str,
        branch: str,
        started: float,
        loss: float,
        content: dict[str, str] | int,
        op: int,
    ) -> None:
        with self.lock:
            self.acked.append(Acked(oid, repo, branch, kind, started, loss, content, op))
            self.contents[oid] = content
            self.report.acknowledged[kind] += 1

    def recent_acked(self, rng: random.Random, repo: str, branch: str, newest: int = 4) -> Acked | None:
        with self.lock:
            mine = [c for c in self.acked if c.repo == repo and c.branch == branch]
        return rng.choice(mine[-newest:]) if mine else None

    @staticmethod
    def new_seed(rng: random.Random) -> int:
        return rng.getrandbits(40)

    def loss_value(self, rng: random.Random) -> float:
        return round(rng.uniform(0.1, 5.0), 9)

    # ---- lanes -------------------------------------------------------------------------------

    def lane_cli(self, rng: random.Random, branch: str = "a") -> None:
        while True:
            roll = rng.random()
            if roll < 0.6:
                self.cli_commit(rng, branch)
            elif roll < 0.9:
                remote = rng.choice(REMOTES)
                read_at = self.now()
                value = (self.repos["base"] / "refs/heads" / branch).read_text().strip()
                op, result = self.cli(rng, f"push {remote}", "base", "push", remote, branch)
                if result is not None and result.returncode == 0:
                    with self.lock:
                        self.pushed.append((remote, f"refs/heads/{branch}", value, op, read_at))
            else:
                self.cli_tag_and_push(rng, branch)

    def cli_commit(self, rng: random.Random, branch: str) -> None:
        seed, loss = self.new_seed(rng), self.loss_value(rng)
        folder = self.source(seed)
        content = tree_digest(folder)
        packed = rng.random() < 0.25
        kind = "commit (pack)" if packed else "commit"
        started = self.attempt("base", branch, loss)
        op, result = self.cli(
            rng,
            kind,
            "base",
            "commit",
            str(folder),
            "--branch",
            branch,
            "--meta",
            f"loss={loss}",
            "-m",
            f"s{seed}",
            pack_min_bytes=1 if packed else None,
        )
        if oid := acked_oid(result):
            self.acknowledge("commit", oid, "base", branch, started, loss, content, op)
        shutil.rmtree(folder)

    def cli_tag_and_push(self, rng: random.Random, branch: str) -> None:
        with self.lock:
            older = [c for c in self.acked if c.repo == "base" and c.branch == branch][:-1]
        if not older:
            return
        target = rng.choice(older)
        name = f"t{self.new_seed(rng)}"
        op, result = self.cli(rng, "tag", "base", "tag", name, target.oid)
        if result is None or result.returncode != 0:
            return
        with self.lock:
            # a tag is kept by every gc: the commit it names is acknowledged again, with no excuse
            self.acked.append(Acked(target.oid, "base", f"tag {name}", "tag", 0.0, -1.0, target.content, op))
            self.report.acknowledged["tag"] += 1
        remote = rng.choice(REMOTES)
        op, result = self.cli(rng, f"push tag {remote}", "base", "push", remote, name)
        if result is not None and result.returncode == 0:
            with self.lock:
                self.pushed.append((remote, f"refs/tags/{name}", target.oid, op, self.now()))

    def lane_overlay(self, rng: random.Random) -> None:
        while True:
            if rng.random() < 0.8:
                base = self.recent_acked(rng, "base", "a")
                if base is None:
                    time.sleep(0.2)
                    continue
                seed, loss = self.new_seed(rng), self.loss_value(rng)
                folder = self.source(seed, "model")
                content = {**base.content, **tree_digest(folder)}  # type: ignore[dict-item]
                started = self.attempt("ovl", "o", loss)
                op, result = self.cli(
                    rng,
                    "overlay commit",
                    "ovl",
                    "commit",
                    str(folder),
                    "--base",
                    base.oid,
                    "--base-repo",
                    str(self.repos["base"]),
                    "--branch",
                    "o",
                    "--meta",
                    f"loss={loss}",
                )
                if oid := acked_oid(result):
                    self.acknowledge("overlay commit", oid, "ovl", "o", started, loss, content, op)
                shutil.rmtree(folder)
            else:
                keep = rng.randint(2, 5)
                started = self.now()
                op, result = self.cli(
                    rng, "gc overlay --keep-last", "ovl", "gc", "--keep-last", str(keep), "--prune-now"
                )
                with self.lock:
                    self.retention.append(Retention("ovl", started, self.now(), keep_last=keep))

    def lane_mirror(self, rng: random.Random) -> None:
        while True:
            roll = rng.random()
            remote = rng.choice(("origin", "dir"))
            if roll < 0.35:
                self.cli(rng, f"fetch {remote}", "mirror", "fetch", remote)
            elif roll < 0.6:
                self.cli(rng, f"pull {remote}", "mirror", "pull", remote)
            elif roll < 0.85:
                seed, loss = self.new_seed(rng), self.loss_value(rng)
                folder = self.source(seed)
                content = tree_digest(folder)
                started = self.attempt("mirror", "m", loss)
                op, result = self.cli(rng, "commit mirror", "mirror", "commit", str(folder), "--branch", "m")
                if oid := acked_oid(result):
                    self.acknowledge("commit", oid, "mirror", "m", started, loss, content, op)
                shutil.rmtree(folder)
            else:
                self.cli(rng, "gc mirror", "mirror", "gc")

    def lane_maint(self, rng: random.Random) -> None:
        while True:
            roll = rng.random()
            started = self.now()
            if roll < 0.25:
                self.cli(rng, "gc", "base", "gc")
            elif roll < 0.37:
                keep = rng.randint(4, 12)
                self.cli(rng, "gc --keep-last", "base", "gc", "--keep-last", str(keep), "--prune-now")
                with self.lock:
                    self.retention.append(Retention("base", started, self.now(), keep_last=keep))
            elif roll < 0.45:
                keep = rng.randint(4, 12)
                self.cli(
                    rng, "gc --keep-best", "base", "gc", "--keep-best", str(keep), "--metric", "loss", "--prune-now"
                )
                with self.lock:
                    self.retention.append(Retention("base", started, self.now(), keep_best=keep))
            elif roll < 0.55:
                self.cli(rng, "gc --repack", "base", "gc", "--repack")
            elif roll < 0.65:
                self.cli(rng, "repack", "base", "repack")
            else:
                remote = rng.choice(REMOTES)
                self.cli(
                    rng,
                    f"gc --remote {remote}",
                    "base",
                    "gc",
                    "--remote",
                    remote,
                    "--grace",
                    str(self.settings.remote_grace),
                )
            time.sleep(rng.uniform(0.0, 1.0))  # gc takes the lock exclusively: let writers through

    # ---- set-up, run, check ------------------------------------------------------------------

    def branches(self) -> list[str]:
        """The branches of ``base``: one per cli and py lane."""
        return ["a", "b", *(f"{x}{n}" for n in range(2, self.settings.parallel + 1) for x in "ab")]

    def setup(self) -> None:
        """Repositories with history on both branches, remotes holding it, a mirror cloned from S3."""
        rng = random.Random(self.settings.seed - 1)

        def must(*args: str, repo: str | None = None) -> str:
            result = subprocess.run(
                [*CLI, *(["--repo", str(self.repos[repo])] if repo else []), *args],
                env=self.env,
                capture_output=True,
                text=True,
                timeout=OP_TIMEOUT,
                check=False,
            )
            assert result.returncode == 0, (args, result.stderr)
            return result.stdout

        base = Repo.init(self.repos["base"])  # in-process: the set-up is not under test
        Repo.init(self.repos["ovl"])
        if "disk" in self.repos:
            Repo.init(self.repos["disk"])
        for branch in self.branches():
            seed, loss = self.new_seed(rng), self.loss_value(rng)
            folder = self.source(seed)
            started = self.attempt("base", branch, loss)
            oid = base.commit(folder, f"s{seed}", branch=branch, metadata={"loss": loss})
            self.acknowledge("commit", oid, "base", branch, started, loss, tree_digest(folder), 0)
        base.wait()
        base.switch("a")
        must("remote", "add", "s3", self.urls["s3"], "--endpoint-url", self.server.endpoint, repo="base")
        must("remote", "add", "dir", self.urls["dir"], repo="base")
        for remote in REMOTES:
            must("push", remote, *self.branches(), repo="base")
        must("clone", self.urls["s3"], str(self.repos["mirror"]), "--endpoint-url", self.server.endpoint)
        must("remote", "add", "dir", self.urls["dir"], repo="mirror")
        must("switch", "a", repo="mirror")

    def run(self) -> Report:
        self.setup()
        self.deadline = time.monotonic() + self.settings.max_seconds  # the budget is for the lanes
        lanes: dict[str, Callable[[random.Random], None]] = {
            "cli": self.lane_cli,
            "py": DriverLane(self, "b").run,
            "overlay": self.lane_overlay,
            "mirror": self.lane_mirror,
            "maint": self.lane_maint,
        }
        for n in range(2, self.settings.parallel + 1):  # more writers on branches of their own
            lanes[f"cli{n}"] = functools.partial(self.lane_cli, branch=f"a{n}")
            lanes[f"py{n}"] = DriverLane(self, f"b{n}").run
        if self.settings.disk_bytes:
            from .system_disk import DiskLane  # it builds on this module

            lanes["disk"] = DiskLane(self).run
        threads = []
        for name, lane in lanes.items():
            rng = random.Random(f"{self.settings.seed}/{name}")
            threads.append(threading.Thread(target=self.guard, args=(name, lane, rng), name=name, daemon=True))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for server in self.servers:
            server.close()
        self.report.seconds = time.monotonic() - self.started
        self.check()
        return self.report

    def guard(self, name: str, lane: Callable[[random.Random], None], rng: random.Random) -> None:
        try:
            lane(rng)
        except Stop:
            pass
        except Exception as exc:  # a bug of the harness must show, not hang the run
            self.fail(f"lane {name} crashed: {exc!r}")


@contextmanager
def s3_environment(folder: Path) -> Iterator[S3Server]:
    """A SeaweedFS server on loopback (the one tests/remote uses), for the soak script."""
    folder.mkdir(parents=True, exist_ok=True)
    with seaweedfs(folder) as server:
        yield server


def run_system(settings: Settings, work: Path, server: S3Server) -> tuple[Report, list[str]]:
    """Run one randomized system test in ``work`` (empty) against ``server``; the report and the
    operation log (one line per operation: time, number, kind, outcome)."""
    system = System(settings, work, server)
    if not settings.disk_bytes:
        return system.run(), system.log
    from .system_disk import small_disk

    with small_disk(work / "disk", settings.disk_bytes):
        return system.run(), system.log
