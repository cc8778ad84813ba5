"""MLflow as the index, the manifest as the truth: against a real MLflow tracking store (sqlite) and
a real tracking server on 127.0.0.1, offline; the server's UI page of a run, opened in chromium,
shows the commit."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("mlflow")

import mlflow  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

import ckstore.integrations.mlflow as ckmlflow  # noqa: E402
from ckstore.errors import NotFoundError  # noqa: E402
from ckstore.repo import Repo  # noqa: E402
from tests.helpers import save_st  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="module")
def tracking(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One sqlite tracking store for the module (creating its tables takes seconds)."""
    folder = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    previous = os.getcwd()
    os.chdir(folder)  # MLflow's default artifact root is ./mlruns
    MlflowClient(uri).search_experiments()  # creates the tables
    try:
        yield uri
    finally:
        os.chdir(previous)


@pytest.fixture
def linked(tracking: str, tmp_path: Path) -> Iterator[Repo]:
    """A repository with autolog on, the tracking store set, and both undone afterwards."""
    mlflow.set_tracking_uri(tracking)
    ckmlflow.autolog()
    try:
        yield Repo.init(tmp_path / ".ckstore")
    finally:
        ckmlflow.autolog(disable=True)
        while mlflow.active_run():
            mlflow.end_run()
        mlflow.set_tracking_uri(None)


def _state(seed: int) -> dict[str, object]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    return {"model": model.state_dict(), "seed": seed}


def test_commits_in_a_run_name_it_and_the_run_lists_them(linked: Repo, tracking: str) -> None:
    repo = linked
    before = repo.commit_state(_state(0), message="before the run", metadata={"epoch": 0})
    with mlflow.start_run() as run:
        first = repo.commit_state(_state(1), message="epoch 1", metadata={"epoch": 1, "val_loss": 0.5, "note": "x"})
        # A background commit is written on a worker thread, which has no active run of its own.
        second = repo.commit_state(
            _state(2), message="epoch 2", metadata={"epoch": 2, "val_loss": 0.25}, background=True
        ).result()
    run_id = run.info.run_id
    # From a commit to its run: the manifest names it.
    assert ckmlflow.run_of(repo, first) == ckmlflow.RunLink(run_id, tracking)
    assert ckmlflow.run_of(repo, second) == ckmlflow.RunLink(run_id, tracking)
    assert ckmlflow.run_of(repo, before) is None
    # From the run to its commits: tags, metrics at their step, one LoggedModel per commit.
    client = MlflowClient(tracking)
    tags = client.get_run(run_id).data.tags
    assert tags[ckmlflow.TAG_COMMIT] == second
    assert tags[ckmlflow.TAG_REPOSITORY] == str(repo.path.resolve())
    history = client.get_metric_history(run_id, "val_loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.5), (2, 0.25)]
    assert "note" not in client.get_run(run_id).data.metrics
    found = ckmlflow.commits(run_id)
    assert [(c.commit, c.step) for c in found] == [(first, 1), (second, 2)]
    assert found[0].open().resolve(found[0].commit) == first
    assert ckmlflow.resolve(f"runs:/{run_id}").commit == second
    assert ckmlflow.resolve(f"models:/{found[0].model_id}").commit == first


def test_autolog_off_links_nothing(linked: Repo) -> None:
    ckmlflow.autolog(disable=True)
    with mlflow.start_run() as run:
        oid = linked.commit_state(_state(3), message="unlinked")
    assert ckmlflow.run_of(linked, oid) is None
    assert ckmlflow.commits(run.info.run_id) == []


def test_a_registered_model_version_loads_its_commit_bit_exact(linked: Repo) -> None:
    repo = linked
    with mlflow.start_run():
        good = repo.commit_state(_state(4), message="best", metadata={"epoch": 1})
        repo.commit_state(_state(5), message="later", metadata={"epoch": 2})
    version = ckmlflow.register_commit("tiny-net", repo, good)
    assert version.tags[ckmlflow.TAG_COMMIT] == good
    loaded = ckmlflow.load_model_version("tiny-net", version.version)
    expected = _state(4)["model"]
    assert all(torch.equal(loaded["model"][k], v) for k, v in expected.items())  # type: ignore[attr-defined]
    MlflowClient().set_registered_model_alias("tiny-net", "champion", version.version)
    assert ckmlflow.resolve("models:/tiny-net@champion").commit == good
    # A commit made outside any run can be registered too.
    plain = repo.commit_state(_state(6), message="no run")
    assert ckmlflow.resolve(f"models:/tiny-net/{ckmlflow.register_commit('tiny-net', repo, plain).version}").commit == (
        plain
    )
    other = MlflowClient().create_model_version("tiny-net", source="file:///elsewhere/model")
    with pytest.raises(NotFoundError, match="does not point at a ckstore commit"):
        ckmlflow.load_model_version("tiny-net", other.version)


def _ckstore(repo: Path, *args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ckstore.cli", "--repo", str(repo), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
    )


def _cli_commit_in_run(tmp_path: Path, tracking: str) -> tuple[Path, str, str]:
    """``ckstore commit`` run as a training job's shell step would, inside an MLflow run."""
    client = MlflowClient(tracking)
    run = client.create_run(client.get_experiment_by_name("Default").experiment_id)
    repo = tmp_path / ".ckstore"
    Repo.init(repo)
    save_st(tmp_path / "ckpt" / "model.safetensors", {"w": torch.arange(64.0)})
    env = {"MLFLOW_RUN_ID": run.info.run_id, "MLFLOW_TRACKING_URI": tracking}
    done = _ckstore(
        repo, "commit", str(tmp_path / "ckpt"), "-m", "epoch 1", "--meta", "epoch=1", "--meta", "val_loss=0.75", env=env
    )
    assert done.returncode == 0, done.stderr
    return repo, run.info.run_id, done.stdout.strip()


def test_cli_commit_with_MLFLOW_RUN_ID_is_logged_and_log_and_show_name_the_run(tmp_path: Path, tracking: str) -> None:
    repo, run_id, oid = _cli_commit_in_run(tmp_path, tracking)
    client = MlflowClient(tracking)
    assert client.get_run(run_id).data.tags[ckmlflow.TAG_COMMIT] == oid
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "val_loss")] == [(1, 0.75)]
    assert [c.commit for c in ckmlflow.commits(run_id, tracking)] == [oid]
    quiet = {"MLFLOW_RUN_ID": "", "MLFLOW_TRACKING_URI": ""}
    line = f"MLflow: run {run_id} ({tracking})"
    assert line in _ckstore(repo, "show", oid, env=quiet).stdout.splitlines()
    assert line in _ckstore(repo, "log", env=quiet).stdout.splitlines()


