"""Safe import of legacy PyTorch pickle checkpoints (ckstore import / Repo.import_checkpoint)."""

from __future__ import annotations

import copyreg
import io
import math
import os
import pickle
import struct
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

from ckstore.errors import IntegrityError, MissingDependencyError, UnsafeCheckpointError
from ckstore.repo import Repo
from ckstore.training import legacy
from tests.helpers import Cli


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
    return {
        "model": net.state_dict(),
        "optimizer": opt.state_dict(),
        "epoch": 7,
        "loss": float("nan"),
        "history": [0.5, 0.25],
        "shape": torch.Size([2, 3]),
        "by_step": {10: (1, "a")},
    }


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
    assert [(c["weights_only"], c["mmap"], c["map_location"]) for c in calls] == [
        (True, True, "cpu"),
        (True, False, "cpu"),
    ]


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
    assert [line.split()[1] for line in out] == [
        str(src / "a.pt"),
        str(src / "sub" / "b.pth"),
        str(src / "sub" / "c.bin"),
    ]
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
    cli: Cli,
    tmp_path: Path,
    exploit: type,
    global_name: str,
    writer: str,  # noqa: F811
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


# --- hand-made pickles: every opcode that can name a global --------------------------------


def _text(value: str) -> bytes:  # BINUNICODE
    raw = value.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _short(value: str) -> bytes:  # SHORT_BINUNICODE (protocol 4)
    return b"\x8c" + bytes([len(value)]) + value.encode()


def _stack_global(module: str, name: str) -> bytes:
    return _short(module) + _short(name) + b"\x93"


def torch_zip(data_pkl: bytes) -> bytes:
    """A torch.save zip archive whose data.pkl is replaced (records stored, as torch writes them)."""
    buffer = io.BytesIO()
    torch.save({}, buffer)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, data_pkl if info.filename.endswith("/data.pkl") else src.read(info.filename))
    return out.getvalue()


def torch_legacy(main: bytes) -> bytes:
    """torch's non-zip format: magic number, protocol, system info, the object, storage keys."""
    sys_info = {"protocol_version": 1001, "little_endian": True, "type_sizes": {"short": 2, "int": 4, "long": 4}}
    head = b"".join(pickle.dumps(v, protocol=2) for v in (0x1950A86A20F9469CFC6C, 1001, sys_info))
    return head + main + pickle.dumps([], protocol=2)


CONTAINERS = {"zip": torch_zip, "legacy": torch_legacy}


def test_hand_made_containers_load_when_the_pickle_is_benign(tmp_path: Path) -> None:
    benign = pickle.dumps({"epoch": 3, "lr": [0.5]}, protocol=2)
    for name, wrap in CONTAINERS.items():
        (tmp_path / name).write_bytes(wrap(benign))
        assert legacy.load_checkpoint(tmp_path / name) == {"epoch": 3, "lr": [0.5]}


