"""Every HTTP client of the controller and the servers drops an idle pooled connection before a
server's keep-alive closes it (D371).

uvicorn closes a connection that has been idle for 5 s. A client whose pool keeps idle
connections for 5 s too (httpx's default) sometimes sends its request down a connection at the
moment the server closes it and reads nothing back: ``RemoteProtocolError: Server disconnected
without sending a response``. The drill's controller died of it once, 30 s into a baseline of
2,000 rollouts in flight. The race is made certain here by a server that plays the closing side:
it drops, unanswered, any request that arrives on a connection idle for ``CLOSES_AFTER_S`` or
more, a stand-in for uvicorn's 5 s on a shorter clock. A client that keeps idle connections for
2 s opens a new connection after ``IDLE_S`` and is never dropped; one that keeps them for 5 s
reuses the old one and is.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest

from coordinator import ControlClient
from coordinator._retry import RetryingCaller, RetryPolicy
from e2e._drill.control import ControlSession
from e2e._servers.cluster import Cluster, ServerEntry
from e2e._servers.worker_client import HttpCutRequester

pytestmark = pytest.mark.anyio

CLOSES_AFTER_S = 2.1
IDLE_S = 2.3


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class ClosingServer:
    """HTTP/1.1 on 127.0.0.1 that answers ``{}`` and drops requests on stale connections."""

    def __init__(self) -> None:
        self.answered = 0
        self.dropped = 0
        self.connections = 0
        self._open: set[asyncio.StreamWriter] = set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._open.add(writer)
        last = time.monotonic()
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                length = 0
                for line in head.decode("latin-1").split("\r\n"):
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                if length:
                    await reader.readexactly(length)
                if time.monotonic() - last >= CLOSES_AFTER_S:
                    self.dropped += 1  # the server's keep-alive fired as the request came in
                    return
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: 2\r\n\r\n{}"
                )
                await writer.drain()
                self.answered += 1
                last = time.monotonic()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            self._open.discard(writer)
            writer.close()
            await writer.wait_closed()

    @asynccontextmanager
    async def running(self) -> AsyncIterator[str]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.close()
            for writer in list(self._open):  # connections the client left open
                writer.close()
                await writer.wait_closed()
            await server.wait_closed()


async def _twice_with_a_pause(get: Callable[[], Awaitable[object]]) -> None:
    await get()
    await asyncio.sleep(IDLE_S)
    await get()


async def test_the_coordinator_s_ledger_pool_opens_a_new_connection_after_two_idle_seconds() -> (
    None
):
    server = ClosingServer()
    async with server.running() as url:
        # One attempt: a dropped request would raise, not be retried.
        caller = RetryingCaller(url, prefix="", token="t", name="ledger", policy=RetryPolicy(1))
        try:
            await _twice_with_a_pause(lambda: caller.call("GET", "/x", budget=lambda: 5.0))
        finally:
            await caller.aclose()
    assert (server.answered, server.dropped, server.connections) == (2, 0, 2)


async def test_the_coordinator_s_control_pool_opens_a_new_connection_after_two_idle_seconds() -> (
    None
):
    server = ClosingServer()
    async with server.running() as url:
        client = ControlClient(url, token="t", attempts=1)
        try:
            await _twice_with_a_pause(lambda: client._caller.call("GET", "/x", budget=lambda: 5.0))
        finally:
            await client.aclose()
    assert (server.answered, server.dropped) == (2, 0)


async def test_the_cut_requester_s_pool_opens_a_new_connection_after_two_idle_seconds() -> None:
    server = ClosingServer()
    requester = HttpCutRequester("t")
    async with server.running() as url, requester.running():
        assert requester.client is not None
        client = requester.client
        await _twice_with_a_pause(lambda: client.get(url + "/x"))
    assert (server.answered, server.dropped) == (2, 0)


async def test_the_drill_s_controller_reads_on_a_fresh_connection_and_resends_a_lost_read(
    tmp_path: Path,
) -> None:
    server = ClosingServer()
    async with server.running() as url:
        cluster = Cluster(tmp_path, (ServerEntry(name="policy", role="model", url=url),))
        session = ControlSession(cluster, "t")
        try:
            await _twice_with_a_pause(lambda: session._status(url))
            assert (server.answered, server.dropped) == (2, 0)
            # A read the transport lost is sent again: here the pool is made to keep the stale
            # connection, so the server drops the first try and answers the second.
            await session._http.aclose()
            session._http = httpx.AsyncClient(limits=httpx.Limits(keepalive_expiry=30.0))
            await _twice_with_a_pause(lambda: session._status(url))
            assert (server.answered, server.dropped) == (4, 1)
        finally:
            await session._http.aclose()


def test_a_reference_server_keeps_an_idle_connection_well_past_five_seconds() -> None:
    """D374: the server's side of the margin. uvicorn's own default (5 s) would have closed this
    connection before its second request; the reference servers keep it for 30 s."""
    import socket

    from e2e._launch.processes import server_config

    from .threaded_server import serving_on_a_thread

    async def app(scope: dict[str, object], receive: object, send: object) -> None:
        assert scope["type"] == "http"
        start = {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-length", b"2")],
        }
        await send(start)  # type: ignore[operator]
        await send({"type": "http.response.body", "body": b"ok"})  # type: ignore[operator]

    with serving_on_a_thread(server_config(app, lifespan="off")) as port:
        request = f"GET / HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n\r\n".encode()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:

            def answered() -> bytes:
                """One whole response (its head and its two-byte body), however it is split."""
                received = b""
                while not received.endswith(b"\r\n\r\nok"):
                    chunk = connection.recv(4096)
                    if not chunk:
                        return received  # the server closed the connection
                    received += chunk
                return received

            connection.sendall(request)
            assert answered().startswith(b"HTTP/1.1 200")
            time.sleep(6.0)  # idle past uvicorn's default keep-alive
            connection.sendall(request)
            assert answered().startswith(b"HTTP/1.1 200")
