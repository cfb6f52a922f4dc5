"""A request never meets a keep-alive close that a busy event loop let through (D451).

A reference server closes a connection idle for its keep-alive period, and a client drops its own
idle connections much sooner (D371, D374). On a loaded machine both sides' loops lag, and the
race comes back on either side:

- the server's timer callback runs at the end of a long batch of callbacks, after the client's
  next request has reached the socket, and closes it unread;
- the client takes a connection from its pool, and its task reaches the first write seconds
  later, after the server's close has arrived.

Each test stalls one loop by blocking it (``time.sleep``) at the moment that matters, against a
real uvicorn server on 127.0.0.1 with a keep-alive of ``KEEP_ALIVE_S``. Each first shows that the
stock part loses the request, so the scenario is the race and not something gentler.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from coordinator import http_transport
from e2e._launch.keep_alive import PatientH11Protocol, PatientHttpToolsProtocol
from e2e._launch.processes import server_config

from .threaded_server import serving_on_a_thread

KEEP_ALIVE_S = 1
STOCK: tuple[type[Any], ...] = (H11Protocol, HttpToolsProtocol)
"""uvicorn's own protocols: h11 (pure Python) and httptools (what the servers run, D457)."""
PATIENT = (PatientH11Protocol, PatientHttpToolsProtocol)


class _App:
    """Answers ``ok``; ``/stall`` also blocks the server's loop twice, so that its keep-alive
    timer runs late, in the same batch of callbacks as, and after, a 2 s block."""

    def __init__(self) -> None:
        self.clients: list[object] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        self.clients.append(scope["client"])
        if scope["path"] == "/stall":
            loop = asyncio.get_running_loop()
            # The keep-alive fires KEEP_ALIVE_S after this response. The first block spans that
            # moment; after it, the second block and the overdue timer run in one batch.
            loop.call_later(KEEP_ALIVE_S - 0.2, time.sleep, 1.0)
            loop.call_later(KEEP_ALIVE_S - 0.1, time.sleep, 2.0)
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
        )
        await send({"type": "http.response.body", "body": b"ok"})


@contextmanager
def _serving(app: _App, protocol: type[Any]) -> Iterator[int]:
    """A uvicorn server of the reference configuration with ``protocol``; yields its port."""
    config = server_config(app, lifespan="off")
    config.timeout_keep_alive = KEEP_ALIVE_S
    config.http = protocol
    with serving_on_a_thread(config) as port:
        yield port


def _exchange(connection: socket.socket, path: str, port: int) -> bytes:
    """Send one GET and read its whole answer; what came back if the server closed first."""
    connection.sendall(f"GET {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n\r\n".encode())
    received = b""
    while not received.endswith(b"\r\n\r\nok"):
        try:
            chunk = connection.recv(4096)
        except ConnectionResetError:
            return received
        if not chunk:
            return received
        received += chunk
    return received


@pytest.mark.parametrize(
    "protocol",
    [*STOCK, *PATIENT],
    ids=["uvicorn-h11", "uvicorn-httptools", "patient-h11", "patient-httptools"],
)
def test_a_late_keep_alive_timer_does_not_close_a_connection_with_a_request_waiting(
    protocol: type[Any],
) -> None:
    """The request arrives while the server's loop is blocked past its keep-alive deadline; the
    timer runs after the block, with the request unread in the socket. uvicorn's own protocol
    closes it (the client reads nothing); the reference servers' protocol answers it."""
    app = _App()
    with (
        capture_logs() as logs,
        _serving(app, protocol) as port,
        socket.create_connection(("127.0.0.1", port), timeout=15) as connection,
    ):
        assert _exchange(connection, "/stall", port).startswith(b"HTTP/1.1 200")
        # The server's loop: blocked from 0.8 s to 1.8 s, then from 1.8 s to 3.8 s, with the
        # keep-alive timer (due at 1.0 s) after the second block. Send in the middle of it.
        time.sleep(KEEP_ALIVE_S + 1.8)
        answer = _exchange(connection, "/", port)
    if protocol in STOCK:
        assert answer == b"", (
            "the scenario no longer reproduces uvicorn's close of a waiting request"
        )
    else:
        assert answer.startswith(b"HTTP/1.1 200"), answer
        assert len(app.clients) == 2
        deferred = [e for e in logs if e["event"] == "keep_alive_close_deferred"]
        assert len(deferred) == 1
        assert deferred[0]["late_s"] >= 2.0  # the timer ran after both blocks


