"""Integrations: the plain two-line loop, the Lightning CheckpointIO plugin and the Hugging Face
Trainer callback, each trained offline on a tiny model (framework tests skip when it is absent)."""

from __future__ import annotations

import enum
from collections import OrderedDict
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ckstore
from ckstore.errors import InvalidInputError
from ckstore.integrations import plain, scalar_metrics
from ckstore.repo import Repo


def data(n: int = 32, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]))


# ---- the framework-free integration (the documented two lines) ------------------------------------


def test_two_line_loop_integration(repo: Repo) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    x, y = data().tensors
    for epoch in range(3):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        # The two lines from ckstore/integrations/__init__.py:
        repo.commit_state(
            {"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": ckstore.rng_state()},
            metadata={"epoch": epoch, "loss": loss.item()},
        )
    state = repo.load_state("main")
    fresh = nn.Linear(4, 1)
    fresh.load_state_dict(state["model"])
    assert torch.equal(fresh.weight, model.weight)
    assert len(repo.log("main")) == 3 and repo.best("loss") == repo.resolve("main")


class Color(enum.Enum):
    RED = "red"


class AttrDict(dict):  # what Lightning's AttributeDict is: a dict subclass
    pass


def test_plain_turns_framework_containers_into_storable_values(repo: Repo) -> None:
    sd = nn.Linear(2, 2).state_dict()
    value = {"hp": AttrDict(lr=0.1, path=PurePosixPath("/a/b"), color=Color.RED), "sd": sd, "t": (1, [2])}
    with pytest.raises(InvalidInputError):
        repo.commit_state(value)
    out = plain(value)
    assert type(out["hp"]) is dict and out["hp"] == {"lr": 0.1, "path": "/a/b", "color": "red"}
    assert type(out["sd"]) is OrderedDict and out["sd"]._metadata == sd._metadata  # type: ignore[attr-defined]
    assert out["t"] == (1, [2])
    back = repo.load_state(repo.commit_state(out))
    assert back["hp"]["path"] == "/a/b"


def test_scalar_metrics_keeps_numbers_only() -> None:
    import numpy as np

    got = scalar_metrics(
        {
            "loss": torch.tensor(0.5),
            "acc": np.float32(0.25),
            "step": 3,
            "flag": True,
            "vec": torch.ones(2),
            "nan": float("nan"),
            "name": "x",
        }
    )
    assert got == {"loss": 0.5, "acc": 0.25, "step": 3}


# ---- PyTorch Lightning -------------------------------------------------------------------------------


def _lightning_module() -> Any:
    pl = pytest.importorskip("lightning.pytorch")

    class Tiny(pl.LightningModule):
        def __init__(self, lr: float = 0.05) -> None:
            super().__init__()
            self.save_hyperparameters()  # puts an AttributeDict into the checkpoint
            self.net = nn.Linear(4, 1)

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss, on_epoch=True, on_step=False)
            return loss

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)}

    return Tiny


def _trainer(epochs: int, plugins: list[Any], callbacks: list[Any], root: Path) -> Any:
    pl = pytest.importorskip("lightning.pytorch")
    return pl.Trainer(
        max_epochs=epochs,
        plugins=plugins,
        callbacks=callbacks,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        deterministic=True,
    )


