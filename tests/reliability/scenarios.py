"""Repositories and commands shared by the crash and fault-injection tests.

A ``Template`` is a small repository (three commits on ``main``, tag ``v1`` and branch ``dev`` on
the first, an unreferenced object, a checkout of the first commit in ``out/`` and the next
checkpoint in ``src/``) that every run copies afresh. A ``Scenario`` is one ckstore command and
the refs it may leave behind; ``check_after`` is the oracle plus the documented recovery.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ckstore.repo import Repo

from .helpers import (
    CLI,
    cli_env,
    count,
    ref_locks,
    refs_of,
    temp_files,
    tree_digest,
    verify_repo,
    write_checkpoint,
)


@dataclass
class Template:
    """A repository to copy before each kill, and what the oracle knows about it."""

    root: Path  # holds repo/, src/ (the next commit's files), out/ (a checkout target)
    contents: dict[str, dict[str, str]]  # commit id -> tree digest
    ids: dict[str, str]  # c1, c2, c3 (main), plus the tagged/branch names below
    new_digest: dict[str, str] = field(default_factory=dict)  # what src/ holds


def build_template(root: Path, n: int, seeds: tuple[int, ...]) -> Template:
    repo = Repo.init(root / "repo", chunk_size=4096)
    contents: dict[str, dict[str, str]] = {}
    ids: dict[str, str] = {}
    for i, seed in enumerate(seeds, start=1):
        digest = write_checkpoint(root / f"v{i}", seed, n)
        oid = repo.commit([root / f"v{i}"], message=f"epoch {i}")
        contents[oid] = digest
        ids[f"c{i}"] = oid
        shutil.rmtree(root / f"v{i}")
    repo.create_tag("v1", ids["c1"])
    repo.create_branch("dev", ids["c1"])
    repo.store.put_chunk(b"an unreferenced object that gc deletes")
    template = Template(root, contents, ids)
    template.new_digest = write_checkpoint(root / "src", seeds[-1] + 100, n)
    repo.checkout(ids["c1"], root / "out")  # an older version in the checkout target
    repo.wait()  # the last commit's compaction ends before the template is copied
    return template


@dataclass(frozen=True)
class Scenario:
    name: str
    args: Callable[[Template, Path], list[str]]  # CLI arguments given the template and the copy
    allowed: Callable[[Template], dict[str, set[str | None]]]  # ref -> acceptable values
    new_ref: str | None = None  # the ref a new commit may appear on
    env: tuple[str, ...] = ()  # NAME=VALUE settings of tests/fault_cli.py for this command


def _same_refs(t: Template) -> dict[str, set[str | None]]:
    return {"refs/heads/main": {t.ids["c3"]}, "refs/heads/dev": {t.ids["c1"]}, "refs/tags/v1": {t.ids["c1"]}}


def _with(**changes: set[str | None]) -> Callable[[Template], dict[str, set[str | None]]]:
    def allowed(t: Template) -> dict[str, set[str | None]]:
        out = _same_refs(t)
        for key, values in changes.items():
            ref = key.replace("__", "/")
            out[ref] = {t.ids.get(v, v) if isinstance(v, str) else v for v in values}
        return out

    return allowed


SCENARIOS = [
    Scenario(
        "commit",
        lambda t, w: ["commit", str(w / "src"), "-m", "new", "--branch", "main"],
        _with(refs__heads__main={"c3", "NEW"}),
        new_ref="refs/heads/main",
    ),
    # The commit's objects go into a pack (however small), which the compaction the CLI waits
    # for spreads into loose objects: kills land in the pack's writing and in its unpacking.
    Scenario(
        "commit-packed",
        lambda t, w: ["commit", str(w / "src"), "-m", "new", "--branch", "main"],
        _with(refs__heads__main={"c3", "NEW"}),
        new_ref="refs/heads/main",
        env=("CKSTORE_TEST_PACK_MIN_BYTES=0",),
    ),
    Scenario(
        "commit-new-branch",
        lambda t, w: ["commit", str(w / "src"), "--branch", "feat"],
        _with(refs__heads__feat={None, "NEW"}),
        new_ref="refs/heads/feat",
    ),
    Scenario("gc-keep-last", lambda t, w: ["gc", "--keep-last", "1"], _same_refs),
    Scenario("tag", lambda t, w: ["tag", "v2", t.ids["c2"]], _with(refs__tags__v2={None, "c2"})),
    Scenario("branch-delete", lambda t, w: ["branch", "-d", "dev"], _with(refs__heads__dev={"c1", None})),
    Scenario("checkout", lambda t, w: ["checkout", t.ids["c3"], "-o", str(w / "out"), "--force"], _same_refs),
    # branch -f takes reset's path (a ref update with its reflog entry); switch locks and logs HEAD.
    Scenario("reset", lambda t, w: ["reset", t.ids["c2"]], _with(refs__heads__main={"c3", "c2"})),
    Scenario("switch", lambda t, w: ["switch", "dev"], _same_refs),
]
RANDOM_SCENARIOS = [s for s in SCENARIOS if s.name in ("commit", "commit-packed", "gc-keep-last", "checkout")]


def copy_template(template: Template, work: Path) -> Path:
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(template.root, work, symlinks=True)
    return work


def argv(scenario: Scenario, template: Template, work: Path) -> list[str]:
    prefix = ["env", *scenario.env] if scenario.env else []  # env execs: the pid that is killed stays the CLI's
    return [*prefix, *CLI, "--repo", str(work / "repo"), *scenario.args(template, work)]


def count_steps(scenario: Scenario, template: Template, work: Path) -> tuple[int, float]:
    """Steps N of a clean run, and how long its write phase (first step to last step) lasted."""
    copy_template(template, work)
    counter = work / "steps"
    proc = subprocess.Popen(
        argv(scenario, template, work),
        env=cli_env(CKSTORE_FAULT_COUNT=str(counter)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    while not counter.exists() and proc.poll() is None:
        time.sleep(0.0005)
    start = last = time.monotonic()
    seen = ""
    while proc.poll() is None:  # watch the counter: the write phase ends at its last change
        text = counter.read_text()
        if text and text != seen:
            seen, last = text, time.monotonic()
        time.sleep(0.0005)
    err = proc.stderr.read() if proc.stderr else ""
    assert proc.returncode == 0, err
    steps = int(counter.read_text())
    assert steps > 0
    return steps, max(last - start, 0.002)


def check_after(scenario: Scenario, template: Template, work: Path, stale_locks_ok: bool = True) -> None:
    repo_path = work / "repo"
    contents = dict(template.contents)
    allowed = scenario.allowed(template)
    refs = refs_of(repo_path)
    if scenario.new_ref:
        new = refs.get(scenario.new_ref)
        old = template.ids["c3"] if scenario.new_ref.endswith("/main") else None
        allowed[scenario.new_ref] = (allowed[scenario.new_ref] - {"NEW"}) | ({new} if new != old else set())
        if new is not None and new != old:  # the kill came after the ref update: the commit is whole
            contents[new] = template.new_digest
            parent = Repo(repo_path).read_commit(new).parents
            assert parent == (template.ids["c3"],), parent  # a new branch starts at HEAD (main, c3)
    scratch = work / "scratch"
    verify_repo(repo_path, contents, allowed, scratch)
    if scenario.name == "checkout":
        out = work / "out"
        found = tree_digest(out)
        for name, digest in found.items():  # under its final name, a file is old or new, never partial
            assert digest in (
                template.contents[template.ids["c1"]].get(name),
                template.contents[template.ids["c3"]].get(name),
            ), name
        if temp_files(out):
            count("checkout_temporaries_left_by_kills")

    # Recovery, as documented in docs/reliability.md.
    repo = Repo(repo_path)
    if not stale_locks_ok:
        assert not ref_locks(repo_path), f"a failed command left {ref_locks(repo_path)}"
    assert repo.head_branch in (("main", "dev") if scenario.name == "switch" else ("main",))
    for lock in ref_locks(repo_path):
        ref = lock.relative_to(repo_path).as_posix()[: -len(".lock")]
        with repo.refs._ref_lock(ref):  # the step every ref update, delete and HEAD switch begins with
            pass  # the killed process is proven gone: its lock is broken, no user step
        assert not lock.exists()
        count("stale_ref_locks_broken")
    repo.gc()
    assert not temp_files(repo_path), temp_files(repo_path)
    if scenario.name == "checkout":
        repo.checkout(template.ids["c3"], work / "out", force=True)
        assert tree_digest(work / "out") == template.contents[template.ids["c3"]]
        assert not temp_files(work / "out"), "the next checkout removes dead temporaries"
    verify_repo(repo_path, contents, allowed, scratch)
