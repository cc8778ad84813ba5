"""What the report gathers for two branches saved with the README's optimizer-file naming: one
series and column labels per branch with the fork point, optimizer state folded below the
weights per parameter, step counters never a change, numeric names in numeric order."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from ckstore.repo import Repo
from ckstore.report.data import gather
from ckstore.report.groups import natural_key
from ckstore.report.page import render
from tests.report.test_page import _cli


def two_branches(root: Path) -> tuple[Repo, dict[str, str]]:
    """main: epochs 1-6; lr-high: epochs 4-6 forked at main's epoch 3; 12 parameters saved as the
    README's train_one_epoch.py saves them (``<param>.<exp_avg|exp_avg_sq|step>``)."""
    repo = Repo.init(root / "repo")
    rng = np.random.default_rng(0)
    params = {f"{i}.weight": rng.standard_normal(64).astype(np.float32) for i in range(12)}
    folder = root / "ckpt"
    folder.mkdir()
    ids: dict[str, str] = {}

    def save(name: str, epoch: int, branch: str, scale: float, loss: float) -> None:
        for k in params:
            params[k] = params[k] + scale * rng.standard_normal(64).astype(np.float32)
        save_file(params, str(folder / "model.safetensors"))
        opt = {}
        for i in range(12):
            opt[f"{i}.exp_avg"] = rng.standard_normal(64).astype(np.float32) * 1e-3
            opt[f"{i}.exp_avg_sq"] = np.abs(rng.standard_normal(64)).astype(np.float32) * 1e-6
            opt[f"{i}.step"] = np.array(epoch * 50.0, dtype=np.float32)
        save_file(opt, str(folder / "optimizer.safetensors"))
        ids[name] = repo.commit([folder], message=name, branch=branch, metadata={"epoch": epoch, "val_loss": loss})

    for epoch in range(1, 7):
        save(f"main{epoch}", epoch, "main", 0.01, 1.0 / epoch)
        if epoch == 3:
            fork = dict(params)
    params.update(fork)
    repo.create_branch("lr-high", ids["main3"])
    for epoch in range(4, 7):
        save(f"lr{epoch}", epoch, "lr-high", 0.1, 0.5 + 0.1 * epoch)
    return repo, ids


def test_two_branches_have_their_own_series_labels_and_fork_point(tmp_path: Path) -> None:
    repo, ids = two_branches(tmp_path)
    data = gather(repo._ctx, ["main", "lr-high"])
    assert [r.lane for r in data.commits] == ["main"] * 6 + ["lr-high"] * 3
    assert [r.label.split()[:3] for r in data.commits][-3:] == [["lr-high", "epoch", str(e)] for e in (4, 5, 6)]
    main, lr = data.lanes
    assert lr.fork == ids["main3"] and lr.fork_lane == "main" and main.fork is None
    (loss,) = data.metrics
    assert loss.x_label == "epoch"
    by_lane = {s.lane: s for s in loss.series}
    assert by_lane["main"].x == [1, 2, 3, 4, 5, 6] and by_lane["lr-high"].x == [1, 2, 3, 4, 5, 6]
    assert by_lane["lr-high"].values[3:] == [0.9, 1.0, 1.1]  # its own epochs, not main's after epoch 6
    assert by_lane["lr-high"].ids[by_lane["lr-high"].fork] == ids["main3"]
    assert loss.best == ids["main6"]
    page = render(data, ["main", "lr-high"], "repo")
    assert 'data-lane="lr-high" data-fork="' + ids["main3"] + '"' in page
    assert "forks from <b>main</b> at #3" in page


def test_optimizer_state_is_folded_below_the_weights_and_counters_are_no_change(tmp_path: Path) -> None:
    repo, _ = two_branches(tmp_path)
    data = gather(repo._ctx, ["main"])
    assert list(data.groups.modules) == [str(i) for i in range(12)]  # numeric order, weights only
    assert list(data.groups.optimizer) == [f"optimizer: {i}" for i in range(12)]
    assert ("optimizer.safetensors", "0.step") in data.groups.counters
    assert all(not k[1].endswith(".step") for k in data.groups.folded_optimizer())
    page = render(data, ["main"], "repo")
    assert page.count("last change 0.2") == 0  # the step counter's 250 -> 300 is not a change
    assert 'data-name="0.step"' in page and "data-counter" in page
    assert page.index("<code>11</code>") < page.index("id=optimizer-state")
    html = tmp_path / "r.html"
    _cli(repo.path, "report", "main", "lr-high", "-o", str(html))
    assert html.read_text().count('class=lane data-lane="') == 2


def test_natural_key_orders_numbers_by_value() -> None:
    names = ["layers.10.w", "layers.2.w", "0", "100", "10", "1", "layers.1.w"]
    assert sorted(names, key=natural_key) == ["0", "1", "10", "100", "layers.1.w", "layers.2.w", "layers.10.w"]