@pytest.mark.parametrize("background", [False, True])
def test_lightning_checkpoint_io_commits_and_resumes_exactly(tmp_path: Path, background: bool) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from ckstore.integrations.lightning import CkstoreCheckpointIO, read_pointer

    tiny = _lightning_module()
    loader = lambda: DataLoader(data(), batch_size=8, shuffle=False)  # noqa: E731

    pl.seed_everything(0)
    straight = tiny()
    _trainer(3, [], [], tmp_path / "straight").fit(straight, loader())

    repo = Repo.init(tmp_path / "repo")
    io = CkstoreCheckpointIO(repo, branch="run1", background=background)
    ckpt_dir = tmp_path / "ckpts"
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, monitor="train_loss", save_top_k=1, save_last=True)
    pl.seed_everything(0)
    first = tiny()
    _trainer(2, [io], [checkpoint], tmp_path / "a").fit(first, loader())

    history = repo.log("run1")
    assert len(history) >= 2
    meta = history[0].commit.decoded_metadata()
    assert meta["epoch"] == 1 and meta["step"] == 8 and isinstance(meta["train_loss"], float)
    assert repo.best("train_loss", branch="run1") in {e.id for e in history}
    # Files are small pointers; top-k removed the older one's pointer but kept its commit.
    files = sorted(p.name for p in ckpt_dir.iterdir())
    assert "last.ckpt" in files and len(files) == 2
    assert all(read_pointer(ckpt_dir / f) is not None for f in files)
    assert all((ckpt_dir / f).stat().st_size < 1024 for f in files)
    assert len(history) > len(files) - 1

    # Resume from the pointer in a new Trainer and model: the result equals the straight run.
    resumed = tiny(lr=0.05)
    _trainer(3, [CkstoreCheckpointIO(repo.path, branch="run1")], [], tmp_path / "b").fit(
        resumed, loader(), ckpt_path=str(ckpt_dir / "last.ckpt")
    )
    for name, tensor in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], tensor), name

    # A revision works as a path too; a pickle file is refused, never unpickled.
    # (the resumed Trainer's default ModelCheckpoint committed epoch 3 to the same branch)
    assert io.load_checkpoint("run1")["global_step"] == 12
    assert io.load_checkpoint(history[0].id)["global_step"] == 8
    torch.save({"x": 1}, tmp_path / "legacy.ckpt")
    with pytest.raises(InvalidInputError, match="pointer"):
        io.load_checkpoint(tmp_path / "legacy.ckpt")


# ---- Hugging Face Trainer ----------------------------------------------------------------------------


class HFTiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.1), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        out = self.net(x)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out} if labels is not None else {"logits": out}


class DictData(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        self.x, self.y = data().tensors

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


@pytest.mark.parametrize(
    "on, save_strategy, background", [("epoch", "no", False), ("save", "steps", False), ("save", "steps", True)]
)
def test_hf_trainer_callback_commits_and_restores(
    tmp_path: Path, on: str, save_strategy: str, background: bool
) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from ckstore.integrations.hf import CkstoreCallback, restore

    repo = Repo.init(tmp_path / "repo")
    callback = CkstoreCallback(repo, branch="hf", on=on, background=background)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        num_train_epochs=2,
        per_device_train_batch_size=8,
        learning_rate=0.01,
        save_strategy=save_strategy,
        save_steps=2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    model = HFTiny()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=DictData(), callbacks=[callback])
    trainer.train()

    history = repo.log("hf")
    assert len(history) == len(callback.commits) == (2 if on == "epoch" else 4)
    meta = history[0].commit.decoded_metadata()
    assert meta["step"] == 8 and isinstance(meta["loss"], float)
    if on == "epoch":
        assert meta["epoch"] == 2 and history[1].commit.decoded_metadata()["epoch"] == 1

    fresh = HFTiny()
    opt = transformers.Trainer(model=fresh, args=args).create_optimizer()  # the same param groups
    state = restore(repo, "hf", fresh, opt)
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    assert state["trainer_state"]["global_step"] == 8
    assert opt.state_dict()["state"][0]["step"] == trainer.optimizer.state_dict()["state"][0]["step"]


# ---- scripts/train_example.py ----------------------------------------------------------------------


def test_train_example_resume_is_bit_exact(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "train_example", Path(__file__).parents[2] / "scripts" / "train_example.py"
    )
    assert spec and spec.loader
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    assert example.main(["--repo", str(tmp_path / "a"), "--epochs", "3", "--print-digest"]) == 0
    straight = capsys.readouterr().out.strip()
    example.main(["--repo", str(tmp_path / "b"), "--epochs", "1"])
    torch.manual_seed(123)  # disturb the process RNG between the runs: --resume must not care
    example.main(["--repo", str(tmp_path / "b"), "--epochs", "3", "--resume", "--print-digest"])
    out = capsys.readouterr()
    assert out.out.strip() == straight and "resumed from" in out.err
    repo = Repo(tmp_path / "b")
    assert [e.commit.decoded_metadata()["epoch"] for e in repo.log("main")] == [3, 2, 1]
    assert repo.load_state(repo.best("loss"))["epoch"] in (1, 2, 3)
