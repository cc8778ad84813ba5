"""What the commands print: strict, documented JSON; one set of size figures; output people can scan.

Issue 10, points 5-7. Every ``--json`` document is parsed with a parser that refuses NaN and
Infinity and is checked against the field tables of docs/cli-json.md; the size figures of log,
diff, stats, gc and repack are checked against what gc really frees on disk.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner, Result
from hypothesis import given
from hypothesis import strategies as st
from safetensors.numpy import save_file

from ckstore.cli import main
from ckstore.repo import Repo

ROOT = Path(__file__).resolve().parents[2]
Cli = Callable[..., Result]


def strict_json(text: str) -> Any:
    """json.loads that refuses what RFC 8259 refuses: NaN, Infinity, -Infinity."""

    def refuse(name: str) -> Any:
        raise AssertionError(f"invalid JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Cli:
    monkeypatch.delenv("CKSTORE_REPO", raising=False)
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()

    def run(*args: str, code: int = 0, repo: Path | None = None) -> Result:
        argv = ["--repo", str(repo or tmp_path / "repo"), *args]
        result = runner.invoke(main, argv, prog_name="ckstore")
        assert result.exit_code == code, (argv, result.output, result.stderr, result.exception)
        return result

    return run


def _save(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return path


def epoch_folder(root: Path, epoch: int, n: int = 6000) -> Path:
    """A model + optimizer folder; each epoch moves the weights a little (so deltas pay) and
    leaves the frozen embedding alone (so chunks are shared between commits)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal(n).astype(np.float32)
    frozen = rng.standard_normal(3000).astype(np.float32)
    drift = np.random.default_rng(epoch).standard_normal(n).astype(np.float32)
    w = w + np.float32(1e-3 * epoch) * drift
    folder = root / f"ep{epoch}"
    _save(folder / "model.safetensors", {"embed.weight": frozen, "layer.weight": w})
    _save(
        folder / "optimizer.safetensors",
        {"state.0.exp_avg": w * 0.1, "state.0.exp_avg_sq": w * w, "state.1.exp_avg": frozen * 0.0},
    )
    return folder


def make_history(tmp_path: Path, cli: Cli, epochs: int = 4) -> list[str]:
    """``epochs`` commits on main; commit k records d{k}=1 and d{j}=0 otherwise, so
    ``gc --keep-best N-1 --metric d{k}`` drops exactly commit k (ties go to the newer commit)."""
    Repo.init(tmp_path / "repo", chunk_size=4096)
    ids = []
    for k in range(epochs):
        meta = [f"--meta=d{j}={int(j == k)}" for j in range(epochs)]
        out = cli(
            "commit",
            str(epoch_folder(tmp_path / "src", k)),
            "-m",
            f"epoch {k}",
            f"--meta=epoch={k}",
            f"--meta=val_loss={1.0 / (k + 1):.3f}",
            *meta,
        ).stdout
        ids.append(out.strip())
    cli("wait")  # the commits' compactions run detached: settle the figures the tests compare
    return ids


def disk_bytes(repo: Path) -> int:
    return sum(p.stat().st_size for p in (repo / "objects").rglob("*") if p.is_file())


# ---- point 5: every --json is valid, documented JSON -------------------------------------------


def test_diff_json_is_strict_and_an_object_when_the_base_tensor_is_all_zeros(cli: Cli, tmp_path: Path) -> None:
    Repo.init(tmp_path / "repo", chunk_size=4096)
    a = cli(
        "commit",
        str(
            _save(
                tmp_path / "a" / "m.safetensors",
                {"z": np.zeros(100, np.float32), "nan": np.full(4, np.nan, np.float32)},
            )
        ),
    ).stdout.strip()
    b = cli(
        "commit",
        str(_save(tmp_path / "b" / "m.safetensors", {"z": np.ones(100, np.float32), "nan": np.ones(4, np.float32)})),
    ).stdout.strip()
    doc = strict_json(cli("diff", a, b, "--json").stdout)
    assert doc["a"] == a and doc["b"] == b
    changes = {c["name"]: c for c in doc["changes"]}
    assert changes["z"]["rel_l2"] == "Infinity"  # ||b - a|| / ||a|| with a = 0: documented as a string
    assert changes["nan"]["rel_l2"] == "NaN"
    assert doc["totals"]["changed"] == 2 and doc["totals"]["new_bytes"] == sum(c["new_bytes"] for c in doc["changes"])
    assert "relative L2 change inf" in cli("diff", a, b).stdout


