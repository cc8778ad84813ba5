"""The reflog and branch safety (issue 10, point 1): no silent loss of the current branch, an undo
for every ref change, gc that keeps what the reflog names until it expires."""

from __future__ import annotations

import json
import shlex
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckstore.backend.base import Backend
from ckstore.backend.local import LocalBackend
from ckstore.backend.memory import MemoryBackend
from ckstore.errors import (
    ForceRequiredError,
    InvalidInputError,
    RefExistsError,
    RefNotFoundError,
)
from ckstore.repo import Repo
from ckstore.repository import reflog as reflog_module
from ckstore.repository.reflog import DAY, Entry, RefLog, parse_line
from tests.helpers import Cli, checkpoint, object_count, tree_digest

MAIN = "refs/heads/main"


def strict_json(text: str) -> object:
    def refuse(constant: str) -> object:
        raise ValueError(f"invalid JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


def commits(repo: Repo, tmp_path: Path, n: int, branch: str | None = None, start: int = 0) -> list[str]:
    return [
        repo.commit(checkpoint(tmp_path / f"src{i}" / "ckpt.safetensors", seed=i), message=f"epoch {i}", branch=branch)
        for i in range(start, start + n)
    ]


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """A fake clock for reflog stamps and expiry: tests move ``clock[0]``."""
    now = [1_700_000_000.0]
    monkeypatch.setattr(reflog_module, "now", lambda: now[0])
    return now


# ---- the newcomer's story ---------------------------------------------------------------------


def test_newcomer_story_delete_main_gc_restore_prune(cli: Cli, tmp_path: Path) -> None:
    """The report of issue 10: 'branch -d main' then 'gc' wiped the repository silently."""
    cli("init", str(tmp_path / "repo"), repo=False)
    c1 = cli("commit", str(checkpoint(tmp_path / "a" / "m.safetensors", seed=1)), "-m", "one").output.strip()
    c2 = cli("commit", str(checkpoint(tmp_path / "b" / "m.safetensors", seed=2)), "-m", "two").output.strip()
    repo = Repo(tmp_path / "repo")
    objects = object_count(repo)

    refused = cli("branch", "-d", "main", code=6)
    assert "current branch" in refused.stderr and "--force" in refused.stderr
    assert repo.branches() == {"main": c2}
    deleted = cli("branch", "-d", "--force", "main")
    assert f"was {c2[:12]}" in deleted.output and repo.branches() == {}

    gc = cli("gc")
    assert "kept 2 commit(s) that only the reflog names" in gc.output
    assert "deleted 0 commit(s) and 0 object(s)" in gc.output
    assert object_count(Repo(tmp_path / "repo")) == objects

    entries = strict_json(cli("reflog", "--json").output)
    assert isinstance(entries, list)
    assert [(e["selector"], e["old"], e["new"], e["what"]) for e in entries] == [
        ("main@{0}", c2, None, "branch: deleted"),
        ("main@{1}", c1, c2, "commit: two"),
        ("main@{2}", None, c1, "commit (initial): one"),
    ]
    text = cli("reflog", "main").output.splitlines()
    assert text[0].split()[:2] == ["-", "main@{0}"] and f"(was {c2[:12]})" in text[0]
    assert text[1].split()[:2] == [c2[:12], "main@{1}"]

    cli("branch", "main", entries[1]["new"])  # the id the reflog showed
    assert Repo(tmp_path / "repo").branches() == {"main": c2}
    assert [e["id"] for e in strict_json(cli("log", "--json").output)] == [c2, c1]  # type: ignore[union-attr]
    cli("checkout", "main", "-o", str(tmp_path / "out"))
    assert tree_digest(tmp_path / "out") == tree_digest(tmp_path / "b")

    # Moved back one commit: gc keeps the commit left behind until --prune-now.
    cli("reset", "main~1")
    assert "deleted 0 commit(s)" in cli("gc").output
    pruned = cli("gc", "--prune-now").output
    assert f"deleted commit {c2}" in pruned and "deleted 1 commit(s)" in pruned
    assert "freed 0 B" not in pruned
    cli("log", c2, code=3)
    assert object_count(Repo(tmp_path / "repo")) < objects

    # Without any branch, a pruning gc would delete every commit: it says so and asks for --force.
    cli("branch", "-d", "main", "--force")
    refused = cli("gc", "--prune-now", code=6)
    assert "every commit" in refused.stderr and "--force" in refused.stderr
    assert object_count(Repo(tmp_path / "repo")) > 0
    assert (
        "would delete every commit of the repository (it needs --force)" in cli("gc", "--prune-now", "--dry-run").output
    )
    cli("gc", "--prune-now", "--force")
    assert object_count(Repo(tmp_path / "repo")) == 0


def test_plain_gc_after_deleting_every_branch_keeps_everything(repo: Repo, tmp_path: Path) -> None:
    ids = commits(repo, tmp_path, 2)
    repo.delete_branch("main", force=True)
    before = object_count(repo)
    report = repo.gc()
    assert report.deleted_objects == 0 and report.reflog_commits == sorted(ids)
    assert object_count(repo) == before


# ---- deleting branches ------------------------------------------------------------------------


def test_the_only_branch_needs_force_even_when_not_current(repo: Repo, tmp_path: Path) -> None:
    commits(repo, tmp_path, 1)
    repo.create_branch("exp")
    repo.delete_branch("main", force=True)  # HEAD now names a branch that does not exist
    with pytest.raises(ForceRequiredError, match="only branch"):
        repo.delete_branch("exp")
    repo.delete_branch("exp", force=True)
    assert repo.branches() == {}


def test_other_branches_and_tags_delete_without_force(repo: Repo, tmp_path: Path) -> None:
    (c1,) = commits(repo, tmp_path, 1)
    repo.create_branch("exp")
    repo.create_tag("v1")
    assert repo.delete_branch("exp") == c1 and repo.delete_tag("v1") == c1
    with pytest.raises(RefNotFoundError):
        repo.delete_branch("exp")
    assert [e.what for _, e in repo.reflog("v1")] == ["tag: deleted", "tag: created from HEAD"]


# ---- branch -f, reset, switch -----------------------------------------------------------------


def test_branch_force_moves_and_creates(cli: Cli, tmp_path: Path) -> None:
    cli("init", str(tmp_path / "repo"), repo=False)
    repo = Repo(tmp_path / "repo")
    c1, c2 = commits(repo, tmp_path, 2)
    cli("branch", "exp", c1)
    exists = cli("branch", "exp", c2, code=6)
    assert "already exists; use -f" in exists.stderr
    cli("branch", "-f", "exp", c2)
    cli("branch", "-f", "new", c1)  # -f on a missing branch creates it
    cli("tag", "v1", c1)
    cli("tag", "-f", "v1", c2)
    repo = Repo(tmp_path / "repo")
    assert repo.branches() == {"main": c2, "exp": c2, "new": c1} and repo.tags() == {"v1": c2}
    assert [(e.old, e.new, e.what) for _, e in repo.reflog("exp")] == [
        (c1, c2, f"branch: reset to {c2}"),
        (None, c1, f"branch: created from {c1}"),
    ]
    cli("branch", "-d", "exp", "main", code=5)  # -d takes no REF


def test_reset_moves_the_current_branch_only(repo: Repo, tmp_path: Path) -> None:
    c1, c2 = commits(repo, tmp_path, 2)
    repo.create_branch("exp")
    assert repo.reset("HEAD~1") == (c2, c1)
    assert repo.branches() == {"main": c1, "exp": c2}
    # The next commit continues from where reset put the branch.
    (c3,) = commits(repo, tmp_path, 1, start=5)
    assert repo.read_commit(c3).parents == (c1,)
    assert repo.resolve("main@{1}") == c1 and repo.resolve("main@{2}") == c2
    # A branch with no commits yet (HEAD names a deleted branch): reset creates it.
    repo.delete_branch("main", force=True)
    assert repo.reset("exp") == (None, c2)
    assert repo.branches()["main"] == c2


def test_switch_changes_the_branch_commits_go_to(cli: Cli, tmp_path: Path) -> None:
    cli("init", str(tmp_path / "repo"), repo=False)
    repo = Repo(tmp_path / "repo")
    (c1,) = commits(repo, tmp_path, 1)
    cli("tag", "v1")
    missing = cli("switch", "exp", code=3)
    assert "switch -c exp" in missing.stderr
    assert "is a tag" in cli("switch", "v1", code=3).stderr
    cli("switch", "exp", "main", code=5)  # START only with -c
    assert "switched to a new branch exp" in cli("switch", "-c", "exp").output
    assert cli("switch", "-c", "exp", code=6).stderr  # exists already
    assert "already on branch exp" in cli("switch", "exp").output
    repo = Repo(tmp_path / "repo")
    assert repo.head_branch == "exp"
    c2 = repo.commit(checkpoint(tmp_path / "x" / "m.safetensors", seed=9))
    assert repo.branches() == {"main": c1, "exp": c2}
    cli("switch", "main")
    assert Repo(tmp_path / "repo").head_branch == "main"
    # HEAD's reflog: switches, and the changes of whichever branch HEAD named at the time.
    whats = [e.what for _, e in Repo(tmp_path / "repo").reflog("HEAD")]
    assert whats == [
        "switch: moving from exp to main",
        "commit: ",
        "switch: moving from main to exp",
        "commit (initial): epoch 0",
    ]
    assert Repo(tmp_path / "repo").resolve("HEAD@{1}") == c2  # before the last switch: exp's tip
    cli("switch", "-c", "from-tag", "v1")
    assert Repo(tmp_path / "repo").branches()["from-tag"] == c1


def test_switch_to_the_deleted_current_branch_says_it_is_gone(cli: Cli, tmp_path: Path) -> None:
    cli("init", str(tmp_path / "repo"), repo=False)
    commits(Repo(tmp_path / "repo"), tmp_path, 1)
    cli("switch", "-c", "exp")
    cli("switch", "main")
    cli("branch", "-d", "--force", "main")
    assert "no branch 'main'" in cli("switch", "main", code=3).stderr
    assert "switched to branch exp" in cli("switch", "exp").output


def test_commit_to_another_branch_from_an_empty_one_logs_the_head_move(repo: Repo, tmp_path: Path) -> None:
    (c1,) = commits(repo, tmp_path, 1, branch="pretrained")
    assert repo.head_branch == "pretrained"
    ((_, head),) = repo.reflog("HEAD")[:1]
    assert head.what == "commit: moving from main to pretrained" and head.new == c1


# ---- revisions ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["lr=3e-4", "run#12", "exp(1)", "ünïcødé", "a/b/c"])
def test_names_git_accepts_have_reflogs_that_survive_deletion(cli: Cli, tmp_path: Path, name: str) -> None:
    cli("init", str(tmp_path / "repo"), repo=False)
    (c1,) = commits(Repo(tmp_path / "repo"), tmp_path, 1)
    cli("branch", name)
    deleted = cli("branch", "-d", name).output
    assert f"'ckstore branch {shlex.quote(name)} {c1[:12]}' restores it" in deleted
    cli("branch", "a")  # its log and that of a deleted "a/b/c" never collide in logs/
    cli("branch", "-d", "a")
    assert [e["selector"] for e in strict_json(cli("reflog", name, "--json").output)] == [  # type: ignore[union-attr]
        f"{name}@{{0}}",
        f"{name}@{{1}}",
    ]
    cli("branch", name, f"{name}@{{1}}")
    assert Repo(tmp_path / "repo").branches()[name] == c1
    assert Repo(tmp_path / "repo").fsck() == []


def test_reflog_revisions(repo: Repo, tmp_path: Path) -> None:
    c1, c2, c3 = commits(repo, tmp_path, 3)
    assert repo.resolve("main@{0}") == c3 and repo.resolve("@{1}") == c2
    assert repo.resolve("main@{1}~1") == c1 and repo.resolve("main@{2}") == c1
    with pytest.raises(RefNotFoundError, match="only 3 entries"):
        repo.resolve("main@{3}")
    repo.delete_branch("main", force=True)
    with pytest.raises(RefNotFoundError, match="was deleted then"):
        repo.resolve("main@{0}")
    assert repo.resolve("main@{1}") == c3
    with pytest.raises(RefNotFoundError, match="no reflog"):
        repo.resolve("nothing@{0}")
    with pytest.raises(InvalidInputError):
        repo.resolve("../x@{0}")


def test_an_entry_torn_by_a_crash_is_ignored_then_cut_off(repo: Repo, tmp_path: Path) -> None:
    c1, c2 = commits(repo, tmp_path, 2)
    assert repo.path is not None
    log = repo.path / "logs" / "refs" / "heads" / "main" / ".log"
    whole = log.read_bytes()
    with log.open("ab") as f:
        f.write(whole.splitlines(keepends=True)[-1][:50])  # a crash in the middle of an append
    assert [e.new for _, e in repo.reflog("main")] == [c2, c1]
    assert repo.fsck() == []
    repo.reset(c1)
    assert log.read_bytes().startswith(whole) and log.read_bytes().count(b"\n") == 3
    assert [e.new for _, e in repo.reflog("main")] == [c1, c2, c1]


def test_a_corrupt_entry_is_reported_and_stops_gc(cli: Cli, tmp_path: Path) -> None:
    cli("init", str(tmp_path / "repo"), repo=False)
    repo = Repo(tmp_path / "repo")
    commits(repo, tmp_path, 2)
    log = tmp_path / "repo" / "logs" / "refs" / "heads" / "main" / ".log"
    lines = log.read_bytes().splitlines(keepends=True)
    log.write_bytes(b"garbage\n" + lines[1])
    problems = Repo(tmp_path / "repo").fsck()
    assert len(problems) == 1 and "line 1 is corrupt" in problems[0]
    assert "line 1 is corrupt" in cli("gc", code=4).stderr  # gc cannot tell what it protected
    assert "line 1 is corrupt" in cli("reflog", code=4).stderr


def test_fsck_names_entries_whose_commits_are_gone(repo: Repo, tmp_path: Path) -> None:
    c1, c2 = commits(repo, tmp_path, 2)
    repo.reset(c1)
    repo.store.delete(c2)  # as an older ckstore's gc (which knew no reflog) would have
    (problem,) = repo.fsck()
    assert c2 in problem and "is missing" in problem and "reflog of refs/heads/main" in problem
    repo.gc()  # drops the stale entries
    assert repo.fsck() == []


@pytest.mark.parametrize(
    "line",
    [
        b"",
        b"x",
        b"0" * 64 + b" " + b"1" * 64 + b" 12.5 me",
        b"0" * 64 + b" " + b"1" * 64 + b" nan me\tx",
        b"0" * 63 + b" " + b"1" * 64 + b" 12.5 me\tx",
        b"0" * 64 + b" " + b"1" * 64 + b" 12.5 \tx",
        b"0" * 64 + b" " + b"1" * 64 + b" 12.5 me\t\xff",
    ],
)
def test_malformed_lines_do_not_parse(line: bytes) -> None:
    assert parse_line(MAIN, line) is None


def test_lines_round_trip_and_text_is_cleaned(repo: Repo) -> None:
    e = Entry(MAIN, None, "1" * 64, 12.5, "me@host", "commit: a")  # type: ignore[arg-type]
    assert parse_line(MAIN, e.line()[:-1]) == e
    repo.refs.logs.append(MAIN, None, "2" * 64, "commit: line\tone\nline two \ud800 é")  # type: ignore[arg-type]
    (entry,) = repo.refs.logs.read(MAIN)
    assert entry.what == "commit: line one line two   é" and " " not in entry.who


ids = st.none() | st.text("0123456789abcdef", min_size=64, max_size=64)


@settings(max_examples=300, deadline=None)
@given(old=ids, new=ids, stamp=st.floats(0, 4e9), what=st.text(max_size=400))
def test_any_entry_survives_its_line_with_its_text_cleaned(
    old: str | None, new: str | None, stamp: float, what: str
) -> None:
    log = RefLog(MemoryBackend())
    clock = reflog_module.now
    reflog_module.now = lambda: stamp  # type: ignore[assignment]
    try:
        log.append(MAIN, old, new, what)  # type: ignore[arg-type]
    finally:
        reflog_module.now = clock  # type: ignore[assignment]
    (entry,) = log.read(MAIN)
    none = "0" * 64
    assert (entry.old, entry.new) == (None if old in (None, none) else old, None if new in (None, none) else new)
    assert abs(entry.time - stamp) <= 1e-6 * max(1.0, stamp) and len(entry.what) <= 300
    assert entry.what == "".join(c if c.isprintable() else " " for c in what)[:300]


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.tuples(st.booleans(), st.integers(0, 300)), min_size=1, max_size=12), local=st.booleans())
def test_torn_appends_never_lose_or_merge_a_complete_entry(
    tmp_path_factory: pytest.TempPathFactory, steps: list[tuple[bool, int]], local: bool
) -> None:
    """Each step appends an entry, or (a crash) only a prefix of its line: readers see exactly the
    complete entries, in order, whatever tore before."""
    backend: Backend = LocalBackend(tmp_path_factory.mktemp("log")) if local else MemoryBackend()
    log = RefLog(backend)
    expected: list[str] = []
    for n, (torn, cut) in enumerate(steps):
        oid = f"{n + 1:064x}"
        if torn:
            line = Entry(MAIN, None, oid, 1.0, "me", "x").line()  # type: ignore[arg-type]
            data = backend.get(log.key(MAIN)) if backend.exists(log.key(MAIN)) else b""
            backend.replace(log.key(MAIN), data + line[: min(cut, len(line) - 1)])
        else:
            log.append(MAIN, None, oid, "x")  # type: ignore[arg-type]
            expected.append(oid)
        assert [e.new for e in log.read(MAIN)] == expected


