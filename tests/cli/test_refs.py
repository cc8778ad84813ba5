"""What a git user types (issue 23, point 5; newcomer review items 10, 11, 15, 16, 21)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from ckstore.cli import main
from ckstore.history.lanes import graph_prefixes
from ckstore.repo import Repo
from tests.helpers import checkpoint


def run(repo: Path, *args: str, code: int = 0) -> Result:
    result = CliRunner().invoke(main, ["--repo", str(repo), *args], prog_name="ckstore")
    assert result.exit_code == code, (args, result.output)
    return result


@pytest.fixture
def history(tmp_path: Path) -> Path:
    """main: three commits with val_loss; exp: one commit off main~1; a tag; origin/main fetched."""
    repo = Repo.init(tmp_path / "r")
    for i in range(3):
        repo.commit(
            [checkpoint(tmp_path / "m.safetensors", i)], message=f"epoch {i}", metadata={"val_loss": 1 / (i + 1)}
        )
    repo.create_tag("v1", "HEAD~2")
    repo.create_tag("v2")
    repo.create_tag("best-run")
    repo.add_remote("origin", str(tmp_path / "remote"))
    repo.push("origin")
    repo.switch("exp", "HEAD~1")
    repo.commit([checkpoint(tmp_path / "m.safetensors", 7)], message="on exp", branch="exp")
    repo.switch("main")
    return tmp_path / "r"


def test_log_minus_n_is_git_s_count(history: Path) -> None:
    one = run(history, "log", "-1", "--oneline").stdout.splitlines()
    assert one == run(history, "log", "-n", "1", "--oneline").stdout.splitlines() and len(one) == 1
    assert len(run(history, "log", "--oneline", "-2").stdout.splitlines()) == 2
    assert len(run(history, "reflog", "-1").stdout.splitlines()) == 1


def test_log_all_and_graph(history: Path) -> None:
    lines = run(history, "log", "--all", "--graph", "--oneline").stdout.splitlines()
    assert lines[0].startswith("* ") and "(exp) on exp" in lines[0]
    assert lines[1].startswith("| * ") and "(HEAD -> main, tag: best-run, tag: v2)" in lines[1]
    assert lines[2] == "|/" and lines[3].startswith("* ") and "epoch 1" in lines[3]
    assert len([line for line in lines if "epoch" in line or "on exp" in line]) == 4
    ids = {e["id"] for e in json.loads(run(history, "log", "--all", "--json").stdout)}
    assert len(ids) == 4 and len(json.loads(run(history, "log", "--json").stdout)) == 3
    long = run(history, "log", "--graph", "-1").stdout.splitlines()
    assert long[0].startswith("* commit ") and long[1].startswith("| Date:")


def test_graph_of_a_merge_opens_and_closes_a_lane() -> None:
    rows = list(graph_prefixes([("m", ["a", "b"]), ("b", ["r"]), ("a", ["r"]), ("r", [])]))
    assert rows == [("*", ["|\\"]), ("| *", []), ("* |", ["|/"]), ("*", [])]


def test_branch_a_and_r_list_remote_tracking_branches(history: Path) -> None:
    listing = run(history, "branch", "-a").stdout.splitlines()
    assert [line[:2] + line[2:].split()[0] for line in listing] == ["  exp", "* main", "  remotes/origin/main"]
    assert run(history, "branch", "-r").stdout.split()[0] == "remotes/origin/main"
    doc = json.loads(run(history, "branch", "-r", "--json").stdout)
    assert "branches" not in doc and set(doc["remote_branches"]) == {"origin/main"}


def test_tag_l_with_a_pattern(history: Path) -> None:
    assert [line.split()[0] for line in run(history, "tag", "-l", "v*").stdout.splitlines()] == ["v1", "v2"]
    assert len(run(history, "tag", "-l").stdout.splitlines()) == 3
    assert json.loads(run(history, "tag", "-l", "best*", "--json").stdout)["tags"].keys() == {"best-run"}
    assert "branch" not in run(history, "tag", "--help").stdout  # item 16: the help was branch's


@pytest.mark.parametrize(
    "args",
    [
        ["commit"],
        ["checkout", "HEAD"],
        ["stat"],
        ["log", "-n", "0"],
        ["config", "reflog_expire_days", "-1"],
        ["log", "--no-such-option"],
    ],
)
def test_usage_errors_are_one_line_with_exit_2(history: Path, args: list[str]) -> None:
    result = run(history, *args, code=2)
    assert result.stderr.startswith("ckstore: ") and result.stderr.count("\n") == 1, result.stderr
    assert "Usage:" not in result.output and "--help" in result.stderr


def test_usage_error_from_the_installed_command(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "ckstore.cli", "commit"], capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and done.stderr.startswith("ckstore: ")
    assert subprocess.run([sys.executable, "-m", "ckstore.cli", "--version"], capture_output=True).returncode == 0


def test_log_best_with_a_metric_no_commit_records_is_an_error(history: Path) -> None:  # item 10
    result = run(history, "log", "--best", "val_lsos", code=3)
    assert "val_lsos" in result.stderr and result.stderr.count("\n") == 1
    assert "best val_loss" in run(history, "log", "--best", "val_loss", "--oneline").stdout


@pytest.mark.parametrize("option", ["--chunk-size", "--zstd-level"])
def test_init_refuses_0_like_config_does(tmp_path: Path, option: str) -> None:  # item 11
    result = CliRunner().invoke(main, ["init", option, "0", str(tmp_path / "r")])
    assert result.exit_code == 5 and "must be between" in result.stderr
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())


def test_init_creates_the_repository_that_repo_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # before: `--repo X init` made ./.ckstore and X stayed missing
    result = CliRunner().invoke(main, ["--repo", str(tmp_path / "runs"), "init"])
    assert result.exit_code == 0, result.output
    assert not (tmp_path / ".ckstore").exists()
    assert Repo.find(str(tmp_path / "runs")).path == (tmp_path / "runs").resolve()
    clash = CliRunner().invoke(main, ["--repo", str(tmp_path / "a"), "init", str(tmp_path / "b")])
    assert clash.exit_code == 2 and clash.stderr.count("\n") == 1 and "two places" in clash.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_progress_bars_use_binary_units() -> None:  # item 17: "368M/1.00G, 253MB/s" before
    from ckstore.cli.base import binary_bar

    bar = binary_bar(3 << 30, "commit")
    try:
        bar.update(400 << 20)
        text = str(bar)
    finally:
        bar.close()
    assert "400.0 MiB / 3.0 GiB" in text and re.search(r"[0-9.]+ [KMGT]iB/s", text)
    assert "MB/s" not in text and "1.00G" not in text


def test_diff_of_a_commit_against_a_folder_equals_the_diff_after_committing_it(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    repo = Repo.init(tmp_path / "r", chunk_size=4096)
    folder = tmp_path / "ck"
    checkpoint(folder / "model.safetensors", 1, n=5000)
    (folder / "config.json").write_text("{}")
    repo.commit([folder], message="one")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.w"] = tensors["model.w"] * 1.01
    tensors["model.extra"] = torch.ones(3)
    del tensors["optim.m"]
    save_file(tensors, folder / "model.safetensors")
    (folder / "notes.txt").write_text("new file")
    on_disk = json.loads(run(tmp_path / "r", "diff", "HEAD", str(folder), "--json").stdout)
    repo.commit([folder], message="two")
    committed = json.loads(run(tmp_path / "r", "diff", "HEAD~1", "HEAD", "--json").stdout)
    assert on_disk["b"] == str(folder)
    key = lambda c: (c["path"], c["name"] or "")  # noqa: E731
    assert sorted(((c["path"], c["name"], c["status"]) for c in on_disk["changes"]), key=str) == sorted(
        ((c["path"], c["name"], c["status"]) for c in committed["changes"]), key=str
    )
    disk = {key(c): c["rel_l2"] for c in on_disk["changes"]}
    for c in committed["changes"]:
        if c["rel_l2"] is not None:
            assert disk[key(c)] == pytest.approx(c["rel_l2"], rel=1e-12)
    assert disk[("model.safetensors", "model.w")] == pytest.approx(0.01, rel=1e-3)
    text = run(tmp_path / "r", "diff", "HEAD~1", str(folder) + "/").stdout
    assert "~ model.safetensors:model.w" in text and "to the files in" in text
    result = run(tmp_path / "r", "diff", "HEAD", str(tmp_path / "missing") + "/", code=5)
    assert result.stderr.startswith("ckstore: ") and result.stderr.count("\n") == 1


class _Bar:
    def __init__(self, total: int, desc: str, log: list) -> None:
        self.log = log
        log.append(("open", total, desc))

    def update(self, n: int) -> None:
        self.log.append(("update", n))

    def close(self) -> None:
        self.log.append(("close",))


def test_push_fetch_and_clone_report_progress(history: Path, tmp_path: Path) -> None:  # item 17
    repo = Repo(history)
    log: list = []
    repo.commit([checkpoint(tmp_path / "m.safetensors", 11)], message="more")
    report = repo.push("origin", progress=lambda total, desc: _Bar(total, desc, log))
    sent = sum(e[1] for e in log if e[0] == "update")
    assert log[0][0] == "open" and log[0][2] == "push origin" and log[-1] == ("close",)
    assert 0 < sent <= report.bytes and log[0][1] > 0
    log.clear()
    clone, _ = Repo.clone(str(tmp_path / "remote"), tmp_path / "c", progress=lambda total, desc: _Bar(total, desc, log))
    assert log[0] == ("open", 0, "fetch origin") and log[-1] == ("close",)  # 0: total unknown ahead
    assert sum(e[1] for e in log if e[0] == "update") > 0
    repo.commit([checkpoint(tmp_path / "m.safetensors", 12)], message="newer")
    repo.push("origin")
    log.clear()
    fetched = clone.fetch("origin", progress=lambda total, desc: _Bar(total, desc, log))
    assert sum(e[1] for e in log if e[0] == "update") == fetched.bytes > 0


def test_show_describes_a_training_state_in_words(tmp_path: Path) -> None:
    import torch

    repo = Repo.init(tmp_path / "r")
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    repo.commit_state(
        {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3, "note": (1, b"xy", float("nan"))}
    )
    text = run(tmp_path / "r", "show").stdout
    state = text[text.index("State:") :].split("\n\n")[0]
    assert "$" not in state  # no $odict, $tensor, $tuple, $bytes, $f64
    assert "model: 2 tensors (F32 ×2, 40 B): weight [2, 4], bias [2]" in state
    assert "optimizer: {state: 6 tensors (F32 ×6, 88 B), param_groups: " in state
    assert "epoch: 3" in state and "note: (1, 2 bytes, nan)" in state


def test_show_names_the_base_where_it_is_now(tmp_path: Path) -> None:  # item 7
    import shutil

    base = Repo.init(tmp_path / "a" / "base")
    base.commit([checkpoint(tmp_path / "p.safetensors", 1)], message="pretrained")
    overlay = Repo.init(tmp_path / "a" / "ovl")
    overlay.commit(
        [checkpoint(tmp_path / "f.safetensors", 2)], message="ft", base="HEAD", base_repo=tmp_path / "a" / "base"
    )
    shutil.move(tmp_path / "a", tmp_path / "b")  # the README's supported move of both
    moved = str((tmp_path / "b" / "base").resolve())
    assert f" in {moved}" in run(tmp_path / "b" / "ovl", "show").stdout
    assert json.loads(run(tmp_path / "b" / "ovl", "show", "--json").stdout)["base"]["repo"] == moved


def test_clone_into_a_folder_with_files_is_output_exists(history: Path, tmp_path: Path) -> None:  # item 18
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("mine")
    result = CliRunner().invoke(main, ["clone", str(tmp_path / "remote"), str(tmp_path / "full")])
    assert result.exit_code == 6 and "not an empty directory" in result.stderr
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["x"]


def test_commit_help_says_where_a_new_branch_starts() -> None:  # item 14
    text = " ".join(CliRunner().invoke(main, ["commit", "--help"]).stdout.split())
    assert (
        "starts at HEAD, as after 'git checkout -b'" in text
        and "--orphan With --branch NEW: start NEW with a root" in text
    )


def test_gc_in_a_base_says_which_commits_overlays_keep(tmp_path: Path) -> None:  # item 12
    base = Repo.init(tmp_path / "base")
    pretrained = base.commit([checkpoint(tmp_path / "p.safetensors", 1)], message="pretrained")
    overlay = Repo.init(tmp_path / "ovl")
    overlay.commit([checkpoint(tmp_path / "f.safetensors", 2)], message="ft", base="HEAD", base_repo=tmp_path / "base")
    base.commit([checkpoint(tmp_path / "p.safetensors", 3)], message="v2 base")
    text = run(tmp_path / "base", "gc", "--keep-last", "1").stdout
    assert "kept 1 commit(s) outside the policy that overlay repositories use as their base" in text
    doc = json.loads(run(tmp_path / "base", "gc", "--keep-last", "1", "--dry-run", "--json").stdout)
    assert doc["overlay_base_commits"] == [pretrained]


def test_commit_to_a_new_branch_starts_at_head_as_git_checkout_b(history: Path, tmp_path: Path) -> None:
    """Newcomer review item 14: ``commit --branch NEW`` branched an unrelated root commit."""
    head = Repo(history).resolve("HEAD")
    oid = run(
        history, "commit", str(checkpoint(tmp_path / "f.safetensors", 11)), "-m", "feature", "--branch", "feature"
    ).stdout.strip()
    repo = Repo(history)
    assert repo.read_commit(oid).parents == (head,)
    assert run(history, "log", "feature", "--oneline").stdout.splitlines()[1].startswith(head[:12])
    assert repo.resolve("HEAD") == head  # the current branch stays where it was
    # --orphan asks for the unrelated history explicitly; it needs a new branch's name.
    root = run(history, "commit", str(tmp_path / "f.safetensors"), "--branch", "fresh", "--orphan").stdout.strip()
    assert Repo(history).read_commit(root).parents == ()
    for args in (["--orphan"], ["--branch", "feature", "--orphan"]):
        error = run(history, "commit", str(tmp_path / "f.safetensors"), *args, code=5).output
        assert error == "ckstore: --orphan starts a new branch: name one that does not exist with --branch NEW\n"
    # In an empty repository the first commit is a root, whichever branch it goes to.
    Repo.init(tmp_path / "empty")
    first = run(tmp_path / "empty", "commit", str(tmp_path / "f.safetensors"), "--branch", "dev").stdout.strip()
    assert Repo(tmp_path / "empty").read_commit(first).parents == ()


def test_api_commit_to_a_new_branch_takes_a_start(tmp_path: Path) -> None:
    repo = Repo.init(tmp_path / "r")
    first = repo.commit([checkpoint(tmp_path / "m.safetensors", 0)])
    side = repo.commit([checkpoint(tmp_path / "m.safetensors", 1)], branch="side", start="HEAD")
    other = repo.commit([tmp_path / "m.safetensors"], branch="other")  # no start: an unrelated root, as before
    assert repo.read_commit(side).parents == (first,) and repo.read_commit(other).parents == ()
    with pytest.raises(Exception, match="nosuch"):
        repo.commit([tmp_path / "m.safetensors"], branch="third", start="nosuch")
    assert "third" not in repo.branches()