def test_cli_commit_naming_an_unknown_run_warns_and_keeps_the_commit(tmp_path: Path, tracking: str) -> None:
    repo = tmp_path / ".ckstore"
    Repo.init(repo)
    save_st(tmp_path / "ckpt" / "model.safetensors", {"w": torch.ones(8)})
    env = {"MLFLOW_RUN_ID": "0" * 32, "MLFLOW_TRACKING_URI": tracking}
    done = _ckstore(repo, "commit", str(tmp_path / "ckpt"), "-m", "kept", env=env)
    assert done.returncode == 0, done.stderr
    oid = done.stdout.strip()
    assert Repo(repo).resolve("HEAD") == oid
    assert done.stderr.startswith(f"ckstore: warning: commit {oid[:12]} is recorded, but the mlflow hook failed")
    assert "Traceback" not in done.stderr


def test_cli_commit_with_the_tracking_server_down_keeps_the_commit_and_does_not_hang(tmp_path: Path) -> None:
    """With MLflow's own retry defaults this commit waited over four minutes for a server that
    refuses every connection; the command bounds its requests, so the training script goes on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed
    repo = tmp_path / ".ckstore"
    Repo.init(repo)
    save_st(tmp_path / "ckpt" / "model.safetensors", {"w": torch.ones(8)})
    env = {"MLFLOW_RUN_ID": "0" * 32, "MLFLOW_TRACKING_URI": down}
    clean = {k: v for k, v in os.environ.items() if k not in ckmlflow.CLI_TRACKING_REQUESTS}  # MLflow's defaults
    done = subprocess.run(
        [sys.executable, "-m", "ckstore.cli", "--repo", str(repo), "commit", str(tmp_path / "ckpt"), "-m", "kept"],
        capture_output=True,
        text=True,
        timeout=120,  # a hang guard: MLflow's defaults take ~250 s here
        env={**clean, "PYTHONPATH": str(ROOT), **env},
    )
    assert done.returncode == 0, done.stderr
    oid = done.stdout.strip()
    assert Repo(repo).resolve("HEAD") == oid
    assert done.stderr.startswith(f"ckstore: warning: commit {oid[:12]} is recorded, but the mlflow hook failed")
    assert len(done.stderr.splitlines()) == 1


def test_credentials_never_reach_the_manifest() -> None:
    assert ckmlflow.without_credentials("https://me:secret@mlflow.example:5000/x") == "https://mlflow.example:5000/x"
    assert ckmlflow.without_credentials("sqlite:////tmp/m.db") == "sqlite:////tmp/m.db"


# ---- a real tracking server and its UI --------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("mlflow-server")
    port = _free_port()
    log = (folder / "server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
        + ["--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}", "--default-artifact-root", str(folder / "art")],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=folder,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240  # creating the tables takes most of it on a busy machine
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"mlflow server did not start: {(folder / 'server.log').read_text()[-2000:]}")
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


@pytest.mark.slow
def test_tracking_server_run_page_shows_the_commit_and_the_commit_names_the_run(tmp_path: Path, server: str) -> None:
    repo, run_id, oid = _cli_commit_in_run(tmp_path, server)
    assert ckmlflow.run_of(Repo(repo), oid) == ckmlflow.RunLink(run_id, server)
    assert [c.commit for c in ckmlflow.commits(run_id, server)] == [oid]
    if not os.path.exists(CHROMIUM):
        pytest.fail("chromium is not installed: .ci/run installs it (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    experiment = MlflowClient(server).get_run(run_id).info.experiment_id
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{server}/#/experiments/{experiment}/runs/{run_id}", wait_until="load")
            page.get_by_text(oid).first.wait_for(timeout=120_000)
            assert oid in page.inner_text("body")
        finally:
            browser.close()
