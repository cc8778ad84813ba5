"""torchtitan's CheckpointManager (ckstore's subclass) on two CPU ranks: its saves are commits tagged
step-N, a resume in a new process group is bit-exact, keep_latest_k thins the branch through
ckstore's retention, and no step folder is ever written.

torchtitan 0.3.0 is installed without its dependencies (README, "torchtitan"), so the test skips
where it is absent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ckstore.repo import Repo
from tests.helpers import Cli, torchrun_script

pytest.importorskip("torchtitan.components.checkpoint")

WORKER = Path(__file__).with_name("titan_worker.py")


def run(folder: Path, out: Path, stop: int, async_mode: str = "disabled") -> tuple[dict[str, torch.Tensor], dict]:
    torchrun_script(WORKER, 2, str(folder), str(out), str(stop), async_mode)
    with safe_open(str(out), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, json.loads(f.metadata()["info"])


@pytest.mark.slow  # three torchrun launches of two ranks each
@pytest.mark.parametrize("async_mode", ["async", "async_with_pinned_mem"])
def test_saves_are_commits_and_a_resume_is_bit_exact(tmp_path: Path, cli: Cli, async_mode: str) -> None:
    straight, info = run(tmp_path / "straight", tmp_path / "straight.safetensors", 8)
    assert info == {"resumed": False, "start": 0, "lr": info["lr"]}

    # The first run is stopped after step 4 (its saves async: DCP's thread, or its background
    # process staged by torchtitan's stager), the second resumes from step-4.
    folder = tmp_path / "repo"  # the cli fixture's repository
    first, info = run(folder, tmp_path / "first.safetensors", 4, async_mode)
    assert not info["resumed"]
    repo = Repo(folder)
    assert sorted(repo.tags()) == ["step-2", "step-4"]
    assert repo.read_commit(repo.resolve("step-4")).decoded_metadata()["step"] == 4
    resumed, info = run(folder, tmp_path / "resumed.safetensors", 8)
    assert info["resumed"] and info["start"] == 4
    assert straight.keys() == resumed.keys() and any(k.startswith("optimizer.") for k in resumed)
    for key, value in straight.items():
        assert torch.equal(value, resumed[key]), key
    assert not torch.equal(first["0.weight"], resumed["0.weight"])  # it did train on

    # keep_latest_k=2 after the save of step 6 (torchtitan purges after every save but the last):
    # step-2's tag and commit are gone, and no step folder was ever written.
    assert sorted(repo.tags()) == ["step-4", "step-6", "step-8"]
    assert [e.id for e in repo.log("main")] == [repo.resolve(f"step-{s}") for s in (8, 6, 4)]
    assert not list(folder.rglob(".metadata")) and not list(folder.glob("step-*"))
    assert "no problems found" in cli("fsck", "--read-data").output


def manager(folder: Path, **config: object) -> tuple[object, torch.nn.Module, object]:
    """The manager in this process, without a process group (DCP then saves as one rank)."""
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

    from ckstore.integrations.torchtitan import CkstoreCheckpointManager
    from tests.integrations.titan_worker import TrainState

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 0.1})],
        implementation="for-loop",
    ).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=optimizers, training_steps=100)
    train_state = TrainState()
    built = CkstoreCheckpointManager.Config(enable=True, folder=str(folder), interval=1, **config).build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
    )

    def step(n: int) -> None:
        model(torch.randn(3, 4)).square().mean().backward()
        optimizers.step()
        optimizers.zero_grad()
        train_state.step = n

    built.train = step  # type: ignore[attr-defined]
    built.train_state = train_state  # type: ignore[attr-defined]
    return built, model, train_state


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, no process group
@pytest.mark.filterwarnings("ignore:To get the last learning rate")  # torchtitan's scheduler load
def test_a_run_folder_inside_a_repository_keeps_its_own_branch_tags_and_retention(tmp_path: Path) -> None:
    from ckstore.errors import RefNotFoundError

    repo = Repo.init(tmp_path / "repo")
    repo.commit_state({"w": torch.zeros(8)}, branch="other", message="another run")
    mgr, model, _ = manager(tmp_path / "repo" / "run1", keep_latest_k=2)
    weights = {}
    for n in range(1, 5):
        mgr.train(n)
        mgr.save(n)
        weights[n] = model.weight.detach().clone()
    mgr.close()
    assert sorted(repo.tags()) == ["run1/step-3", "run1/step-4"]
    assert [e.id for e in repo.log("run1")] == [repo.resolve("run1/step-4"), repo.resolve("run1/step-3")]
    assert len(repo.log("other")) == 1  # retention touched run1's branch only

    fresh, model2, state = manager(tmp_path / "repo" / "run1", keep_latest_k=2)
    assert fresh.load(step=3) and state.step == 3 and torch.equal(model2.weight, weights[3])
    assert fresh.load() and state.step == 4 and torch.equal(model2.weight, weights[4])
    with pytest.raises(RefNotFoundError, match="no checkpoint of step 1 .*saved steps: \\[3, 4\\]"):
        fresh.load(step=1)
    fresh.close()
    empty, _, state = manager(tmp_path / "repo" / "run2")
    assert not empty.load() and state.step == 0  # nothing saved under run2: torchtitan's fresh start
    empty.close()
