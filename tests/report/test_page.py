"""`ckstore report` opened in a real browser (Debian's chromium, driven by playwright).

The page must load with no console error and no request but its own file, every plot must be
drawn, and its numbers must be those of `ckstore log --sizes --json` and `ckstore diff --json`.
Set CKSTORE_REPORT_SCREENSHOT=PATH to keep the screenshot (docs/report.png is made so).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import save_file

from ckstore.cli import main
from ckstore.repo import Repo

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
README = Path(__file__).resolve().parents[2] / "README.md"


def _cli(repo: Path, *args: str) -> str:
    result = CliRunner().invoke(main, ["--repo", str(repo), *args], prog_name="ckstore")
    assert result.exit_code == 0, (args, result.output)
    return result.stdout


def synthetic_history(root: Path, commits: int = 100) -> Path:
    """A training-like run: 4 layers moving less and less, an embedding frozen for the first half
    then unfrozen, a norm that explodes late, one NaN, val_loss and accuracy in the metadata, a
    tag, a second branch."""
    repo = Repo.init(root / "repo")
    repo.compact_after_commit = False  # speed: compaction does not change what the report shows
    rng = np.random.default_rng(0)
    names = ["embed.weight", "head.weight", "head.bias"] + [
        f"layers.{i}.{part}" for i in range(4) for part in ("attn.weight", "mlp.weight", "norm.weight")
    ]
    model = {n: rng.standard_normal(256).astype(np.float32) for n in names}
    folder = root / "ckpt"
    folder.mkdir()
    for step in range(commits):
        for n in names:
            frozen = n == "embed.weight" and step < commits // 2
            if not frozen and step:
                model[n] = model[n] + (0.05 / (1 + step / 10) * rng.standard_normal(256)).astype(np.float32)
        if step >= commits - 5:
            model["layers.3.norm.weight"] = model["layers.3.norm.weight"] * 3
        snapshot = dict(model)
        if step == commits // 3:
            snapshot["head.bias"] = snapshot["head.bias"].copy()
            snapshot["head.bias"][0] = np.nan
        save_file(snapshot, str(folder / "model.safetensors"))
        loss = 1.0 / (1 + step) + (0.2 if step > 70 else 0.0)
        repo.commit([folder], message=f"step {step}", metadata={"step": step, "val_loss": loss, "accuracy": 1 - loss})
        if step == 40:
            repo.create_tag("halfway")
    repo.create_branch("experiment", "HEAD~10")
    return root / "repo"


def readme_main_flow(root: Path) -> Path:
    """The README's main flow: its train_one_epoch.py, three epochs, each committed with val_loss."""
    text = README.read_text()
    script = re.search(r"```python file=train_one_epoch.py\n(.*?)```", text, re.S).group(1)
    (root / "train_one_epoch.py").write_text(script)
    repo = root / ".ckstore"
    Repo.init(repo)
    for epoch in (1, 2, 3):
        loss = subprocess.run(
            [sys.executable, "train_one_epoch.py", "--out", "ckpt/"],
            cwd=root,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        _cli(
            repo,
            "commit",
            str(root / "ckpt"),
            "-m",
            f"epoch {epoch}",
            "--meta",
            f"epoch={epoch}",
            "--meta",
            f"val_loss={loss}",
        )
    _cli(repo, "wait")  # the compactions run detached: the report and log --sizes must see one store
    return repo


def open_in_browser(html: Path, screenshot: Path) -> dict[str, Any]:
    """Load ``html`` in headless chromium; return what the page shows and what happened."""
    if not os.path.exists(CHROMIUM):
        pytest.fail("chromium is not installed: .ci/run installs it (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    requests: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 1000})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(html.as_uri(), wait_until="load")
            shown = page.evaluate("""() => ({
              plots: [...document.querySelectorAll('.plot')].map(d => {
                const svg = d.querySelector('svg'); const box = svg ? svg.getBoundingClientRect() : null;
                return {kind: d.dataset.plot, best: d.dataset.best || null,
                        paths: svg ? svg.querySelectorAll('path, use').length : 0,
                        width: box ? box.width : 0, height: box ? box.height : 0};
              }),
              storage: [...document.querySelectorAll('#storage tr[data-id]')].map(tr => {
                const row = {id: tr.dataset.id};
                for (const td of tr.querySelectorAll('td')) for (const [k, v] of Object.entries(td.dataset)) row[k] = v;
                return row;
              }),
              cells: [...document.querySelectorAll('table.t tr')].flatMap(tr =>
                [...tr.querySelectorAll('td[data-id]')].map(td => ({path: tr.dataset.path, name: tr.dataset.name,
                  id: td.dataset.id, counter: td.dataset.counter === "1",
                  change: td.dataset.change === undefined ? null : Number(td.dataset.change)}))),
              flags: [...document.querySelectorAll('#health tr[data-id]')].map(tr => tr.textContent),
            })""")
            page.screenshot(path=str(screenshot), full_page=True)
        finally:
            browser.close()
    return {"errors": errors, "requests": requests, **shown}


def check_report(repo: Path, tmp_path: Path, refs: tuple[str, ...] = ()) -> dict[str, Any]:
    out = tmp_path / "report.html"
    assert _cli(repo, "report", *refs, "-o", str(out)).startswith(f"wrote {out}")
    shot = Path(os.environ.get("CKSTORE_REPORT_SCREENSHOT") or tmp_path / "report.png")
    shown = open_in_browser(out, shot)
    assert shown["errors"] == []
    assert shown["requests"] == [out.as_uri()]  # nothing but the file itself: no network, no font
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {p["kind"] for p in shown["plots"]} >= {"heatmap", "storage"}
    for plot in shown["plots"]:
        assert plot["paths"] > 10 and plot["width"] > 100 and plot["height"] > 100, plot

    history = json.loads(_cli(repo, "log", *(refs[:1]), "--sizes", "--json"))
    by_id = {row["id"]: row for row in shown["storage"]}
    for entry in history:
        row = by_id[entry["id"]]
        assert int(row["newBytes"]) == entry["new_bytes"]
        assert int(row["heldAloneBytes"]) == entry["held_alone_bytes"]
        assert int(row["logicalBytes"]) == entry["logical_bytes"]
        assert int(row["addedBytes"]) == entry["added_bytes"]

    cells = {(c["path"], c["name"], c["id"]): c["change"] for c in shown["cells"] if not c["counter"]}
    for entry in history[:: max(1, len(history) // 8)]:
        if not entry["parents"]:
            continue
        changes = json.loads(_cli(repo, "diff", entry["parents"][0], entry["id"], "--json"))["changes"]
        for change in changes:
            key = (change["path"], change["name"], entry["id"][:12])
            if key not in cells:  # a counter: shown, never as a change
                assert any(c["counter"] for c in shown["cells"] if (c["path"], c["name"], c["id"]) == key), key
                continue
            shown_value = cells[key]
            if change["status"] == "unchanged":
                assert shown_value == 0.0
            elif change["status"] == "changed" and isinstance(change["rel_l2"], float):
                assert shown_value == pytest.approx(change["rel_l2"], rel=1e-9), change
    return shown


def test_report_of_a_100_commit_history(tmp_path: Path) -> None:
    repo = synthetic_history(tmp_path)
    shown = check_report(repo, tmp_path, ("main", "experiment"))
    assert (tmp_path / "report.html").stat().st_size < 2 * 1024 * 1024
    assert len(shown["storage"]) == 100
    best_loss = json.loads(_cli(repo, "best", "val_loss", "--json"))["id"]
    best_accuracy = json.loads(_cli(repo, "best", "accuracy", "--max", "--json"))["id"]
    assert {p["best"] for p in shown["plots"] if p["kind"] == "metric"} == {best_loss, best_accuracy}
    flags = "\n".join(shown["flags"])
    assert "non-finite" in flags and "head.bias" in flags
    assert "frozen changed" in flags and "embed.weight" in flags
    assert "exploding" in flags and "layers.3.norm.weight" in flags


def test_report_of_the_readme_main_flow(tmp_path: Path) -> None:
    repo = readme_main_flow(tmp_path)
    shown = check_report(repo, tmp_path)
    assert len(shown["storage"]) == 3
    assert any(p["kind"] == "metric" for p in shown["plots"])  # val_loss, recorded by each epoch


def test_report_errors_are_one_line_and_leave_no_file(tmp_path: Path) -> None:
    Repo.init(tmp_path / "r")
    runner = CliRunner()
    result = runner.invoke(main, ["--repo", str(tmp_path / "r"), "report", "-o", str(tmp_path / "x.html")])
    assert result.exit_code == 3 and result.stderr.count("\n") == 1  # no commits yet
    result = runner.invoke(main, ["--repo", str(tmp_path / "r"), "report", "-o", str(tmp_path / "no" / "x.html")])
    assert result.exit_code != 0 and result.stderr.startswith("ckstore: ")
    assert not list(tmp_path.glob("*.html")) and not list(tmp_path.glob(".*.tmp"))


def _two_commits_with_metadata(root: Path, meta: list[str]) -> Path:
    repo = root / "r"
    Repo.init(repo, chunk_size=4096)
    for epoch in (1, 2):
        folder = root / f"e{epoch}"
        folder.mkdir()
        save_file({"m$x^2$.w": np.full(64, epoch, np.float32)}, str(folder / "model.safetensors"))
        args = [a for kv in meta for a in ("--meta", kv.replace("VALUE", str(epoch)))]
        _cli(repo, "commit", str(folder), "-m", f"e{epoch}", *args)
    return repo


def test_report_draws_names_holding_dollar_signs_as_text(tmp_path: Path) -> None:
    repo = _two_commits_with_metadata(tmp_path, [r"x$\foo$=VALUE", "a$x^2$=VALUE"])
    _cli(repo, "report", "-o", str(tmp_path / "r.html"))
    page = (tmp_path / "r.html").read_text()
    assert r'data-metric="x$\foo$"' in page and 'data-metric="a$x^2$"' in page


def test_report_plots_a_bounded_number_of_metrics_and_names_the_rest(tmp_path: Path) -> None:
    from ckstore.report.page import MAX_METRIC_PLOTS

    keys = [f"layer{i:03d}_norm=VALUE" for i in range(MAX_METRIC_PLOTS + 40)]
    repo = _two_commits_with_metadata(tmp_path, keys)
    _cli(repo, "report", "-o", str(tmp_path / "r.html"))
    page = (tmp_path / "r.html").read_text()
    assert page.count('data-plot="metric"') == MAX_METRIC_PLOTS
    assert "40 more metric(s) not plotted" in page
