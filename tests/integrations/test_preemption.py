"""Preemption saves: a scheduler's signal becomes one durable commit at the end of the step in
progress, then the exit code the scheduler expects; real training processes signalled at random
moments resume bit-exact from what they left."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ckstore.errors import InvalidInputError
from ckstore.integrations.preemption import Preemption, signal_number
from ckstore.repo import Repo
from tests.integrations.loops import differences, final_state, run_loop


@pytest.mark.slow
def test_signalled_training_runs_resume_bit_exact(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    done = run_loop(reference)
    assert done.wait(timeout=300) == 0, done.communicate()
    expected = final_state(reference)
    rng = random.Random(42)
    preempted = 0
    for run in range(4):
        repo = tmp_path / f"run{run}"
        name = rng.choice(["TERM", "USR1"])
        proc = run_loop(repo, "--signal", name)
        time.sleep(rng.uniform(0.05, 1.0))
        os.kill(proc.pid, signal_number(name))
        code = proc.wait(timeout=300)
        if code == 0:  # the run ended before the signal came
            continue
        assert code == 128 + signal_number(name), proc.communicate()
        head = Repo(repo).read_commit(Repo(repo).resolve("main"))
        assert head.decoded_metadata()["preempted"] == f"SIG{name}"
        assert not Repo(repo).fsck(read_data=True)
        preempted += 1
        resumed = run_loop(repo)
        assert resumed.wait(timeout=300) == 0, resumed.communicate()
        assert differences(final_state(repo), expected) == [], f"run {run}"
    assert preempted >= 3


def test_the_signal_is_only_noted_and_the_safe_point_commits_and_exits(tmp_path: Path) -> None:
    repo = Repo.init(tmp_path / ".ckstore")
    weights = {"w": torch.zeros(16)}
    calls = []
    with Preemption(signals=("USR1",), on_saved=calls.append) as preempt:
        preempt.safe_point(repo, lambda: pytest.fail("no signal yet: nothing is built"))
        os.kill(os.getpid(), signal.SIGUSR1)
        weights["w"] += 1  # the step in progress goes on to its end
        assert preempt.requested and repo.branches() == {}
        with pytest.raises(SystemExit) as exited:
            preempt.safe_point(repo, lambda: {"model": weights, "step": 7}, metadata={"step": 7})
    assert exited.value.code == 128 + signal.SIGUSR1
    state = repo.load_state("main")
    assert torch.equal(state["model"]["w"], torch.ones(16)) and state["step"] == 7
    assert calls == [repo.resolve("main")] == [preempt.saved]
    assert repo.read_commit(preempt.saved).decoded_metadata() == {"step": 7, "preempted": "SIGUSR1"}
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # the handler is gone after the exit


def test_chain_hands_over_to_the_handler_installed_before(tmp_path: Path) -> None:
    """A submitit-style scheduler hook (its handler calls the task's checkpoint() and requeues)
    runs after the commit is durable, not in the middle of a step."""
    repo = Repo.init(tmp_path / ".ckstore")
    seen: list[tuple[int, bool]] = []
    before = signal.signal(signal.SIGUSR2, lambda n, f: seen.append((n, repo.branches() != {})))
    try:
        with Preemption(signals=("USR2",), chain=True, exit_code=0) as preempt:
            os.kill(os.getpid(), signal.SIGUSR2)
            assert seen == []
            with pytest.raises(SystemExit) as exited:
                preempt.safe_point(repo, {"step": 1})
        assert exited.value.code == 0 and seen == [(signal.SIGUSR2, True)]
    finally:
        signal.signal(signal.SIGUSR2, before)


def test_a_push_makes_the_save_reach_the_remote(tmp_path: Path) -> None:
    repo = Repo.init(tmp_path / ".ckstore")
    repo.add_remote("origin", str(tmp_path / "share"))
    preempt = Preemption(push="origin")
    preempt.received = signal.SIGTERM
    oid = preempt.save(repo, {"w": torch.arange(4.0)})
    clone, _ = Repo.clone(str(tmp_path / "share"), tmp_path / "clone" / ".ckstore")
    assert clone.resolve("main") == oid


def test_bad_signals_are_refused() -> None:
    with pytest.raises(InvalidInputError, match="unknown signal 'BOGUS'"):
        Preemption(signals=("BOGUS",))
    with pytest.raises(InvalidInputError, match="at least one"):
        Preemption(signals=())
    assert signal_number("sigterm") == signal_number("TERM") == signal.SIGTERM


class _SignalAt:
    """Sends SIGTERM to this process in the middle of batch ``at`` (as a scheduler would)."""

    def __init__(self, at: int) -> None:
        self.at, self.seen = at, 0

    def tick(self) -> None:
        self.seen += 1
        if self.seen == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def test_lightning_preemption_commits_the_finished_batch_and_resumes(tmp_path: Path) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from ckstore.integrations.lightning import CkstoreCheckpointIO, CkstorePreemption
    from tests.integrations.test_frameworks import _lightning_module, _trainer, data

    sender = _SignalAt(3)

    class Signalling(pl.Callback):  # type: ignore[misc]
        def on_train_batch_start(self, *args: Any) -> None:
            sender.tick()

    io = CkstoreCheckpointIO(tmp_path / "repo")
    loader = torch.utils.data.DataLoader(data(), batch_size=8)
    trainer = _trainer(2, [io], [Signalling(), CkstorePreemption()], tmp_path)
    with pytest.raises(SystemExit) as exited:
        trainer.fit(_lightning_module()(), loader)
    assert exited.value.code == 128 + signal.SIGTERM
    head = io.repo.read_commit(io.repo.resolve("main"))
    assert head.decoded_metadata()["step"] == 3  # the batch in progress finished, then the save
    assert (tmp_path / "preempted.ckpt").exists()
    resumed = _trainer(2, [CkstoreCheckpointIO(tmp_path / "repo")], [], tmp_path)
    resumed.fit(_lightning_module()(), loader, ckpt_path=str(tmp_path / "preempted.ckpt"))
    assert resumed.global_step == 8


def test_hf_preemption_commits_the_finished_step(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from ckstore.integrations.hf import CkstoreCallback, PreemptionCallback
    from tests.integrations.test_frameworks import DictData, HFTiny

    sender = _SignalAt(2)

    class Signalling(transformers.TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            sender.tick()

    store = CkstoreCallback(tmp_path / "repo", on="epoch")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        num_train_epochs=2,
        per_device_train_batch_size=8,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    callbacks = [Signalling(), store, PreemptionCallback(store)]
    trainer = transformers.Trainer(model=HFTiny(), args=args, train_dataset=DictData(), callbacks=callbacks)
    with pytest.raises(SystemExit) as exited:
        trainer.train()
    assert exited.value.code == 128 + signal.SIGTERM
    state = store.repo.load_state("main")
    assert state["trainer_state"]["global_step"] == 2
    assert store.repo.read_commit(store.repo.resolve("main")).decoded_metadata()["preempted"] == "SIGTERM"
    assert torch.equal(state["model"]["net.0.weight"], trainer.model.net[0].weight.detach())