MARKER = "MARKER"  # replaced by the test's marker path
CMD = _text(f"touch {MARKER}") + b"\x85"  # (command,) as the argument tuple
# name: (pickle, what the refusal must say, whether unrestricted unpickling runs the command)
CRAFTED: dict[str, tuple[bytes, str, bool]] = {
    "GLOBAL+REDUCE": (b"\x80\x02cposix\nsystem\n" + CMD + b"R.", "global posix.system,", True),
    "STACK_GLOBAL+REDUCE": (
        b"\x80\x04" + _stack_global("posix", "system") + CMD + b"R.",
        "global posix.system (STACK_GLOBAL then REDUCE)",
        True,
    ),
    # The module and name reach STACK_GLOBAL through the memo (BINPUT/BINGET, MEMOIZE/BINGET).
    "STACK_GLOBAL+memo": (
        b"\x80\x04" + _short("posix") + b"q\x070" + _short("system") + b"\x940h\x07h\x01\x93" + CMD + b"R.",
        "global posix.system (STACK_GLOBAL then REDUCE)",
        True,
    ),
    "INST": (b"(" + _text(f"touch {MARKER}") + b"iposix\nsystem\n.", "global posix.system (INST)", True),
    "OBJ": (
        b"\x80\x04(" + _stack_global("posix", "system") + _text(f"touch {MARKER}") + b"o.",
        "global posix.system (STACK_GLOBAL then OBJ)",
        True,
    ),
    "OBJ+GLOBAL": (b"(cposix\nsystem\n" + _text(f"touch {MARKER}") + b"o.", "global posix.system,", True),
    "NEWOBJ": (
        b"\x80\x04" + _stack_global("subprocess", "Popen") + b")\x81.",
        "global subprocess.Popen (STACK_GLOBAL then NEWOBJ)",
        False,
    ),
    "NEWOBJ_EX": (
        b"\x80\x04" + _stack_global("subprocess", "Popen") + b")}\x92.",
        "global subprocess.Popen (STACK_GLOBAL then NEWOBJ_EX)",
        False,
    ),
    "EXT1": (b"\x80\x02\x82\x2a" + CMD + b"R.", "global with copyreg extension code 42 (EXT1 then REDUCE)", False),
    # Registered here (fixture below), the code runs posix.system when unpickled; ckstore names the
    # code, not what this process happens to register under it.
    "EXT2-registered": (
        b"\x80\x02\x83\x34\x12" + CMD + b"R.",
        "global with copyreg extension code 4660 (EXT2 then REDUCE)",
        True,
    ),
    "EXT4": (
        b"\x80\x02\x84" + struct.pack("<i", 2**31 - 1) + CMD + b"R.",
        f"global with copyreg extension code {2**31 - 1} (EXT4 then REDUCE)",
        False,
    ),
    # An allowed class, but through an opcode torch does not implement: still named.
    "OBJ-allowed-class": (
        b"(ccollections\nOrderedDict\no.",
        "names the global collections.OrderedDict (GLOBAL then OBJ) through the pickle opcode OBJ",
        False,
    ),
    "NEWOBJ_EX-allowed-class": (
        b"\x80\x02ccollections\nOrderedDict\n)}\x92.",
        ("global collections.OrderedDict (GLOBAL then NEWOBJ_EX) through the pickle opcode NEWOBJ_EX"),
        False,
    ),
    # torch stops at the first opcode it lacks, here the string before an allowed STACK_GLOBAL:
    # no global is to blame, so the opcode is named.
    "STACK_GLOBAL-allowed-class": (
        b"\x80\x04" + _stack_global("collections", "OrderedDict") + b")R.",
        "pickle opcode SHORT_BINUNICODE (140) is not supported",
        False,
    ),
}


@pytest.fixture
def extension_4660() -> Any:
    copyreg.add_extension("posix", "system", 4660)
    yield
    copyreg.remove_extension("posix", "system", 4660)


@pytest.mark.parametrize("container", sorted(CONTAINERS))
@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_pickle_names_its_global_and_never_runs(
    cli: Cli,
    tmp_path: Path,
    case: str,
    container: str,
    extension_4660: Any,  # noqa: F811
) -> None:
    payload, expected, runs = CRAFTED[case]
    marker = tmp_path / "marker"
    payload = payload.replace(_text(f"touch {MARKER}"), _text(f"touch {marker}"))
    path = tmp_path / "evil.pt"
    path.write_bytes(CONTAINERS[container](payload))
    cli("init", str(tmp_path / "repo"), repo=False)
    result = cli("import", str(path), "--delete-source", code=UnsafeCheckpointError.exit_code)
    assert expected in result.stderr and str(path) in result.stderr
    assert not marker.exists() and path.exists()
    assert Repo(tmp_path / "repo").branches() == {}
    if runs:  # the exploit is real: unrestricted unpickling (which ckstore never does) runs it
        pickle.loads(payload)
        assert marker.exists()


def test_unsupported_protocol_opcode_is_named(cli: Cli, tmp_path: Path) -> None:  # noqa: F811
    # torch's weights_only loader lacks protocol 4's FRAME: no global to blame, the opcode is named.
    torch.save(model_state(), tmp_path / "p4.pt", pickle_protocol=4)
    cli("init", str(tmp_path / "repo"), repo=False)
    result = cli("import", str(tmp_path / "p4.pt"), code=UnsafeCheckpointError.exit_code)
    assert "pickle opcode FRAME (149) is not supported" in result.stderr
    assert "protocol 4" in result.stderr


def test_scan_survives_damaged_and_hostile_pickles(tmp_path: Path) -> None:
    # A 2**60-byte BINBYTES8 length must not be allocated; a truncated pickle ends the scan.
    huge = b"\x80\x04" + _stack_global("posix", "system") + b"\x8e" + struct.pack("<Q", 2**60) + b"xx"
    cut = b"\x80\x02cposix\nsystem\n" + b"X\xff\xff\x00\x00abc"
    for data in (huge, cut, b"", b"\x00garbage"):
        (tmp_path / "f").write_bytes(data)
        refs, _ = legacy.scan_globals(tmp_path / "f", is_zip=False)
        assert [r.name for r in refs] == (["posix.system"] if data in (huge, cut) else [])
    (tmp_path / "z").write_bytes(b"PK\x03\x04 not a zip")
    assert legacy.scan_globals(tmp_path / "z", is_zip=True) == ([], {})


