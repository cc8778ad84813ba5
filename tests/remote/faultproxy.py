"""A small fault-injecting HTTP proxy for the remote tests (127.0.0.1 only).

It sits between a transport and the test S3 server, forwards every request unchanged (the Host
header included, so request signatures stay valid), records what passed, and on demand answers
the next N requests itself with an error status (500, 503 SlowDown…) or drops their connection
without answering. Bounded: it listens on loopback only, every socket has a timeout, and its
threads are daemons, and leaving its ``with`` block shuts it down.
"""

from __future__ import annotations

import http.client
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

# Headers that describe one hop, not the message; never forwarded as they are.
_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}
_CODES = {
    500: ("InternalError", "We encountered an internal error. Please try again."),
    503: ("SlowDown", "Please reduce your request rate."),
}


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    range: str | None
    conditional: str | None  # "If-None-Match" / "If-Match" when the request carried one
    status: int | None  # None: the proxy dropped the connection


def _any(method: str, path: str) -> bool:
    return True


class FaultProxy:
    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        assert parts.hostname in ("127.0.0.1", "localhost"), "the proxy forwards to loopback only"
        self.upstream = (parts.hostname, parts.port or 80)
        self.lock = threading.Lock()
        self.seen: list[Seen] = []
        self._fail: list[int] = []  # statuses for the next matching requests, in order
        self._drop = 0
        self.ignore_conditions = False  # act as a server that ignores If-None-Match / If-Match
        self._match: Callable[[str, str], bool] = _any
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = 30

            def log_message(self, *args: object) -> None:
                pass

            def _handle(self) -> None:
                body = self._read_body()
                with proxy.lock:
                    hit = proxy._match(self.command, self.path)
                    drop = hit and proxy._drop > 0
                    proxy._drop -= drop
                    status = proxy._fail.pop(0) if hit and not drop and proxy._fail else None
                if drop:
                    proxy._record(self, None)
                    self.close_connection = True
                    try:
                        self.connection.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    return
                if status is not None:
                    proxy._record(self, status)
                    self._answer_error(status)
                    return
                if (
                    proxy.ignore_conditions
                    and self.command == "PUT"
                    and (self.headers.get("If-None-Match") or self.headers.get("If-Match"))
                ):
                    # Such a server stores the object whatever the precondition says; the
                    # headers are signed, so the proxy cannot strip them and forward: it answers.
                    proxy._record(self, 200)
                    self.send_response(200)
                    self.send_header("ETag", '"ignored"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self._forward(body)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

            def _read_body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return b"".join(chunks)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""

            def _answer_error(self, status: int) -> None:
                code, message = _CODES.get(status, ("InjectedFault", "Injected by the test proxy."))
                body = (
                    f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                    f"<Message>{message}</Message></Error>"
                ).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _forward(self, body: bytes) -> None:
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=30)
                try:
                    conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                    for name, value in self.headers.items():
                        if name.lower() not in _HOP and name.lower() != "content-length":
                            conn.putheader(name, value)
                    if body or self.command in ("PUT", "POST"):
                        conn.putheader("Content-Length", str(len(body)))
                    conn.endheaders(body or None)
                    resp = conn.getresponse()
                    data = resp.read()
                    proxy._record(self, resp.status)
                    self.send_response_only(resp.status, resp.reason)
                    for name, value in resp.getheaders():
                        low = name.lower()
                        if low in _HOP or (low == "content-length" and self.command != "HEAD"):
                            continue
                        self.send_header(name, value)
                    if self.command != "HEAD":
                        self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    conn.close()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def _record(self, handler: BaseHTTPRequestHandler, status: int | None) -> None:
        conditional = next((h for h in ("If-None-Match", "If-Match") if handler.headers.get(h)), None)
        with self.lock:
            self.seen.append(Seen(handler.command, handler.path, handler.headers.get("Range"), conditional, status))

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)

    def fail_next(self, n: int, status: int = 503, match: Callable[[str, str], bool] | None = None) -> None:
        """Answer the next ``n`` requests (those ``match(method, path)`` accepts) with ``status``
        instead of forwarding them."""
        with self.lock:
            self._fail = [status] * n
            self._match = match or _any

    def drop_next(self, n: int, match: Callable[[str, str], bool] | None = None) -> None:
        """Close the connection of the next ``n`` (matching) requests without an answer."""
        with self.lock:
            self._drop = n
            self._match = match or _any

    def reset(self) -> None:
        with self.lock:
            self.seen.clear()
            self._fail = []
            self._drop = 0
            self._match = _any

    def count(self, method: str | None = None) -> int:
        with self.lock:
            return sum(1 for s in self.seen if method is None or s.method == method)
