"""Ray Train on CPU with two workers: ckstore's report() makes every report a commit, a worker
group restarted after a failure resumes bit-exact from it, and CheckpointConfig(num_to_keep=...)
thins the branch through ckstore's retention."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckstore.repo import Repo
from tests.helpers import Cli

ray = pytest.importorskip("ray")
pytest.importorskip("ray.train.torch")
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402

from ckstore.integrations.ray import RNG_KEY, checkpoint_commit  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # a Ray cluster and three worker groups: about a minute


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    # The workers import ckstore (and this module) from the checkout under test.
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield
    ray.shutdown()


def train_func(config: dict[str, Any]) -> None:
    import ray.train.torch
    from torch import nn

    from ckstore.integrations.ray import report, restore

    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(nn.Sequential(nn.Linear(4, 32), nn.Dropout(0.3), nn.Linear(32, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = restore()
    start = 0
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"] + 1
    else:  # each worker its own data and dropout masks
        torch.manual_seed(100 + ray.train.get_context().get_world_rank())
    for step in range(start, config["steps"]):
        if step == config.get("fail_at") and not os.path.exists(config["marker"]):
            Path(config["marker"]).touch()
            raise RuntimeError("a worker dies mid-run")
        x = torch.randn(16, 4)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
        report({"loss": loss.item(), "step": step}, state, repo=config["repo"], branch=config["branch"])


def fit(tmp_path: Path, branch: str, **config: Any) -> Any:
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"repo": str(tmp_path / "repo"), "branch": branch, "steps": 5, **config},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(
            name=branch,
            storage_path=str(tmp_path / "ray"),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
            failure_config=FailureConfig(max_failures=1),
        ),
    )
    return trainer.fit()


def test_reports_are_commits_and_a_restarted_run_resumes_bit_exact(ray_cluster: None, tmp_path: Path, cli: Cli) -> None:
    Repo.init(tmp_path / "repo")
    clean = fit(tmp_path, "clean")
    flaky = fit(tmp_path, "flaky", fail_at=3, marker=str(tmp_path / "failed-once"))
    assert (tmp_path / "failed-once").exists()  # the failure happened and the run went on
    repo = Repo(tmp_path / "repo")
    tips = {}
    for name, result in (("clean", clean), ("flaky", flaky)):
        store, oid = checkpoint_commit(result.checkpoint)
        assert oid == repo.resolve(name)
        log = repo.log(name)
        assert [e.commit.decoded_metadata()["step"] for e in log] == [4, 3]  # num_to_keep=2
        tips[name] = repo.load_state(name)
    for part in ("model", "optimizer"):
        flat_clean = dict(_tensors(tips["clean"][part]))
        for key, value in _tensors(tips["flaky"][part]):
            assert torch.equal(value, flat_clean[key]), (part, key)
    assert tips["clean"][RNG_KEY].shape[0] == 2  # both workers' RNG states
    # Ray deleted only its pointer folders; the commits' data is ckstore's, checked in full.
    assert len(list((tmp_path / "ray" / "flaky").glob("ckstore-*"))) == 2
    assert "no problems found" in cli("fsck", "--read-data").output
    assert "loss=" in cli("log", "--oneline", "flaky").output


def _tensors(value: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, f"{prefix}.{key}")
