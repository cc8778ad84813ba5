"""Background commits: the caller waits for a snapshot only; errors and exit are never silent."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from ckstore import Repo
from ckstore.errors import StorageError
from ckstore.write.background import CommitHandle
from tests.helpers import checkpoint


def _state(seed: int = 0) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Linear(64, 32)
    with torch.no_grad():
        model.weight.copy_(torch.randn(32, 64, generator=g))
    return {"model": model.state_dict(), "step": seed}


def test_background_commit_stores_the_snapshot_not_later_changes(tmp_path: Path) -> None:
    repo = Repo.init(tmp_path / "repo")
    state = _state()
    expected = state["model"]["weight"].clone()  # type: ignore[index]
    handle = repo.commit_state(state, message="step 0", background=True)
    assert isinstance(handle, CommitHandle)
    with torch.no_grad():  # training goes on mutating its tensors in place
        state["model"]["weight"].add_(1.0)  # type: ignore[index]
    oid = handle.result(timeout=60)
    assert torch.equal(repo.load_state(oid)["model"]["weight"], expected)
    assert repo.log()[0].id == oid


def test_training_resumes_bit_exact_from_a_background_commit(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(6)]

    def step(m: torch.nn.Module, o: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        loss = torch.nn.functional.mse_loss(m(batch[0]), batch[1])
        o.zero_grad()
        loss.backward()
        o.step()
        return loss.item()

    repo = Repo.init(tmp_path / "repo")
    for batch in data[:3]:
        step(model, opt, batch)
    handle = repo.commit_state({"model": model.state_dict(), "optimizer": opt.state_dict()}, background=True)
    losses = [step(model, opt, batch) for batch in data[3:]]  # runs while the commit is written
    state = Repo(tmp_path / "repo").load_state(handle.result(timeout=60))
    resumed = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    resumed.load_state_dict(state["model"])
    opt2 = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    opt2.load_state_dict(state["optimizer"])
    assert [step(resumed, opt2, batch) for batch in data[3:]] == losses


def test_at_most_one_snapshot_in_flight_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = Repo.init(tmp_path / "repo")
    release = threading.Event()
    import ckstore.write.commit as commit_module

    real = commit_module.commit_sources

    def slow(*args: object, **kwargs: object) -> str:
        release.wait(30)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(commit_module, "commit_sources", slow)
    first = repo.commit_state(_state(1), background=True)
    second: list[CommitHandle] = []
    waiter = threading.Thread(target=lambda: second.append(repo.commit_state(_state(2), background=True)))
    waiter.start()
    time.sleep(0.5)
    assert not second and not first.done()  # the second snapshot waits for the first commit
    release.set()
    waiter.join(30)
    ids = [first.result(30), second[0].result(30)]
    assert [e.id for e in repo.log()] == ids[::-1]


def test_a_failed_background_commit_raises_on_result_and_on_the_next_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = Repo.init(tmp_path / "repo")
    repo.commit_state(_state(0))

    def full(*args: object, **kwargs: object) -> str:
        raise StorageError("No space left on device while writing objects")

    import ckstore.write.commit as commit_module

    monkeypatch.setattr(commit_module, "commit_sources", full)
    handle = repo.commit_state(_state(1), background=True)
    with pytest.raises(StorageError, match="No space"):
        handle.result(30)
    unobserved = repo.commit_state(_state(2), background=True)
    while not unobserved.done():
        time.sleep(0.01)
    monkeypatch.undo()
    with pytest.raises(StorageError, match="No space"):
        repo.commit_state(_state(3))  # the next commit reports the failure nobody looked at
    assert len(repo.log()) == 1 and repo.fsck() == []
    repo.commit_state(_state(4))  # reported once: the repository carries on
    assert len(repo.log()) == 2


def test_interpreter_exit_waits_for_pending_commits(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import torch
        from ckstore import Repo
        repo = Repo.init({str(tmp_path / "repo")!r})
        repo.commit_state({{"w": torch.arange(1 << 20, dtype=torch.float32)}}, message="last", background=True)
        # exits at once: the commit must still land
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    repo = Repo(tmp_path / "repo")
    assert [e.commit.message for e in repo.log()] == ["last"]
    assert torch.equal(repo.load_state("HEAD")["w"], torch.arange(1 << 20, dtype=torch.float32))


def test_exit_waits_for_the_compaction_of_a_script_that_imported_no_thread_pool(tmp_path: Path) -> None:
    # ckstore imports concurrent.futures only when it starts a pool (start-up), after which its exit
    # hook must still run before concurrent.futures' own, or the wait at exit fails with a traceback.
    for seed in (1, 2):
        checkpoint(tmp_path / f"ep{seed}" / "model.safetensors", seed=seed)
    script = textwrap.dedent(f"""
        import sys
        from ckstore import Repo
        assert "concurrent.futures" not in sys.modules
        repo = Repo.init({str(tmp_path / "repo")!r})
        repo.commit({str(tmp_path / "ep1")!r}, message="one")
        repo.commit({str(tmp_path / "ep2")!r}, message="two")  # exits while the parent compacts
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert Repo(tmp_path / "repo").fsck() == []


