"""Fixtures shared by the whole suite (one place): repositories, the in-process CLI, a real S3
server and an AWS environment that cannot leak a developer's settings in or send a request
anywhere but 127.0.0.1, and the hypothesis profiles.

The S3 server (started by ckstore/transport/testserver.py, once per test package that asks for it)
is ``weed mini`` (master, volume, filer and S3 gateway in one process) on free
loopback ports, in a temporary folder, with credentials made up per session and bucket
auto-creation off (so a missing bucket stays missing, as on AWS). It answers S3 about a second
after start; the fixture polls until a conditional write into the bucket succeeds, and fails
with the server's log if that takes longer than STARTUP_TIMEOUT. It is stopped with SIGTERM,
then SIGKILL, and its unix sockets are removed (it leaves them behind).
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from hypothesis import HealthCheck, settings

from ckstore.cli import main
from ckstore.repo import Repo
from ckstore.transport.testserver import S3Server, ServerStartError, seaweedfs
from tests.helpers import Cli, assert_one_line_error

# Profiles are loaded here, before any test module builds its own settings on top of the default.
# "ci": every run draws the same examples (derandomize) and remembers none (database=None), so a
# CI result depends only on the code; a failure prints the blob that replays it with
# @reproduce_failure. Timing can never fail a test on a loaded 2-core box: no deadline, no
# too_slow health check (the other health checks are deterministic once derandomized).
# "dev" (default): fresh random examples every run, failures kept in .hypothesis/ and replayed first.
settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, print_blob=True)
_CI = os.environ.get("CI", "").lower() not in ("", "0", "false", "no")
PROFILE = os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if _CI else "dev")
settings.load_profile(PROFILE)
# A detached compaction waits this long for a newer commit before settling the tip (minutes in
# use): none of the suite's waits so, and none outlives its test (tests that time it set their own).
os.environ["CKSTORE_QUIET_SECONDS"] = "0"


def pytest_report_header() -> str:
    return f"hypothesis profile: {PROFILE} (CI={os.environ.get('CI', '')!r})"


@pytest.fixture
def repo(tmp_path: Path) -> Repo:
    """An empty on-disk repository with small chunks, so small test tensors span several chunks."""
    return Repo.init(tmp_path / "repo", chunk_size=4096)


@pytest.fixture(autouse=True)
def _reset_torch_determinism() -> Iterator[None]:
    """Lightning's ``deterministic=True`` switches torch's deterministic mode on process-wide; it
    would leak into later tests (torch.empty then fails for float4), so switch it back off."""
    yield
    torch = sys.modules.get("torch")
    if torch is not None and torch.are_deterministic_algorithms_enabled():
        torch.use_deterministic_algorithms(False)


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Cli:
    """Run ckstore in-process against ``tmp_path/repo``; checks every run against the error contract."""
    monkeypatch.delenv("CKSTORE_REPO", raising=False)
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()

    def run(*args: str, code: int = 0, repo: bool = True) -> Result:
        argv = (["--repo", str(tmp_path / "repo")] if repo else []) + list(args)
        result = runner.invoke(main, argv, prog_name="ckstore")
        assert result.exit_code == code, (argv, result.output, result.stderr)
        if code not in (0, 2):  # usage errors are click's own
            assert_one_line_error(result.stderr)
            assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit)
        return result

    return run


@pytest.fixture(scope="package", autouse=True)
def isolated_aws_env() -> Iterator[None]:
    """No AWS setting of the developer's leaks in, and nothing ever asks instance metadata
    (an address outside this machine) for credentials."""
    mp = pytest.MonkeyPatch()
    for name in list(os.environ):
        if name.startswith("AWS_") and name != "AWS_CA_BUNDLE":
            mp.delenv(name)
    mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
    mp.setenv("AWS_CONFIG_FILE", "/nonexistent/aws-config")
    mp.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/aws-credentials")
    yield
    mp.undo()


# Package scope: the server (~300 MB) and the scrubbed environment end with tests/remote, not
# with the whole session.
@pytest.fixture(scope="package")
def s3_server(tmp_path_factory: pytest.TempPathFactory, isolated_aws_env: None) -> Iterator[S3Server]:
    try:
        with seaweedfs(tmp_path_factory.mktemp("seaweedfs")) as server:
            yield server
    except ServerStartError as exc:
        pytest.fail(str(exc))


@pytest.fixture(params=["dir", "s3"])
def remote_url(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[str, str | None]:
    """(URL, endpoint) of a fresh, empty remote of each kind."""
    if request.param == "dir":
        return str(tmp_path / "remote"), None
    server: S3Server = request.getfixturevalue("s3_server")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
    return f"s3://{server.bucket}/t/{uuid.uuid4().hex}", server.endpoint


@pytest.fixture
def readme_torchtitan() -> dict[str, str]:
    """README's torchtitan section: torchtitan is installed without its requirements (.ci/run), so
    the section is skipped where it is absent."""
    pytest.importorskip("torchtitan.components.checkpoint")
    return {}


@pytest.fixture
def readme_submitit() -> dict[str, str]:
    """README's submitit section (submitit comes with the dev extra): skipped where it is absent."""
    pytest.importorskip("submitit")
    return {}
