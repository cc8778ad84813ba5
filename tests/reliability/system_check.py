"""The system test's verdict, once every lane has stopped: which acknowledged commits retention
excuses, and whether every repository, ref, commit and push still holds what was promised."""

from __future__ import annotations

import shutil
import subprocess
import threading
from pathlib import Path

from ckstore.repo import Repo
from ckstore.transport.testserver import S3Server

from .helpers import CLI, tree_digest
from .system_driver import same_state, state_for
from .system_model import OP_TIMEOUT, Acked, Attempt, Report, Retention, Settings


class Checks:
    """The checks of ``System`` (system.py), which holds the model they read."""

    settings: Settings
    work: Path
    server: S3Server
    report: Report
    lock: threading.Lock
    repos: dict[str, Path]
    urls: dict[str, str]
    env: dict[str, str]
    attempts: list[Attempt]
    acked: list[Acked]
    retention: list[Retention]
    pushed: list[tuple[str, str, str, int, float]]
    contents: dict[str, dict[str, str] | int]

    def excused(self, c: Acked) -> bool:
        """Could a retention policy that ran after ``c`` started have dropped it?"""
        for g in self.retention:
            if g.repo != c.repo or g.ended < c.started:
                continue
            same = [a for a in self.attempts if a.repo == c.repo and a.branch == c.branch and a.started < g.ended]
            if g.keep_last is not None and sum(a.started > c.started for a in same) >= g.keep_last:
                return True
            if g.keep_best is not None and sum(a.loss < c.loss for a in same) >= g.keep_best:
                return True
        return False

    def unacknowledged_excused(self, branch: str, read_at: float) -> bool:
        """A pushed branch value no process acknowledged was made by a commit killed after its ref
        moved: take the newest unacknowledged attempt on the branch before the value was read as
        its maker (the fewest later attempts, so the least excused) and ask retention about it."""
        answered = {(c.repo, c.branch, c.started) for c in self.acked}
        makers = [
            a
            for a in self.attempts
            if a.repo == "base"
            and a.branch == branch
            and a.started < read_at
            and (a.repo, a.branch, a.started) not in answered
        ]
        if not makers:
            return False
        maker = makers[-1]
        return self.excused(Acked("", maker.repo, maker.branch, "commit", maker.started, maker.loss, 0, 0))

    def check(self) -> None:
        for repo in self.repos.values():
            self.remove_stale_locks(repo)
        for name, path in self.repos.items():
            self.check_repo(name, path)
        for commit in self.acked:
            if commit.kind != "tag" and self.excused(commit):
                self.report.excused += 1
                continue
            problem = self.read_back(Repo(self.repos[commit.repo]), commit.oid, commit.content)
            if problem:
                self.report.losses.append(
                    f"{commit.kind} {commit.oid[:12]} on {commit.repo}/{commit.branch} (op {commit.op}): {problem}"
                )
            else:
                self.report.verified += 1
        for remote, url in self.urls.items():
            self.check_remote(remote, url)

    def remove_stale_locks(self, repo: Path) -> None:
        for lock in [*(repo / "refs").rglob("*.lock"), repo / "HEAD.lock"]:
            if lock.exists():
                lock.unlink()  # every process has ended: the documented recovery
                self.report.stale_locks += 1

    def check_repo(self, name: str, path: Path) -> None:
        repo = Repo(path)
        try:
            problems = repo.fsck(read_data=True)
        except Exception as exc:  # noqa: BLE001  (an fsck that cannot finish is the finding)
            problems = [f"fsck raised {type(exc).__name__}: {exc}"]
        if problems:
            self.report.failures.append(
                f"fsck --read-data on {name}: {len(problems)} problems: " + " | ".join(problems[:6])
            )
        refs = {f"refs/heads/{k}": v for k, v in repo.branches().items()}
        refs.update({f"refs/tags/{k}": v for k, v in repo.tags().items()})
        remotes = path / "refs" / "remotes"
        for p in sorted(remotes.rglob("*")) if remotes.is_dir() else []:
            if p.is_file() and not p.name.endswith(".lock"):
                refs[p.relative_to(path).as_posix()] = p.read_text().strip()
        for ref, oid in refs.items():
            problem = self.read_back(repo, oid, self.contents.get(oid))
            if problem:
                self.report.failures.append(f"{name} {ref} -> {oid[:12]}: {problem}")

    def read_back(self, repo: Repo, oid: str, content: dict[str, str] | int | None) -> str | None:
        """None when ``oid`` checks out (bit-exact against ``content`` when known), else why not."""
        out = self.work / "readback"
        shutil.rmtree(out, ignore_errors=True)
        try:
            if isinstance(content, int):
                state = repo.load_state(oid)
                return None if same_state(state, state_for(content, self.settings.tensor_size)) else "state differs"
            repo.checkout(oid, out)
            if content is not None and tree_digest(out) != content:
                return f"files differ: {sorted(tree_digest(out).items())} != {sorted(content.items())}"
            return None
        except Exception as exc:  # noqa: BLE001  (every failure to read back is the finding)
            return f"{type(exc).__name__}: {exc}"
        finally:
            shutil.rmtree(out, ignore_errors=True)

    def check_remote(self, remote: str, url: str) -> None:
        clone = self.work / f"clone-{remote}"
        args = [*CLI, "clone", url, str(clone)] + (["--endpoint-url", self.server.endpoint] if remote == "s3" else [])
        result = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=OP_TIMEOUT, check=False)
        if result.returncode != 0:
            self.report.failures.append(f"clone of remote {remote}: exit {result.returncode}: {result.stderr.strip()}")
            for r, ref, oid, op, _ in self.pushed:
                if r == remote:
                    self.report.losses.append(
                        f"push of {ref} {oid[:12]} to {remote} (op {op}): remote cannot be cloned"
                    )
            return
        self.check_repo(f"clone of {remote}", clone)
        repo = Repo(clone)
        excused = {c.oid for c in self.acked if c.kind != "tag" and self.excused(c)}
        acked = {c.oid for c in self.acked}
        for r, ref, oid, op, read_at in self.pushed:
            if r != remote:
                continue
            if ref.startswith("refs/heads/") and (
                oid in excused or (oid not in acked and self.unacknowledged_excused(ref[len("refs/heads/") :], read_at))
            ):
                continue  # a later push sends the history as retention left it ("pushed as pruned")
            problem = self.read_back(repo, oid, self.contents.get(oid))
            if problem is None and ref.startswith("refs/tags/") and repo.tags().get(ref[10:]) != oid:
                problem = f"the remote's tag holds {repo.tags().get(ref[10:])}"
            if problem:
                self.report.losses.append(f"push of {ref} {oid[:12]} to {remote} (op {op}): {problem}")
            else:
                self.report.verified += 1