def test_unobserved_failure_is_reported_at_exit(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import torch
        import ckstore.write.commit
        from ckstore import Repo
        from ckstore.errors import StorageError
        repo = Repo.init({str(tmp_path / "repo")!r})
        def full(*a, **k):
            raise StorageError("No space left on device")
        ckstore.write.commit.commit_sources = full
        repo.commit_state({{"w": torch.zeros(4)}}, background=True)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "background commit failed" in result.stderr and "No space" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 0.02, 0.05, 0.1, 0.2, 0.4])
def test_killed_with_a_commit_in_flight_leaves_a_consistent_repository(tmp_path: Path, delay: float) -> None:
    """SIGKILL at various moments while a background commit is being written: afterwards fsck
    is clean, the earlier commits load bit-exact, and the new one is either absent or whole."""
    repo = Repo.init(tmp_path / "repo", chunk_size=1 << 16)
    first = {"w": torch.arange(1 << 20, dtype=torch.float32)}
    repo.commit_state(first, message="before")
    script = textwrap.dedent(f"""
        import os, signal, time, torch
        from ckstore import Repo
        repo = Repo({str(tmp_path / "repo")!r})
        state = {{"w": torch.arange(1 << 20, dtype=torch.float32) * 1.0001 + 1}}
        repo.commit_state(state, message="in flight", background=True)
        time.sleep({delay})
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    subprocess.run([sys.executable, "-c", script], timeout=120, check=False)
    after = Repo(tmp_path / "repo")
    assert after.fsck(read_data=True) == []
    messages = [e.commit.message for e in after.log()]
    assert messages in (["before"], ["in flight", "before"])
    assert torch.equal(after.load_state("HEAD~1" if len(messages) == 2 else "HEAD")["w"], first["w"])
    if len(messages) == 2:
        assert torch.equal(after.load_state("HEAD")["w"], torch.arange(1 << 20, dtype=torch.float32) * 1.0001 + 1)


@pytest.mark.parametrize("at_step", [1, 5, 20])
def test_disk_full_in_the_background_worker_fails_the_handle_and_keeps_the_repository(
    tmp_path: Path, at_step: int
) -> None:
    import errno
    import os

    from ckstore.backend import fsio

    repo = Repo.init(tmp_path / "repo", chunk_size=1 << 16)
    repo.commit_state({"w": torch.zeros(1 << 18)}, message="before")
    repo.wait()  # its compaction's steps, if still running, would be counted below
    steps = [0]

    def observer() -> None:  # every step from here on is the background commit's
        steps[0] += 1
        if steps[0] == at_step:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    fsio.observe_steps(observer)
    try:
        handle = repo.commit_state(
            {"w": torch.arange(1 << 18, dtype=torch.float32)}, message="full disk", background=True
        )
        with pytest.raises(StorageError, match="No space left"):
            handle.result(60)
    finally:
        fsio.observe_steps(None)
    assert [e.commit.message for e in repo.log()] == ["before"]
    assert repo.fsck(read_data=True) == []
    assert repo.commit_state({"w": torch.ones(1 << 18)}, message="after") == repo.resolve("HEAD")


# ---- the CLI: compaction in a detached process (compaction/detached.py) ------------------------------

HEX64 = re.compile(r"^[0-9a-f]{64}$")
# A compaction's own line; the settling of a quiet tip that may follow it ends in "at rest".
_DONE = re.compile(r"pid (\d+): compacted 'main' in [\d.]+ s \([\d.]+ CPU s\): (\d+) delta(?![^\n]*at rest)")


def _ckstore(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The real command, as a training script runs it (a process of its own)."""
    return subprocess.run(
        [sys.executable, "-m", "ckstore.cli", "--repo", str(repo), *args], capture_output=True, text=True, timeout=600
    )


def _epochs(root: Path, n: int, numel: int) -> list[Path]:
    """Folders of one safetensors file each: a weight that drifts a little per epoch (deltas pay)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    w = torch.randn(numel, generator=g)
    folders = []
    for e in range(n):
        folder = root / f"ep{e}"
        folder.mkdir()
        save_file({"w": w + e * 1e-3 * torch.randn(numel, generator=g)}, str(folder / "model.safetensors"))
        folders.append(folder)
    return folders


def _log(repo: Path) -> str:
    log = repo / "compact.log"
    return log.read_text() if log.exists() else ""


def test_cli_commit_returns_before_its_detached_compaction_and_wait_waits_for_it(tmp_path: Path) -> None:
    path = tmp_path / "repo"
    repo = Repo.init(path, chunk_size=1 << 16)
    ep0, ep1 = _epochs(tmp_path, 2, 1 << 18)
    assert _ckstore(path, "commit", str(ep0)).returncode == 0
    assert _ckstore(path, "wait").returncode == 0
    with repo.backend.compaction_lock(10):  # the detached compaction cannot start its work
        done = _ckstore(path, "commit", str(ep1), "-m", "epoch 1")
        assert done.returncode == 0 and HEX64.match(done.stdout.strip()), done.stderr
        assert Repo(path).log()[0].id == done.stdout.strip()  # durable, and the command has returned
        assert Repo(path).background_work().compaction_pending
        waiter = subprocess.Popen([sys.executable, "-m", "ckstore.cli", "--repo", str(path), "wait"])
        time.sleep(1.0)
        assert waiter.poll() is None  # 'ckstore wait' waits for the pending compaction
        stored_before = Repo(path).stats().stored_bytes
    assert waiter.wait(600) == 0
    assert not Repo(path).background_work().compaction_pending
    runs = _DONE.findall(_log(path))
    assert len(runs) == 2 and int(runs[1][1]) > 0, _log(path)  # the parent's chunks became deltas
    assert Repo(path).stats().stored_bytes < stored_before
    assert Repo(path).fsck() == []


def test_a_waiting_detached_compaction_holds_nothing_of_the_command(tmp_path: Path) -> None:
    """The compaction is a fork of the command: it must not keep the command's repository lock
    (gc would wait for it) nor its output pipe (the caller would wait for end of file)."""
    path = tmp_path / "repo"
    repo = Repo.init(path, chunk_size=1 << 16)
    ep0, ep1 = _epochs(tmp_path, 2, 1 << 16)
    assert _ckstore(path, "commit", str(ep0)).returncode == 0
    assert _ckstore(path, "wait").returncode == 0
    with repo.backend.compaction_lock(10):
        with subprocess.Popen(
            [sys.executable, "-m", "ckstore.cli", "--repo", str(path), "commit", str(ep1)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        ) as command:
            out, _ = command.communicate(timeout=120)  # end of file: the waiting child holds no pipe
        assert command.returncode == 0 and HEX64.match(out.decode().strip())
        assert Repo(path).background_work().compaction_pending
        with repo.backend.repo_lock(exclusive=True, timeout=5):  # gc's lock: the waiting child holds none
            pass
    assert _ckstore(path, "wait").returncode == 0
    runs = _DONE.findall(_log(path))
    assert len(runs) == 2 and int(runs[1][1]) > 0, _log(path)
    assert Repo(path).fsck() == []


def test_a_compaction_that_cannot_start_leaves_the_commit_standing_with_a_warning(tmp_path: Path) -> None:
    """compact.log cannot be written (here: a folder stands in its place): the command still
    records the commit, says in one line that its compaction did not start, and exits 0."""
    path = tmp_path / "repo"
    Repo.init(path, chunk_size=1 << 16)
    (path / "compact.log").mkdir()
    ep0, ep1 = _epochs(tmp_path, 2, 1 << 16)
    for folder in (ep0, ep1):
        done = _ckstore(path, "commit", str(folder))
        assert done.returncode == 0 and HEX64.match(done.stdout.strip()), done.stderr
        assert "could not start the compaction" in done.stderr and "Traceback" not in done.stderr
    assert len(Repo(path).log()) == 2
    assert not Repo(path).background_work().compaction_pending
    assert Repo(path).fsck() == []


def test_a_process_that_may_not_fork_starts_its_compaction_in_a_new_interpreter(tmp_path: Path) -> None:
    """A training process (torch loaded, as here) never forks its compaction: a new interpreter
    compacts, in a session of its own, and logs as the forked one does."""
    from ckstore.compaction.detached import _can_fork, start

    assert not _can_fork()  # torch's threads would be missing in a fork
    path = tmp_path / "repo"
    repo = Repo.init(path, chunk_size=1 << 16)
    repo.compact_after_commit = False
    for folder in _epochs(tmp_path, 2, 1 << 16):
        repo.commit(folder)
    assert start(path, repo.head_branch, fork=True)  # torch is loaded here: a new interpreter all the same
    repo.wait_background()
    runs = _DONE.findall(_log(path))
    assert len(runs) == 1 and int(runs[0][1]) > 0 and int(runs[0][0]) != os.getpid(), _log(path)
    assert Repo(path).fsck() == []


def test_a_killed_detached_compaction_leaves_a_valid_repository_and_the_next_finishes_its_work(tmp_path: Path) -> None:
    path = tmp_path / "repo"
    Repo.init(path, chunk_size=1 << 16)
    epochs = _epochs(tmp_path, 3, 1 << 22)  # 16 MiB each: the compaction runs long enough to be killed
    assert _ckstore(path, "commit", str(epochs[0])).returncode == 0
    assert _ckstore(path, "wait").returncode == 0
    assert _ckstore(path, "commit", str(epochs[1])).returncode == 0
    deadline = time.monotonic() + 300
    while (started := re.findall(r"pid (\d+): compacting 'main'", _log(path))[1:]) == []:
        assert time.monotonic() < deadline, _log(path)
        time.sleep(0.01)
    pid = int(started[0])
    time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    assert not any(p == str(pid) for p, _ in _DONE.findall(_log(path))), "the compaction ended before the kill"

    def check(commits: int) -> None:
        again = Repo(path)
        assert again.fsck(read_data=True) == []
        ids = [e.id for e in again.log()][::-1]
        assert len(ids) == commits
        for oid, folder in zip(ids, epochs):
            out = tmp_path / f"out-{oid[:8]}"
            again.checkout(oid, out, force=True)
            assert (out / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()

    check(2)
    # The kill left work undone (a copy compacted now saves bytes) ...
    shutil.copytree(path, tmp_path / "copy")
    assert Repo(tmp_path / "copy").compact().saved > 0
    # ... which the next commit's compaction does.
    assert _ckstore(path, "commit", str(epochs[2])).returncode == 0
    assert _ckstore(path, "wait").returncode == 0
    check(3)
    # The last run covered the pair below too: nothing the killed run left would save a byte now.
    assert Repo(path).compact().saved == 0


def test_a_forked_child_exits_without_waiting_for_the_parents_background_work(tmp_path: Path) -> None:
    """A DataLoader worker or multiprocessing child forked after a background commit has none of
    the parent's pool threads; at its exit it must not wait for them (it hung forever)."""
    import multiprocessing

    repo = Repo.init(tmp_path / "repo")
    repo.commit_state(_state(1), message="step 1", background=True).result()
    child = multiprocessing.get_context("fork").Process(target=int)
    child.start()
    child.join(30)
    stuck = child.exitcode is None
    if stuck:
        child.kill()
    assert not stuck, "the forked child waited at exit for the parent's background pools"
    assert child.exitcode == 0