@pytest.mark.parametrize("patient", PATIENT, ids=["h11", "httptools"])
def test_a_late_keep_alive_timer_that_finds_the_clients_close_ends_the_connection_quietly(
    patient: type[Any],
) -> None:
    """The same late timer, but what waits in the socket is the client's close: the connection
    ends as uvicorn's would, and no request-kept warning is logged."""
    app = _App()
    server_connections: set[object] = set()

    class Watched(patient):  # type: ignore[misc]  # a parametrized base
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            server_connections.add(self)

        def connection_lost(self, exc: Exception | None) -> None:
            super().connection_lost(exc)
            server_connections.discard(self)

    with capture_logs() as logs, _serving(app, Watched) as port:
        connection = socket.create_connection(("127.0.0.1", port), timeout=15)
        assert _exchange(connection, "/stall", port).startswith(b"HTTP/1.1 200")
        assert len(server_connections) == 1
        time.sleep(KEEP_ALIVE_S + 1.8)  # inside the second block, before the timer runs
        connection.close()
        deadline = time.monotonic() + 10
        while server_connections:
            assert time.monotonic() < deadline, "the server kept a connection its client closed"
            time.sleep(0.05)
    assert [e for e in logs if e["event"] == "keep_alive_close_deferred"] == []


class _StallBeforeSending:
    """An httpcore trace callback that blocks the client's loop once, just before a request's
    first byte goes out: a task that took a pooled connection and ran late."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.stalled = False

    async def __call__(self, name: str, info: dict[str, Any]) -> None:
        del info
        if name == "http11.send_request_headers.started" and not self.stalled:
            self.stalled = True
            time.sleep(self.seconds)  # noqa: ASYNC251 - the stalled loop is the point


@pytest.mark.anyio
@pytest.mark.parametrize("checked", [False, True], ids=["httpx", "midflight"])
async def test_a_request_that_reaches_a_closed_pooled_connection_late_goes_on_another(
    checked: bool,
) -> None:
    """The request takes a pooled connection 0.3 s after its last answer, the server's keep-alive
    closes it at 1.0 s, and the request's first write comes at 1.8 s. httpx's own transport sends
    it into the closed connection ("Server disconnected"); midflight's sees the close and sends it
    on a new connection."""
    app = _App()
    limits = httpx.Limits(keepalive_expiry=30.0)  # the pool's clock must not be what saves it
    transport = http_transport(limits) if checked else httpx.AsyncHTTPTransport(limits=limits)
    with _serving(app, PatientHttpToolsProtocol) as port:
        async with httpx.AsyncClient(
            transport=transport, base_url=f"http://127.0.0.1:{port}"
        ) as client:
            assert (await client.get("/")).text == "ok"
            await asyncio.sleep(0.3)
            stall = _StallBeforeSending(KEEP_ALIVE_S + 0.5)
            if not checked:
                with pytest.raises(httpx.RemoteProtocolError, match="Server disconnected"):
                    await client.get("/", extensions={"trace": stall})
                return
            with capture_logs() as logs:
                reply = await client.get("/", extensions={"trace": stall})
    assert [e["event"] for e in logs] == ["pooled_connection_closed_by_server"]
    assert stall.stalled
    assert reply.text == "ok"
    assert len(app.clients) == 2
    assert app.clients[0] != app.clients[1], "the second request went out on a new connection"


def test_every_reference_server_parses_http_with_httptools_and_the_patient_keep_alive() -> None:
    """D457: llhttp, in C, instead of h11's pure Python (about 14 % of a resources server's CPU
    a tool call), with D451's keep-alive kept."""
    assert server_config(_App(), lifespan="off").http is PatientHttpToolsProtocol


@pytest.mark.parametrize("patient", PATIENT, ids=["h11", "httptools"])
@pytest.mark.parametrize(
    "raw",
    [b"GARBAGE\r\n\r\n", b"GET / HTTP/1.1\r\nhost: x\r\ncontent-length: abc\r\n\r\n"],
    ids=["request-line", "content-length"],
)
def test_a_malformed_request_gets_a_400_from_either_parser(patient: type[Any], raw: bytes) -> None:
    app = _App()
    with (
        _serving(app, patient) as port,
        socket.create_connection(("127.0.0.1", port), timeout=15) as connection,
    ):
        connection.sendall(raw)
        received = b""
        while chunk := connection.recv(4096):
            received += chunk
    assert received.startswith(b"HTTP/1.1 400 Bad Request"), received
    assert app.clients == []  # the app never saw it