def test_non_finite_metadata_is_strict_json(cli: Cli, tmp_path: Path) -> None:
    Repo.init(tmp_path / "repo")
    cli(
        "commit",
        str(_save(tmp_path / "m.safetensors", {"x": np.ones(3, np.float32)})),
        "--meta",
        "val_loss=nan",
        "--meta",
        "best=inf",
    )
    entry = strict_json(cli("log", "--json").stdout)[0]
    assert entry["metadata"] == {"val_loss": "NaN", "best": "Infinity"}
    assert strict_json(cli("show", "--json").stdout)["metadata"]["val_loss"] == "NaN"


def _documented_fields() -> dict[str, dict[str, str]]:
    """docs/cli-json.md: for each ``### `ckstore CMD ...` `` heading, its table's field -> type."""
    text = (ROOT / "docs" / "cli-json.md").read_text()
    out: dict[str, dict[str, str]] = {}
    current = None
    for line in text.splitlines():
        heading = re.match(r"### `ckstore ([a-z]+)", line)
        if heading:
            current = heading.group(1)
            out[current] = {}
        elif current and line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            out[current][cells[0].strip("`")] = cells[1]
    return out


def _field_paths(doc: Any, free: set[str], prefix: str = "") -> Iterator[str]:
    """Dotted paths of a JSON document (``changes[].path``); map-typed fields are not entered."""
    if isinstance(doc, list):
        for item in doc:
            yield from _field_paths(item, free, prefix + "[]")
    elif isinstance(doc, dict):
        for key, value in doc.items():
            path = f"{prefix}.{key}" if prefix else key
            yield path
            if path not in free:
                yield from _field_paths(value, free, path)


def test_every_json_output_is_strict_and_documented(cli: Cli, tmp_path: Path) -> None:
    ids = make_history(tmp_path, cli, epochs=3)
    cli("tag", "v0", ids[0])
    seen: dict[str, set[str]] = {}
    documented = _documented_fields()

    def check(command: str, *args: str, code: int = 0) -> Any:
        doc = strict_json(cli(command, *args, "--json", code=code).stdout)
        fields = documented[command]
        free = {p for name, kind in fields.items() if kind.startswith("map") for p in (name, "[]." + name)}
        paths = {p.removeprefix("[].") for p in _field_paths(doc, free)}  # log: a list of entries
        undocumented = paths - set(fields)
        assert not undocumented, (command, undocumented)
        seen.setdefault(command, set()).update(paths)
        return doc

    commit = check("commit", str(epoch_folder(tmp_path / "src", 9)), "-m", "nine", "--meta", "epoch=9")
    assert commit["id"] == strict_json(cli("log", "-n", "1", "--json").stdout)[0]["id"]
    check("log")
    check("log", "--sizes")
    check("show")
    check("show", "--tensors")
    check("diff", "HEAD~1", "HEAD")
    check("stats")
    assert check("best", "val_loss")["id"] == ids[-1]  # the new commit records no val_loss
    check("branch")
    check("branch", "exp", "HEAD~1")
    check("branch", "-d", "exp")
    check("tag")
    check("tag", "v1")
    check("tag", "-d", "v1")
    check("checkout", "HEAD", "-o", str(tmp_path / "out"))
    check("fsck")
    check("fsck", "--read-data")
    check("gc", "--keep-last", "1", "--dry-run")
    check("gc", "--keep-last", "2")
    check("repack")
    cli("remote", "add", "origin", str(tmp_path / "remote"))
    assert check("push")["updated"][0]["ref"] == "refs/heads/main"
    status = check("status")
    assert (
        status["remotes"][0]["branches"][0]["ahead"] == 0
        and status["head"] == status["remotes"][0]["branches"][0]["local"]
    )
    assert set(check("branch", "-a")["remote_branches"]) == {"origin/main"}
    check("gc", "--remote", "origin", "--dry-run")
    legacy = tmp_path / "legacy.pt"
    import torch

    torch.save({"w": torch.ones(3)}, legacy)
    check("import", str(legacy))
    for command, fields in documented.items():
        assert command in seen, f"docs/cli-json.md documents {command} but the test never ran it"
        missing = {f for f in fields if not fields[f].endswith("(optional)")} - seen[command]
        assert not missing, (command, missing)


