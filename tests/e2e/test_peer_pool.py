"""The data path's connection pool (D381): a connection handed to a request is never closed under
it, and idle connections are kept while hundreds are busy. Real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from typing import Any

import anyio.abc._sockets
import httpcore
import httpx
import pytest

import coordinator._pool
from coordinator import http_transport
from coordinator._pool import LinearConnectionPool
from e2e._servers.peer_pool import peer_transport

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class _KeepAliveServer:
    """HTTP/1.1 on 127.0.0.1 that keeps connections open: ``/hold`` waits for ``release``,
    anything else answers at once. Counts the connections it accepted."""

    def __init__(self) -> None:
        self.accepted = 0
        self.release = asyncio.Event()
        self.held = 0
        self._handlers: list[asyncio.Task[None]] = []
        self._writers: list[asyncio.StreamWriter] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self._handlers.append(asyncio.current_task())  # type: ignore[arg-type]
        self._writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if head.startswith(b"POST /hold") or head.startswith(b"GET /hold"):
                    self.held += 1
                    await self.release.wait()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            with suppress(ConnectionError):
                await writer.wait_closed()

    @asynccontextmanager
    async def running(self) -> AsyncIterator[str]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0, backlog=512)
        try:
            yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        finally:
            self.release.set()
            server.close()
            for writer in self._writers:
                writer.close()  # the handler's next read ends
            await asyncio.gather(*self._handlers, return_exceptions=True)


async def _until(condition: object, seconds: float = 10.0) -> None:
    async with asyncio.timeout(seconds):
        while not condition():  # type: ignore[operator]  # noqa: ASYNC110 - the pool's state
            await asyncio.sleep(0.01)


async def test_a_connection_handed_to_a_queued_request_is_not_closed_as_surplus() -> None:
    """encode/httpcore#1110: a pass hands idle connection X to request B; before B's task marks
    X busy, another pass (a response closing) counts X among the surplus idle connections and
    closes it, and the close lands under B once it is sent."""
    server = _KeepAliveServer()
    async with server.running() as url:
        limits = httpx.Limits(max_keepalive_connections=1, keepalive_expiry=30)
        transport = http_transport(limits)
        pool = transport._pool
        assert isinstance(pool, LinearConnectionPool)
        async with httpx.AsyncClient(base_url=url, transport=transport) as client:
            first = asyncio.ensure_future(client.get("/quick"))
            held = asyncio.ensure_future(client.get("/hold"))
            await _until(lambda: server.held == 1)
            assert (await first).status_code == 200
            await _until(lambda: len(pool.connections) == 2)
            (x,) = [c for c in pool.connections if c.is_idle()]
            # B is queued and handed X, as the pass after a request's arrival does.
            b = httpcore._async.connection_pool.AsyncPoolRequest(
                httpcore.Request("GET", f"{url}/quick", headers=[("Host", url[len("http://") :])])
            )
            pool._requests.append(b)
            assert pool._assign_requests_to_connections() == []
            assert b.connection is x
            # The held call's answer comes back: its close runs a pass with two idle connections
            # and room for one. X is B's, so the other is the surplus.
            server.release.set()
            assert (await held).status_code == 200
            assert not x.is_closed(), "the pass closed the connection B was handed"
            assert x in pool.connections
            reply = await x.handle_async_request(b.request)
            await reply.aread()
            assert reply.status == 200
            pool._requests.remove(b)


def _nothing() -> None:
    pass


async def _twenty_calls_beside_a_hundred_busy(
    started: Callable[[], None] = _nothing, ended: Callable[[], None] = _nothing
) -> int:
    """20 calls one after another on a ``peer_transport()`` client while 100 others on it are held
    open (``started`` and ``ended`` run around the 20); the connections the 20 opened."""
    server = _KeepAliveServer()
    async with (
        server.running() as url,
        httpx.AsyncClient(base_url=url, transport=peer_transport()) as client,
    ):
        busy = [asyncio.ensure_future(client.get("/hold")) for _ in range(100)]
        await _until(lambda: server.held == 100)
        before = server.accepted
        started()
        for _ in range(20):
            assert (await client.get("/quick")).status_code == 200
        ended()
        opened = server.accepted - before
        server.release.set()
        assert all(reply.status_code == 200 for reply in await asyncio.gather(*busy))
    return opened


async def test_idle_connections_are_kept_while_more_than_the_keepalive_cap_are_busy() -> None:
    """httpcore 1.0.9 closed every idle connection while more than 64 (busy ones too) were open,
    so with hundreds of rollouts in flight nearly every call opened a connection."""
    opened = await _twenty_calls_beside_a_hundred_busy()
    assert opened == 1, f"20 calls one after another opened {opened} connections"


async def test_a_pass_looks_at_the_connections_it_must_not_at_every_busy_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """D384: walking every connection on each request start and response close took a sixth to
    a third of the busiest processes' time at 2,000 rollouts in flight."""
    looked = 0
    during: list[int] = []
    connection_class = httpcore._async.connection.AsyncHTTPConnection
    for name in ("is_closed", "is_idle", "has_expired", "is_available"):
        original = getattr(connection_class, name)

        def counted(self: object, _original: object = original) -> bool:
            nonlocal looked
            looked += 1
            return _original(self)  # type: ignore[operator, no-any-return]

        monkeypatch.setattr(connection_class, name, counted)

    def start() -> None:
        nonlocal looked
        looked = 0

    await _twenty_calls_beside_a_hundred_busy(start, lambda: during.append(looked))
    # Two passes a call, each looking at a handful of connections: not at the 100 busy ones
    # (httpcore's pass, and D381's, looked at each of them every time: 4,000 looks or more).
    assert during[0] <= 20 * 10, f"20 calls looked at connections {during[0]} times"