def test_offending_global_parsing() -> None:
    assert legacy.offending_global("Unsupported global: GLOBAL foo.Bar was not an allowed global") == "foo.Bar"
    assert (
        legacy.offending_global("load unsupported GLOBAL posix.system whose module posix is blocked.") == "posix.system"
    )
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


def test_import_to_a_new_branch_starts_at_head_as_commit_does(cli: Cli, tmp_path: Path) -> None:  # noqa: F811
    """``import --branch NEW`` started an unrelated root; like ``commit --branch NEW`` it starts at HEAD."""
    cli("init", str(tmp_path / "repo"), repo=False)
    src = tmp_path / "ckpts"
    src.mkdir()
    torch.save(model_state(1), src / "a.pt")
    torch.save(model_state(2), src / "b.pt")
    [head] = [line.split()[0] for line in cli("import", str(src / "a.pt")).stdout.splitlines()]
    out = cli("import", str(src), "--recursive", "--branch", "ft").stdout.splitlines()
    first, second = (line.split()[0] for line in out)
    repo = Repo(tmp_path / "repo")
    assert repo.read_commit(first).parents == (head,) and repo.read_commit(second).parents == (first,)
    assert repo.resolve("HEAD") == head  # the current branch stays where it was
    root = cli("import", str(src / "b.pt"), "--branch", "fresh", "--orphan").stdout.split()[0]
    assert repo.read_commit(root).parents == ()
    error = cli("import", str(src / "b.pt"), "--branch", "ft", "--orphan", code=5).stderr
    assert error == "ckstore: --orphan starts a new branch: name one that does not exist with --branch NEW\n"


def test_api_import_and_commit_state_take_a_start(repo: Repo, tmp_path: Path) -> None:
    first = repo.commit_state({"w": torch.zeros(2)})
    side = repo.commit_state({"w": torch.ones(2)}, branch="side", start="HEAD")
    torch.save(model_state(1), tmp_path / "a.pt")
    [imported] = repo.import_checkpoint(tmp_path / "a.pt", branch="imp", start="side")
    assert repo.read_commit(side).parents == (first,) and repo.read_commit(imported.commit).parents == (side,)


@pytest.mark.parametrize("content", [b"hello\n", b"", b"\x00\x01garbage"])
def test_import_of_a_file_that_is_no_checkpoint_says_so(cli: Cli, tmp_path: Path, content: bytes) -> None:
    cli("init", str(tmp_path / "repo"), repo=False)
    notes = tmp_path / "notes.txt"
    notes.write_bytes(content)
    result = cli("import", str(notes), code=5)
    assert "is not a PyTorch checkpoint (neither a zip nor a pickle file)" in result.stderr


@pytest.mark.parametrize("moment", ["before deleting", "after deleting"])
def test_an_import_interrupted_after_its_commit_says_whether_the_source_was_deleted(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moment: str
) -> None:
    cli("init", str(tmp_path / "repo"), repo=False)
    torch.save(model_state(1), tmp_path / "m.pt")

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt  # Ctrl-C at this moment

    monkeypatch.setattr(legacy, "verify_commit" if moment == "before deleting" else "ImportResult", interrupted)
    result = cli("import", str(tmp_path / "m.pt"), "--delete-source", code=130)
    [commit] = Repo(tmp_path / "repo").log()
    assert f"interrupted after commit {commit.id} was recorded: it stands" in result.stderr
    source = str((tmp_path / "m.pt").resolve())
    if moment == "before deleting":
        assert (tmp_path / "m.pt").exists() and f"its source {source} was kept" in result.stderr
    else:
        assert not (tmp_path / "m.pt").exists() and f"its source {source} was deleted," in result.stderr


def test_a_refused_global_says_what_to_do_next(cli: Cli, tmp_path: Path) -> None:
    import argparse

    cli("init", str(tmp_path / "repo"), repo=False)
    torch.save({"state_dict": model_state(1), "hparams": argparse.Namespace(lr=0.1)}, tmp_path / "lightning.ckpt")
    result = cli("import", str(tmp_path / "lightning.ckpt"), code=UnsafeCheckpointError.exit_code)
    assert "argparse.Namespace" in result.stderr and "Repo.commit_state" in result.stderr