def test_best_json_names_the_metric_and_value(cli: Cli, tmp_path: Path) -> None:
    ids = make_history(tmp_path, cli, epochs=3)
    doc = strict_json(cli("best", "val_loss", "--json").stdout)
    assert doc["id"] == ids[-1] and doc["metric"] == "val_loss" and doc["value"] == pytest.approx(1 / 3, abs=1e-3)
    assert doc["mode"] == "min" and doc["message"] == "epoch 2"
    assert strict_json(cli("best", "val_loss", "--max", "--json").stdout)["id"] == ids[0]


def test_fsck_json_lists_problems_and_keeps_the_exit_code(cli: Cli, tmp_path: Path) -> None:
    ids = make_history(tmp_path, cli, epochs=2)
    assert strict_json(cli("fsck", "--json").stdout) == {
        "ok": True,
        "read_data": False,
        "problems": [],
        "unreachable_bases": 0,
    }
    repo = Repo(tmp_path / "repo")
    chunk = next(repo.read_commit(ids[-1]).all_chunks()).id
    (tmp_path / "repo" / "objects" / chunk[:2] / chunk[2:]).unlink()
    doc = strict_json(cli("fsck", "--json", code=4).stdout)
    assert doc["ok"] is False and len(doc["problems"]) == 1 and chunk in doc["problems"][0]


# ---- point 6: one set of size figures ----------------------------------------------------------


def test_held_alone_is_what_gc_frees_for_every_commit(cli: Cli, tmp_path: Path) -> None:
    ids = make_history(tmp_path, cli, epochs=4)
    cli("gc")  # no unreferenced objects: what gc frees below is what the dropped commit held
    sizes = {e["id"]: e for e in strict_json(cli("log", "--sizes", "--json").stdout)}
    assert strict_json(cli("stats", "--json").stdout)["unreferenced_bytes"] == 0
    held = [sizes[oid]["held_alone_bytes"] for oid in ids]
    assert all(h > 0 for h in held[:-1]), held  # each older commit holds its own deltas
    for k, oid in enumerate(ids[:-1]):  # the tip is never dropped by retention
        copy = tmp_path / f"copy{k}"
        shutil.copytree(tmp_path / "repo", copy)
        args = ("gc", "--keep-best", str(len(ids) - 1), "--metric", f"d{k}")
        dry = strict_json(cli(*args, "--dry-run", "--json", repo=copy).stdout)
        assert [c["id"] for c in dry["pruned_commits"]] == [oid]
        assert dry["freed_bytes"] == held[k], (k, dry, held)
        before = disk_bytes(copy)
        done = strict_json(cli(*args, "--json", repo=copy).stdout)
        assert done["freed_bytes"] == dry["freed_bytes"] == before - disk_bytes(copy)


def test_gc_frees_what_dry_run_and_stats_announced(cli: Cli, tmp_path: Path) -> None:
    make_history(tmp_path, cli, epochs=3)
    repo = Repo(tmp_path / "repo")
    repo.store.put_chunk(b"garbage" * 100)
    stats = strict_json(cli("stats", "--json").stdout)
    assert stats["stored_bytes"] == disk_bytes(tmp_path / "repo")
    dry = strict_json(cli("gc", "--dry-run", "--json").stdout)
    assert dry["freed_bytes"] == stats["unreferenced_bytes"] > 0
    assert dry["deleted_objects"] == stats["unreferenced_objects"] == 1
    before = disk_bytes(tmp_path / "repo")
    assert strict_json(cli("gc", "--json").stdout)["freed_bytes"] == before - disk_bytes(tmp_path / "repo")


def test_log_and_diff_agree_and_the_last_commit_holds_what_stats_stores(cli: Cli, tmp_path: Path) -> None:
    ids = make_history(tmp_path, cli, epochs=3)
    log = {e["id"]: e for e in strict_json(cli("log", "--sizes", "--json").stdout)}
    for parent, child in itertools.pairwise(ids):
        diff = strict_json(cli("diff", parent, child, "--json").stdout)
        assert diff["totals"]["new_bytes"] == log[child]["new_bytes"] > 0
        text = cli("diff", parent, child).stdout
        assert _human_in(log[child]["new_bytes"], text)
        # the figure recorded at commit time is shown beside it, named as log --sizes names it,
        # and the footer is one sentence
        footer = text.splitlines()[-1]
        assert f"{child[:12]} stores " in footer and footer.endswith(" added when committed)")
        assert _human_in(log[child]["added_bytes"], footer) and len(footer) < 120
    text = cli("log", "--sizes").stdout
    assert "added when committed" in text and "held alone" in text
    # after gc keeps one commit, that commit holds everything the repository stores
    cli("gc", "--keep-last", "1")
    only = strict_json(cli("log", "--sizes", "--json").stdout)
    stats = strict_json(cli("stats", "--json").stdout)
    assert len(only) == 1 and only[0]["held_alone_bytes"] == stats["stored_bytes"] == disk_bytes(tmp_path / "repo")
    assert only[0]["new_bytes"] <= stats["stored_bytes"]


