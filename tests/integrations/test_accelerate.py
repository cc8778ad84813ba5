"""Hugging Face Accelerate: CkstoreState's saves are commits, a resume is bit-exact, and
ProjectConfiguration(total_limit=...) thins the branch through ckstore's retention."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from ckstore.errors import InvalidInputError
from ckstore.repo import Repo
from tests.helpers import Cli

accelerate = pytest.importorskip("accelerate")
from accelerate.utils import ProjectConfiguration  # noqa: E402

from ckstore.integrations.accelerate import CkstoreState  # noqa: E402


def prepared(project_dir: Path, total_limit: int | None = None) -> tuple[object, nn.Module, object, object]:
    """A fresh Accelerator with a model (dropout: the RNG matters), AdamW and a scheduler."""
    torch.manual_seed(0)
    config = ProjectConfiguration(project_dir=str(project_dir), total_limit=total_limit)
    acc = accelerate.Accelerator(cpu=True, project_config=config)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    return acc, model, opt, sched


def train(acc: object, model: nn.Module, opt: object, sched: object, steps: range) -> None:
    for _ in steps:
        x = torch.randn(16, 8)  # drawn from the global RNG, which a resume must restore
        loss = (model(x) - x.sum(dim=1, keepdim=True)).square().mean()
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
        sched.step()


def test_resume_from_a_commit_is_bit_exact(tmp_path: Path) -> None:
    acc, model, opt, sched = prepared(tmp_path / "run")
    store = CkstoreState(acc, tmp_path / "repo", branch="run1")
    assert store.load_state() is None  # nothing saved yet: a fresh start
    train(acc, model, opt, sched, range(3))
    saved = store.save_state(metadata={"epoch": 1})
    train(acc, model, opt, sched, range(3, 6))
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    expected_opt = opt.state_dict()

    acc2, model2, opt2, sched2 = prepared(tmp_path / "run")
    torch.manual_seed(1234)  # the resume, not the seed, must decide what follows
    store2 = CkstoreState(acc2, tmp_path / "repo", branch="run1")
    assert store2.load_state() == saved
    assert acc2.save_iteration == 1 and sched2.state_dict()["last_epoch"] == 3
    train(acc2, model2, opt2, sched2, range(3, 6))
    for key, value in model2.state_dict().items():
        assert torch.equal(value, expected[key]), key
    for index, moments in opt2.state_dict()["state"].items():
        for name, value in moments.items():
            assert torch.equal(value, expected_opt["state"][index][name]), (index, name)
    assert not (tmp_path / "run" / "checkpoints").exists()  # no folder, no pickle
    meta = Repo(tmp_path / "repo").read_commit(saved).decoded_metadata()
    assert meta["epoch"] == 1 and meta["iteration"] == 0


def test_total_limit_keeps_the_newest_commits_of_the_run_only(tmp_path: Path, cli: Cli) -> None:
    repo = Repo.init(tmp_path / "repo")
    for epoch in range(3):  # another run in the same repository
        repo.commit_state({"w": torch.full((64,), float(epoch))}, branch="other", metadata={"epoch": epoch})
    acc, model, opt, sched = prepared(tmp_path / "run", total_limit=2)
    store = CkstoreState(acc, repo, branch="run1")
    saved = []
    for _ in range(4):
        train(acc, model, opt, sched, range(1))
        saved.append(store.save_state())
    assert [e.id for e in repo.log("run1")] == saved[:1:-1]  # the two newest, newest first
    assert len(repo.log("other")) == 3
    out = cli("log", "--oneline", "run1").output
    assert "accelerate checkpoint_3" in out and "accelerate checkpoint_1" not in out
    assert "no problems found" in cli("fsck", "--read-data").output
    acc2, model2, _, _ = prepared(tmp_path / "run")
    assert CkstoreState(acc2, repo, branch="run1").load_state() == saved[-1]
    for key, value in model2.state_dict().items():
        assert torch.equal(value, model.state_dict()[key]), key


def test_loading_a_commit_that_is_not_an_accelerate_state_is_refused(tmp_path: Path) -> None:
    repo = Repo.init(tmp_path / "repo")
    oid = repo.commit_state({"model": nn.Linear(2, 2).state_dict()})
    acc, *_ = prepared(tmp_path / "run")
    with pytest.raises(InvalidInputError, match="does not hold an Accelerate state"):
        CkstoreState(acc, repo).load_state(oid)
