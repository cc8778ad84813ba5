"""Safe import of legacy PyTorch pickle checkpoints (ckstore import / Repo.import_checkpoint)."""

from __future__ import annotations

import math
import os
import pickle
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

from ckstore import legacy
from ckstore.errors import IntegrityError, MissingDependencyError, UnsafeCheckpointError
from ckstore.repo import Repo

from test_cli import Cli, cli  # noqa: F401  (fixture)


class SystemExploit:
    """Unpickling this runs a shell command (the classic pickle exploit)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


class OpenExploit:
    """Unpickling this creates (truncates) a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def model_state(seed: int = 0) -> OrderedDict[str, torch.Tensor]:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
    return net.state_dict()


def training_checkpoint() -> dict[str, Any]:
    """model + Adam state after one step: int keys, step tensors, param_groups, plain values."""
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    net(torch.randn(5, 8)).sum().backward()
    opt.step()
    return {"model": net.state_dict(), "optimizer": opt.state_dict(), "epoch": 7, "loss": float("nan"),
            "history": [0.5, 0.25], "shape": torch.Size([2, 3]), "by_step": {10: (1, "a")}}


def test_state_dict_pth_round_trips(repo: Repo, tmp_path: Path) -> None:
    state = model_state()
    torch.save(state, tmp_path / "model.pth")
    [result] = repo.import_checkpoint(tmp_path / "model.pth")
    _, commit = repo.show(result.commit)
    assert commit.message == "model.pth"
    assert commit.decoded_metadata() == {"source": str((tmp_path / "model.pth").resolve())}
    assert legacy._difference(state, repo.load_state(result.commit), "") is None
    assert (tmp_path / "model.pth").exists() and not result.deleted


def test_optimizer_checkpoint_with_nested_dicts_and_int_keys(repo: Repo, tmp_path: Path) -> None:
    ckpt = training_checkpoint()
    torch.save(ckpt, tmp_path / "ckpt.ckpt")
    [result] = repo.import_checkpoint(tmp_path / "ckpt.ckpt", message="run 1", metadata={"run": 1})
    loaded = repo.load_state(result.commit)
    assert legacy._difference(ckpt, loaded, "") is None
    assert sorted(loaded["optimizer"]["state"]) == [0, 1, 2, 3]  # int keys stay ints
    assert loaded["by_step"] == {10: (1, "a")} and math.isnan(loaded["loss"])
    assert repo.show(result.commit)[1].decoded_metadata()["run"] == 1