# ---- expiry ---------------------------------------------------------------------------------------


def test_unreachable_entries_expire_after_30_days_reachable_after_90(
    repo: Repo, tmp_path: Path, clock: list[float]
) -> None:
    c1, c2 = commits(repo, tmp_path, 2)
    repo.reset(c1)  # c2 is now named only by the reflog
    start = clock[0]
    clock[0] = start + 29 * DAY
    assert repo.gc().unreachable_commits == [] and repo.store.has(c2)
    clock[0] = start + 31 * DAY
    report = repo.gc()
    assert report.unreachable_commits == [c2] and not repo.store.has(c2)
    assert report.expired_entries == 2  # c1 -> c2 (the second commit) and c2 -> c1 (the reset)
    assert [e.new for _, e in repo.reflog("main")] == [c1]  # the initial commit: reachable, kept
    clock[0] = start + 91 * DAY
    assert repo.gc().expired_entries == 1 and repo.reflog("main") == [] and repo.branches() == {"main": c1}
    with pytest.raises(RefNotFoundError):
        repo.resolve("main@{0}")


def test_expiry_is_configurable_and_old_configs_use_the_defaults(
    repo: Repo, tmp_path: Path, clock: list[float]
) -> None:
    from dataclasses import replace

    assert repo.path is not None
    doc = json.loads((repo.path / "config.json").read_text())
    assert (doc["reflog_expire_days"], doc["reflog_expire_unreachable_days"]) == (90, 30)
    del doc["reflog_expire_days"], doc["reflog_expire_unreachable_days"]  # as written before the reflog
    (repo.path / "config.json").write_text(json.dumps(doc))
    repo = Repo(repo.path)
    assert (repo.config.reflog_expire_days, repo.config.reflog_expire_unreachable_days) == (90, 30)
    c1, c2 = commits(repo, tmp_path, 2)
    repo.reset(c1)
    repo.set_config(replace(repo.config, reflog_expire_unreachable_days=1))
    clock[0] += 2 * DAY
    assert Repo(repo.path).gc().unreachable_commits == [c2]
    for bad in (-1, 36501, True):
        with pytest.raises(InvalidInputError, match="reflog_expire"):
            repo.set_config(replace(repo.config, reflog_expire_days=bad))