async def test_a_pass_hands_back_at_most_two_connections_to_close() -> None:
    """D385: httpcore awaits a pass's closes, one event-loop turn each, in the task of the request
    that ran it, which may already hold its own connection. At 2,000 in flight a pass that closed
    hundreds of expired connections kept such requests from sending for 28-51 s, past the
    server's 30 s keep-alive."""
    server = _KeepAliveServer()
    limits = httpx.Limits(max_keepalive_connections=64, keepalive_expiry=0.05)
    async with (
        server.running() as url,
        httpx.AsyncClient(base_url=url, transport=http_transport(limits)) as client,
    ):
        pool = client._transport._pool  # type: ignore[attr-defined]
        assert isinstance(pool, LinearConnectionPool)
        replies = await asyncio.gather(*(client.get("/quick") for _ in range(20)))
        assert all(reply.status_code == 200 for reply in replies)
        assert len(pool.connections) == 20
        await asyncio.sleep(0.1)  # every idle connection has expired
        closes = []
        for _ in range(12):  # the passes of twelve requests' starts and ends
            closing = pool._assign_requests_to_connections()
            closes.append(len(closing))
            await pool._close_connections(closing)
        assert closes == [2] * 10 + [0, 0], closes
        assert pool.connections == []
        assert (await client.get("/quick")).status_code == 200  # a new connection


class _Tally:
    """Counts the calls of what it wraps during ``_twenty_calls_beside_a_hundred_busy``'s 20."""

    def __init__(self) -> None:
        self.calls = 0
        self.during: list[int] = []

    def wrap(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any) -> Any:
            self.calls += 1
            return real(*args)

        return counted

    def _start(self) -> None:
        self.calls = 0

    async def twenty_calls(self) -> int:
        """The 20 calls; the connections they opened (the count is in ``during[0]``)."""
        return await _twenty_calls_beside_a_hundred_busy(
            self._start, lambda: self.during.append(self.calls)
        )


async def test_a_pass_asks_no_idle_socket_whether_the_server_closed_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """D407: ``has_expired()`` on the oldest idle connection, on every pass, asked its socket
    whether it was readable (``getpeername`` and a ``poll``, two system calls). In the 4,000
    drill's baseline that was an eighth of the samples of the servers' stalled event loops.
    Only a connection about to be reused is asked now: when it is taken, and again at the
    first write of its request (D451)."""
    asked = _Tally()
    # Every question reaches one of these two polls: the kept socket's (D451, D455) or httpcore's.
    for module in (coordinator._pool, httpcore._backends.anyio):
        monkeypatch.setattr(module, "is_socket_readable", asked.wrap(module.is_socket_readable))
    opened = await asked.twenty_calls()
    assert opened == 1
    # The 19 reuses of the one idle connection ask twice each; the 40 passes ask nothing.
    during = asked.during
    assert 19 <= during[0] <= 2 * 20, f"20 calls asked an idle socket {during[0]} times"


async def test_a_reused_connection_is_asked_about_through_its_kept_socket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """D455: anyio answers any question about a socket by building all of its attributes, the
    peer's address among them (a ``getpeername``). ``has_expired()`` asked that way at every
    reuse: 69 of the 1,123 samples of the stalled loops of a 4,000 drill. The stream now answers
    from the socket it kept, so only opening a connection builds them."""
    built = _Tally()
    provider = anyio.abc._sockets._SocketProvider
    real = provider.extra_attributes.fget  # type: ignore[attr-defined]
    monkeypatch.setattr(provider, "extra_attributes", property(built.wrap(real)))
    opened = await built.twenty_calls()
    assert opened == 1
    during = built.during
    assert during[0] <= 3, f"20 calls on one connection built its attributes {during[0]} times"