def _human_in(n: int, text: str) -> bool:
    from ckstore.cli.base import human

    return human(n) in text


def test_repack_reports_the_stores_size_like_stats(cli: Cli, tmp_path: Path) -> None:
    make_history(tmp_path, cli, epochs=3)
    before = strict_json(cli("stats", "--json").stdout)["stored_bytes"]
    doc = strict_json(cli("repack", "--json").stdout)
    after = strict_json(cli("stats", "--json").stdout)["stored_bytes"]
    assert doc["stored_bytes_before"] == before and doc["stored_bytes_after"] == after
    again = strict_json(cli("repack", "--json").stdout)
    assert again["rewritten"] == 0 and again["stored_bytes_before"] == again["stored_bytes_after"] == after
    text = cli("repack").stdout
    assert "now deltas" not in text and "0 re-encoded" in text and "unchanged" in text


# ---- point 7: output people can scan -----------------------------------------------------------


def _wide_checkpoint(root: Path) -> Path:
    rng = np.random.default_rng(1)
    model = {
        f"encoder.layer.{i}.attention.self.query_key_value_projection.weight": rng.standard_normal(8).astype(np.float32)
        for i in range(60)
    }
    model["embeddings.word_embeddings.weight"] = rng.standard_normal(64).astype(np.float16)
    optim = {}
    for i in range(60):
        optim[f"state.{i}.exp_avg"] = np.zeros(8, np.float32)
        optim[f"state.{i}.exp_avg_sq"] = np.zeros(8, np.float32)
        optim[f"state.{i}.step"] = np.array([3.0], np.float32)
    _save(root / "model.safetensors", model)
    _save(root / "optimizer.safetensors", optim)
    return root


def test_show_summarises_by_default_and_lists_tensors_on_request(cli: Cli, tmp_path: Path) -> None:
    Repo.init(tmp_path / "repo")
    cli("commit", str(_wide_checkpoint(tmp_path / "ck")), "-m", "wide")
    text = cli("show").stdout
    lines = text.splitlines()
    assert len(lines) < 25, text
    assert all(line == line.rstrip() for line in lines), "trailing spaces"
    model = next(line for line in lines if line.startswith("model.safetensors"))
    assert "61 tensors" in model and "F32 ×60" in model and "F16 ×1" in model
    optim = "\n".join(lines[lines.index(next(x for x in lines if x.startswith("optimizer.safetensors"))) :])
    assert "180 tensors" in optim and "optimizer state" in optim
    assert "exp_avg ×60" in optim and "exp_avg_sq ×60" in optim and "step ×60" in optim

    full = cli("show", "--tensors").stdout.splitlines()
    assert all(line == line.rstrip() for line in full)
    rows = [line for line in full if line.startswith("  ") and ("F32" in line or "F16" in line)]
    assert len(rows) == 241
    columns = {line.index(" F32 ") if " F32 " in line else line.index(" F16 ") for line in rows[:61]}
    assert len(columns) == 1, "dtype column not aligned for long names"


def test_show_of_a_distributed_checkpoint_names_its_tensors_by_fully_qualified_name(cli: Cli, tmp_path: Path) -> None:
    from tests.helpers import dcp_adamw_run

    dcp_adamw_run(Repo.init(tmp_path / "repo"), 1, width=16)
    lines = cli("show").stdout.splitlines()
    rank = lines[next(i for i, x in enumerate(lines) if x.startswith("dcp/rank-00000.safetensors")) :]
    optim = next(x for x in rank if x.startswith("  optim "))
    # Two Linear layers: a weight and a bias each, one piece apiece on the one rank.
    assert "optimizer state" in optim and "exp_avg ×4" in optim and "exp_avg_sq ×4" in optim and "step ×4" in optim
    assert "lr ×1" in optim  # DCP's items, by their own names
    assert not any("@" in x for x in rank), rank  # not the names pieces are stored under