def test_config_command_sets_expiry(cli: Cli, tmp_path: Path) -> None:
    cli("init", str(tmp_path / "repo"), repo=False)
    cli("config", "reflog_expire_unreachable_days", "7")
    assert cli("config", "reflog_expire_unreachable_days").output.strip() == "7"
    assert "reflog_expire_days = 90" in cli("config").output
    cli("config", "reflog_expire_days", "40000", code=5)


def test_dry_run_expires_nothing(repo: Repo, tmp_path: Path) -> None:
    c1, c2 = commits(repo, tmp_path, 2)
    repo.reset(c1)
    dry = repo.gc(prune_now=True, dry_run=True)
    assert dry.expired_entries == 2 and dry.unreachable_commits == [c2]
    assert len(repo.reflog("main")) == 3 and repo.store.has(c2)
    real = repo.gc(prune_now=True)
    assert (real.expired_entries, real.unreachable_commits, real.freed_bytes) == (2, [c2], dry.freed_bytes)


def test_retention_policy_does_not_thin_what_only_the_reflog_holds(repo: Repo, tmp_path: Path) -> None:
    c1, c2, c3, c4 = commits(repo, tmp_path, 4)
    repo.reset(c2)  # c3 and c4 left the branch
    report = repo.gc(keep_last=1)
    assert report.pruned_commits == [c1]  # the policy thins the branch...
    assert all(repo.store.has(c) for c in (c2, c3, c4))  # ...not what only the reflog holds
    # The entry whose value was the pruned commit went with it; the others still resolve.
    assert all(c1 != e.new for _, e in repo.reflog("main"))
    assert repo.resolve("main@{1}") == c4
    assert repo.fsck() == []
    repo.reset("main@{1}")  # undo the reset: c4's history reads through the pruned record
    assert [e.id for e in repo.log()] == [c4, c3, c2]


