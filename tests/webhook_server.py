"""A real webhook receiver on 127.0.0.1 for tests, as a pytest plugin.

Load it from a conftest (or a test module) with::

    pytest_plugins = ["tests.webhook_server"]

and take the `webhook` fixture::

    def test_x(webhook):
        webhook.set_responses([500, Response(429, {"Retry-After": "1"}), 200])
        ...  # POST to webhook.url
        assert webhook.wait_for(1, timeout=5)[0]["text"] == "..."

Scripted answers are used one per request, in order; after they run out every request gets 200 "ok"
(what Slack answers). `stop()` closes the listening socket, so clients get "connection refused"
exactly as when a receiver is down; `start()` listens again on the same port, so `url` stays valid.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest

__all__ = ["BlackHole", "Request", "Response", "WebhookServer", "blackhole", "webhook"]


@dataclasses.dataclass(frozen=True)
class Response:
    """One scripted answer. `delay_s` holds the answer back (to make clients time out)."""

    status: int = 200
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    body: str = "ok"
    delay_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Request:
    """One request as the server saw it, with the status it was answered with."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    json: Any  # None when the body was not JSON
    status: int
    time: float  # time.monotonic() when it arrived


_Answer = Response  # WebhookServer.Response shadows the name inside the class


def _as_response(spec: int | tuple[Any, ...] | Response) -> Response:
    if isinstance(spec, Response):
        return spec
    if isinstance(spec, int):
        return Response(spec)
    if isinstance(spec, tuple):
        return Response(*spec)
    raise TypeError(f"a response is a status, a (status, headers[, body[, delay_s]]) tuple or a Response: {spec!r}")


class WebhookServer:
    """A threaded HTTP server that records every POST and answers from a script.

    Attributes:
        url: http://127.0.0.1:PORT/services/T0000/B0000/<secret>, shaped like a Slack webhook so
            redaction is exercised; any path is accepted.
        secret: the random last part of the URL, to assert that it leaks nowhere.
        requests: every request, in order of arrival.
        received: parsed JSON bodies of the requests answered with 2xx, in order.
    """

    Response: ClassVar[type[_Answer]] = (
        Response  # so tests need not import this plugin module (pytest warns if they do)
    )

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host  # jobs on the dev cluster's nodes reach the host on the bridge address, not loopback
        self.secret = secrets.token_hex(12)
        self.path = f"/services/T0000/B0000/{self.secret}"
        self.requests: list[Request] = []
        self.received: list[Any] = []
        self._script: list[_Answer] = []
        self._lock = threading.Condition()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.port = 0
        self.start()
        self.url = f"http://{host}:{self.port}{self.path}"

    # -- control -------------------------------------------------------------------------------

    def set_responses(self, responses: Iterable[int | tuple[Any, ...] | _Answer]) -> None:
        """Replace the script: each request takes the next answer; then 200 "ok" forever."""
        with self._lock:
            self._script = [_as_response(r) for r in responses]

    def start(self) -> None:
        """Listen (again) on the same port."""
        if self._httpd is not None:
            return
        httpd = ThreadingHTTPServer((self.host, self.port), self._handler_class())
        httpd.daemon_threads = True
        self.port = httpd.server_address[1]
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Close the listening socket: new connections are refused until start()."""
        httpd, thread = self._httpd, self._thread
        if httpd is None:
            return
        self._httpd = self._thread = None
        httpd.shutdown()
        httpd.server_close()
        if thread is not None:
            thread.join(timeout=5)

    @property
    def running(self) -> bool:
        return self._httpd is not None

    def wait_for(self, n: int, timeout: float = 5.0) -> list[Any]:
        """Block until `received` holds at least n bodies; returns a copy of it.

        Raises:
            AssertionError: not enough arrived in time (the message lists what did).
        """
        deadline = time.monotonic() + timeout
        with self._lock:
            while len(self.received) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    seen = [(r.status, r.path) for r in self.requests]
                    raise AssertionError(
                        f"webhook got {len(self.received)} accepted bodies of {n} within {timeout}s; requests: {seen}"
                    )
                self._lock.wait(left)
            return list(self.received)

    # -- serving -------------------------------------------------------------------------------

    def _next_response(self) -> _Answer:
        with self._lock:
            return self._script.pop(0) if self._script else _Answer()

    def _record(self, request: Request) -> None:
        with self._lock:
            self.requests.append(request)
            if 200 <= request.status < 300:
                self.received.append(request.json)
            self._lock.notify_all()

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                arrived = time.monotonic()
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                try:
                    parsed = json.loads(body.decode("utf-8"))
                except ValueError:
                    parsed = None
                answer = server._next_response()
                if answer.delay_s:
                    time.sleep(answer.delay_s)
                request = Request(
                    method=self.command,
                    path=self.path,
                    headers={k: v for k, v in self.headers.items()},
                    body=body,
                    json=parsed,
                    status=answer.status,
                    time=arrived,
                )
                # Recorded before answering, so a client that got its answer finds it recorded.
                server._record(request)
                payload = answer.body.encode("utf-8")
                try:
                    self.send_response(answer.status)
                    for key, value in answer.headers.items():
                        self.send_header(key, value)
                    self.send_header("Content-Type", "text/plain; charset=utf-8")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except OSError:
                    pass  # the client gave up (timeout test)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # keep test output clean

        return Handler


@pytest.fixture
def webhook() -> Iterator[WebhookServer]:
    """A running WebhookServer, stopped after the test."""
    server = WebhookServer()
    try:
        yield server
    finally:
        server.stop()


class BlackHole:
    """A webhook that accepts the TCP connection and never answers (a stuck proxy, a hung receiver): a client waits
    for its whole timeout. ``on_accept`` runs in the server's thread at each connection; ``accepted`` holds the
    wall-clock time of each."""

    def __init__(self, on_accept: Any = None) -> None:
        import socket

        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(256)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}/hooks/{secrets.token_hex(8)}"
        self.accepted: list[float] = []
        self.on_accept = on_accept
        self._held: list[Any] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            self.accepted.append(time.time())
            self._held.append(conn)  # never read from, never answered, never closed until close()
            if self.on_accept is not None:
                self.on_accept()

    def close(self) -> None:
        import contextlib
        import socket

        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() (a close alone does not)
        self._sock.close()
        for conn in self._held:
            conn.close()
        self._thread.join(timeout=10)


@pytest.fixture
def blackhole() -> Iterator[BlackHole]:
    hole = BlackHole()
    try:
        yield hole
    finally:
        hole.close()