def test_gc_remote_says_in_one_sentence_why_it_uploads(capsys: pytest.CaptureFixture[str]) -> None:
    from ckstore.cli.remotes import report_remote_gc
    from ckstore.remote.gc import RemoteGcReport

    report_remote_gc(RemoteGcReport("origin", False, resent_objects=10, resent_bytes=4 << 20), as_json=False)
    line = capsys.readouterr().out.splitlines()[-1]
    assert line == "uploaded 10 smaller re-encoded object(s) (4.0 MiB) to replace bigger copies on the remote"


def test_log_oneline_limit_and_decorations(cli: Cli, tmp_path: Path) -> None:
    ids = make_history(tmp_path, cli, epochs=4)
    cli("branch", "exp", ids[1])
    cli("tag", "v0", ids[0])
    lines = cli("log", "--oneline").stdout.splitlines()
    assert len(lines) == 4 and all(line == line.rstrip() for line in lines)
    assert lines[0].startswith(ids[3][:12] + " (HEAD -> main) epoch 3")
    assert lines[2].startswith(ids[1][:12] + " (exp) epoch 1") and lines[3].startswith(
        ids[0][:12] + " (tag: v0) epoch 0"
    )
    assert len(cli("log", "-n", "2", "--oneline").stdout.splitlines()) == 2
    assert [e["id"] for e in strict_json(cli("log", "-n", "2", "--json").stdout)] == ids[:1:-1]
    exp = cli("log", "exp").stdout
    assert "(exp)" in exp and "main" not in exp  # commits made on main, but main points elsewhere
    assert "(tag: v0)" in exp
    entry = strict_json(cli("log", "exp", "--json").stdout)[0]
    assert entry["branches"] == ["exp"] and entry["tags"] == [] and entry["head"] is False
    best = cli("log", "--oneline", "--best", "val_loss").stdout.splitlines()
    assert "best val_loss" in best[0] and all("best" not in line for line in best[1:])
    best_max = cli("log", "--oneline", "--best", "val_loss", "--max").stdout.splitlines()
    assert "(tag: v0, best val_loss)" in best_max[3]
    cli("log", "-n", "0", code=2)


def test_gc_dry_run_names_commits_with_message_and_metadata(cli: Cli, tmp_path: Path) -> None:
    ids = make_history(tmp_path, cli, epochs=3)
    text = cli("gc", "--keep-last", "1", "--dry-run").stdout
    line = next(x for x in text.splitlines() if ids[0][:12] in x)
    assert "epoch 0" in line and "val_loss=1.0" in line
    doc = strict_json(cli("gc", "--keep-last", "1", "--dry-run", "--json").stdout)
    pruned = {c["id"]: c for c in doc["pruned_commits"]}
    assert pruned[ids[0]]["message"] == "epoch 0" and pruned[ids[0]]["metadata"]["epoch"] == 0


class Recorder:
    """A progress factory that remembers each bar's total and the sum of its updates."""

    def __init__(self) -> None:
        self.bars: dict[str, list[int]] = {}

    def __call__(self, total: int, desc: str) -> Recorder.Bar:
        self.bars[desc] = [total, 0]
        return Recorder.Bar(self.bars[desc])

    class Bar:
        def __init__(self, cell: list[int]) -> None:
            self.cell = cell

        def update(self, n: int) -> None:
            self.cell[1] += n

        def close(self) -> None:
            pass


def test_fsck_repack_and_gc_report_progress(cli: Cli, tmp_path: Path) -> None:
    make_history(tmp_path, cli, epochs=3)
    repo = Repo(tmp_path / "repo")
    repo.store.put_chunk(b"garbage" * 100)
    rec = Recorder()
    assert repo.fsck(read_data=True, progress=rec) == []
    repo.repack(progress=rec)
    repo.gc(keep_last=1, progress=rec)
    assert set(rec.bars) == {"fsck", "repack", "gc"}
    for desc, (total, done) in rec.bars.items():
        assert total > 0 and done == total, (desc, total, done)