def test_a_dependent_overlays_reflog_keeps_its_base_in_the_base_repository(tmp_path: Path) -> None:
    base_repo = Repo.init(tmp_path / "B", chunk_size=4096)
    base = base_repo.commit(checkpoint(tmp_path / "p" / "m.safetensors", seed=1))
    overlay_repo = Repo.init(tmp_path / "O", chunk_size=4096)
    tuned = overlay_repo.commit(
        checkpoint(tmp_path / "f" / "m.safetensors", seed=2), base="HEAD", base_repo=tmp_path / "B"
    )
    overlay_repo.delete_branch("main", force=True)  # only O's reflog names the overlay now
    base_repo.delete_branch("main", force=True)
    base_repo.gc(prune_now=True, force=True)
    assert base_repo.store.has_local(base)  # O's gc would still keep its overlay: so must B's
    overlay_repo.create_branch("main", tuned)
    assert overlay_repo.fsck(read_data=True) == []


# ---- concurrency ----------------------------------------------------------------------------------


def test_racing_commits_log_one_entry_each_in_order(repo: Repo, tmp_path: Path) -> None:
    paths = [checkpoint(tmp_path / f"p{i}" / "m.safetensors", seed=i, n=64) for i in range(8)]
    made: list[str] = []

    def work(i: int) -> None:
        made.append(Repo(repo.path).commit(paths[i], message=f"t{i}"))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    entries = [e for _, e in repo.reflog("main")][::-1]  # oldest first
    assert sorted(e.new for e in entries) == sorted(made)  # type: ignore[type-var]
    assert [e.old for e in entries] == [None, *(e.new for e in entries[:-1])]  # one chain, no gap


def test_refs_api_refuses_to_create_over_an_existing_branch(repo: Repo, tmp_path: Path) -> None:
    commits(repo, tmp_path, 1)
    with pytest.raises(RefExistsError, match="use -f"):
        repo.create_branch("main")


def test_gc_keep_last_keeps_the_surviving_tips_reflog(repo: Repo, tmp_path: Path) -> None:
    """Newcomer item 13: the README's flow (3 epochs, gc --keep-last 1); as in git, an entry
    stays while its new value exists, though its old one was pruned."""
    c1, c2, c3 = commits(repo, tmp_path, 3)
    report = repo.gc(keep_last=1)
    assert sorted(report.pruned_commits) == sorted([c1, c2])
    [(name, entry)] = repo.reflog("main")
    assert (name, entry.old, entry.new) == ("main@{0}", c2, c3)
    assert repo.resolve("main@{0}") == c3 and repo.fsck() == []
    assert [e.new for _, e in repo.reflog()] == [c3]  # HEAD's too
    again = repo.gc(keep_last=1)  # the old value being gone does not expire it later
    assert again.expired_entries == 0 and len(repo.reflog("main")) == 1