def test_zip_is_memory_mapped_and_legacy_format_is_not(
    repo: Repo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[dict[str, Any]] = []
    real_load = torch.load

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    state = training_checkpoint()
    torch.save(state, tmp_path / "new.pt")
    torch.save(state, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    for name in ("new.pt", "old.pt"):
        [result] = repo.import_checkpoint(tmp_path / name)
        assert legacy._difference(state, repo.load_state(result.commit), "") is None
    assert [(c["weights_only"], c["mmap"], c["map_location"]) for c in calls] == [(True, True, "cpu"), (True, False, "cpu")]


def test_recursive_folder(cli: Cli, tmp_path: Path) -> None:  # noqa: F811
    cli("init", str(tmp_path / "repo"), repo=False)
    src = tmp_path / "ckpts"
    (src / "sub").mkdir(parents=True)
    torch.save(model_state(1), src / "a.pt")
    torch.save(model_state(2), src / "sub" / "b.pth")
    torch.save({"w": torch.ones(3)}, src / "sub" / "c.bin")
    (src / "notes.txt").write_text("not a checkpoint")
    cli("import", str(src), code=5)  # a folder needs --recursive
    out = cli("import", str(src), "--recursive", "--branch", "imported").stdout.splitlines()
    assert [line.split()[1] for line in out] == [str(src / "a.pt"), str(src / "sub" / "b.pth"), str(src / "sub" / "c.bin")]
    repo = Repo(tmp_path / "repo")
    assert [e.commit.message for e in repo.log("imported")] == ["sub/c.bin", "sub/b.pth", "a.pt"]
    assert torch.equal(repo.load_state("imported")["w"], torch.ones(3))
    cli("import", str(tmp_path / "nothing-here"), code=5)


def test_delete_source_only_after_a_verified_commit(cli: Cli, tmp_path: Path) -> None:  # noqa: F811
    cli("init", str(tmp_path / "repo"), repo=False)
    src = tmp_path / "ckpts"
    src.mkdir()
    torch.save(model_state(1), src / "1.pt")
    torch.save({"x": SystemExploit(tmp_path / "pwned")}, src / "2.pt")
    torch.save(model_state(3), src / "3.pt")
    result = cli("import", str(src), "--recursive", "--delete-source", code=5)
    assert "(source deleted)" in result.stdout and "posix.system" in result.stderr
    assert not (src / "1.pt").exists()  # committed and verified before the refusal
    assert (src / "2.pt").exists() and (src / "3.pt").exists()  # refused, and never reached
    assert not (tmp_path / "pwned").exists()
    assert len(Repo(tmp_path / "repo").log()) == 1


def test_delete_source_keeps_the_file_when_verification_fails(
    repo: Repo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.save(model_state(), tmp_path / "m.pt")
    real = Repo.load_state

    def tampered(self: Repo, *args: Any, **kwargs: Any) -> Any:
        state = real(self, *args, **kwargs)
        state["0.weight"] = state["0.weight"] + 1
        return state

    monkeypatch.setattr(Repo, "load_state", tampered)
    with pytest.raises(IntegrityError, match="source kept"):
        repo.import_checkpoint(tmp_path / "m.pt", delete_source=True)
    assert (tmp_path / "m.pt").exists()


@pytest.mark.parametrize("exploit, global_name", [(SystemExploit, "posix.system"), (OpenExploit, "io.open")])
@pytest.mark.parametrize("writer", ["zip", "legacy", "pickle"])
def test_exploit_pickle_is_refused_and_never_runs(
    cli: Cli, tmp_path: Path, exploit: type, global_name: str, writer: str  # noqa: F811
) -> None:
    cli("init", str(tmp_path / "repo"), repo=False)
    marker = tmp_path / "marker"
    payload: dict[str, Any] = {"epoch": 1, "evil": exploit(marker)}
    path = tmp_path / "evil.pt"
    if writer == "pickle":  # a bare pickle, not torch.save: what torch's legacy path reads
        with open(path, "wb") as f:
            pickle.dump(payload, f, protocol=2)
    else:
        payload["weights"] = torch.ones(2)
        torch.save(payload, path, _use_new_zipfile_serialization=writer == "zip")
    result = cli("import", str(path), "--delete-source", code=UnsafeCheckpointError.exit_code)
    assert f"needs the global {global_name}" in result.stderr
    assert not marker.exists()
    assert path.exists()
    assert Repo(tmp_path / "repo").branches() == {}
    if writer == "zip":  # the exploit is real: full unpickling (which ckstore never does) runs it
        torch.load(path, weights_only=False)
        assert marker.exists()


def test_offending_global_parsing() -> None:
    assert legacy.offending_global("Unsupported global: GLOBAL foo.Bar was not an allowed global") == "foo.Bar"
    assert legacy.offending_global("load unsupported GLOBAL posix.system whose module posix is blocked.") == "posix.system"
    assert legacy.offending_global("Unsupported operand 149") is None


def test_not_a_checkpoint(cli: Cli, tmp_path: Path) -> None:  # noqa: F811
    cli("init", str(tmp_path / "repo"), repo=False)
    (tmp_path / "x.pt").write_bytes(b"\x80\x02not really a pickle")
    cli("import", str(tmp_path / "x.pt"), code=5)


def test_old_torch_is_refused(repo: Repo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for version in ("2.5.1", "1.13.0+cu117", "garbage"):
        with pytest.raises(MissingDependencyError, match="torch >= 2.6"):
            legacy.check_torch_version(version)
    for version in ("2.6.0", "2.13.0+cpu", "3.0.0a0"):
        legacy.check_torch_version(version)
    torch.save(model_state(), tmp_path / "m.pt")
    monkeypatch.setattr(torch, "__version__", "2.5.1")
    with pytest.raises(MissingDependencyError):
        repo.import_checkpoint(tmp_path / "m.pt")
    assert repo.branches() == {}