def test_cli_passes_progress_to_fsck_repack_and_gc(cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_history(tmp_path, cli, epochs=2)
    rec = Recorder()
    from ckstore.cli import maintenance

    monkeypatch.setattr(maintenance, "progress_factory", lambda: rec)
    cli("fsck", "--read-data")
    cli("repack")
    Repo(tmp_path / "repo").store.put_chunk(b"garbage" * 100)
    cli("gc")
    assert set(rec.bars) == {"fsck", "repack", "gc"}


# ---- pieces: the strict encoder, the summary ----------------------------------------------------

_json_like = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=20,
)


@given(_json_like)
def test_print_json_is_strict_for_any_value(value: Any) -> None:
    from ckstore.cli.base import json_safe

    text = json.dumps(json_safe(value), allow_nan=False)  # would raise on a non-finite float

    def same(a: Any, b: Any) -> bool:
        if isinstance(a, float) and not math.isfinite(a):
            return isinstance(b, str) and (math.isnan(float(b)) if math.isnan(a) else float(b) == a)
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, list):
            return len(a) == len(b) and all(map(same, a, b))
        return a == b

    assert same(value, strict_json(text))


def test_show_groups_a_training_state_and_caps_many_groups(cli: Cli, tmp_path: Path) -> None:
    import torch

    repo = Repo.init(tmp_path / "repo")
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    repo.commit_state({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 1})
    text = cli("show").stdout
    state_file = text[text.index("state.safetensors") :]
    assert "8 tensors" in state_file.splitlines()[0]
    model_line = next(line for line in state_file.splitlines() if line.strip().startswith("model "))
    assert "2 tensors" in model_line and "optimizer state" not in model_line
    optim_line = next(line for line in state_file.splitlines() if line.strip().startswith("optimizer "))
    assert "optimizer state" in optim_line and "6 tensors" in optim_line
    assert "exp_avg ×2" in optim_line and "exp_avg_sq ×2" in optim_line and "step ×2" in optim_line

    many = {f"block{i}.weight": np.full(10 + i, i, np.float32) for i in range(12)}
    cli("commit", str(_save(tmp_path / "many" / "m.safetensors", many)))
    lines = cli("show").stdout.splitlines()
    groups = lines[lines.index(next(x for x in lines if x.startswith("m.safetensors"))) + 1 :]
    assert len(groups) == 8 and groups[-1].strip().startswith("(other groups)  5 tensors")
    assert groups[0].strip().startswith("block11")  # the largest first


def test_figures_that_need_a_missing_dependent_are_unknown_not_an_error(cli: Cli, tmp_path: Path) -> None:
    """gc refuses while an overlay repository of this one cannot be opened (it may have moved);
    stats and log --sizes still answer, and say which figures they cannot know."""
    Repo.init(tmp_path / "repo", chunk_size=4096)
    cli("commit", str(epoch_folder(tmp_path / "src", 0)))
    Repo.init(tmp_path / "overlay", chunk_size=4096)
    cli(
        "commit",
        str(epoch_folder(tmp_path / "src", 1)),
        "--base-repo",
        str(tmp_path / "repo"),
        repo=tmp_path / "overlay",
    )
    shutil.move(tmp_path / "overlay", tmp_path / "moved")
    stats = strict_json(cli("stats", "--json").stdout)
    assert stats["unreferenced_bytes"] is None and stats["unreferenced_objects"] is None
    assert stats["stored_bytes"] == disk_bytes(tmp_path / "repo") and stats["commits"] == 1
    assert "unknown" in cli("stats").stdout
    entry = strict_json(cli("log", "--sizes", "--json").stdout)[0]
    assert entry["held_alone_bytes"] is None and entry["new_bytes"] > 0
    assert "held alone unknown" in cli("log", "--sizes").stdout


def test_import_json_lists_the_commits_made_before_a_refused_file(cli: Cli, tmp_path: Path) -> None:
    import torch

    Repo.init(tmp_path / "repo")
    (tmp_path / "ckpts").mkdir()
    torch.save({"w": torch.ones(3)}, tmp_path / "ckpts" / "a_good.pt")
    torch.save({"where": Path("x")}, tmp_path / "ckpts" / "b_bad.pt")  # a global weights_only refuses
    result = cli("import", str(tmp_path / "ckpts"), "--recursive", "--json", code=5)
    doc = strict_json(result.stdout)
    assert [Path(i["source"]).name for i in doc["imported"]] == ["a_good.pt"]
    assert doc["imported"][0]["commit"] == Repo(tmp_path / "repo").resolve("HEAD")
    assert result.stderr.startswith("ckstore: ") and result.stderr.count("\n") == 1
