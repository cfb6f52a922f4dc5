"""The connection pool every midflight client sends through: httpcore's, with its assignment pass
replaced (D381, D384, D407), and sockets that look for the server's close before a request is
sent on them again (D451).

httpx 0.28 builds on httpcore 1.0.9, whose pool misbehaves with hundreds of requests at once on
one client, which is where a controller of thousands of rollouts, and the reference servers'
data path, live. :func:`http_transport` is ``httpx.AsyncHTTPTransport`` with the pool below.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import ssl
import time
from collections.abc import Iterable
from typing import Any, Final, cast

import httpcore
import httpx
import structlog
from httpcore._async.connection_pool import AsyncPoolRequest
from httpcore._async.interfaces import AsyncConnectionInterface
from httpcore._backends.base import SOCKET_OPTION as SocketOption
from httpcore._utils import is_socket_readable

Connection = AsyncConnectionInterface
_log: Final = structlog.get_logger("midflight.http")
OriginKey = tuple[bytes, bytes, int]
SWEEP_EVERY: Final = 256
"""Passes between two sweeps of every connection for closed ones no request released."""
CLOSES_PER_PASS: Final = 2
"""Most connections one pass hands back to be closed; the rest wait for the next passes (D385).

httpcore awaits those closes in the task whose request started or ended the pass, one event-loop
turn each, and that request may already hold a pooled connection it has not used yet. At 2,000
in flight a pass that closed hundreds of expired connections kept such a request from sending
for 28-51 s, past the server's 30 s keep-alive: ``ReadError('')``."""


def _origin_key(request: AsyncPoolRequest) -> OriginKey:
    origin = request.request.url.origin
    return origin.scheme, origin.host, origin.port


class _Requests(list[AsyncPoolRequest]):
    """The pool's request list, remembering the connection each removed request leaves behind.

    httpcore removes a request from this list when its response closes or it fails, and runs a
    pass right after: that is the moment its connection went idle (or closed), so a pass looks
    at those connections only, not at every connection in the pool.
    """

    def __init__(self, requests: Iterable[AsyncPoolRequest] = ()) -> None:
        super().__init__(requests)
        self.released: list[tuple[Connection, OriginKey]] = []

    def remove(self, request: AsyncPoolRequest) -> None:
        super().remove(request)
        if request.connection is not None:
            self.released.append((request.connection, _origin_key(request)))


class LinearConnectionPool(httpcore.AsyncConnectionPool):
    """httpcore's pool, with an assignment pass that never closes a connection a request holds
    and whose work does not grow with the requests in flight (D381, D384).

    httpcore 1.0.9 runs ``_assign_requests_to_connections`` whenever a request starts or a
    response closes, and that pass has three faults that only show with hundreds in flight:

    - It closes an idle connection whenever *all* connections, busy ones included, number more
      than ``max_keepalive_connections``, and it may pick one that it has just handed to a queued
      request whose task has not yet marked it busy. The close then lands under that request
      once it is sent: ``ReadError('')``, or a wait until the caller's deadline
      (encode/httpcore#1110, open). With more than 64 rollouts in flight, nothing was kept
      idle either, so almost every call opened a connection.
    - It is quadratic: a list of every connection per idle connection, and per queued request.
      At 2,000 rollouts in flight at once the environment's event loop spent its time there,
      and a rollout waited 37 s (median) for its first model call.
    - Even linear, a walk of every connection on each request start and response close took a
      sixth to a third of the busiest processes' time at 2,000 in flight.

    This pool keeps its idle connections itself, oldest first, per origin too. A connection
    joins them when the request that held it is removed from the pool and it is idle; a pass
    looks at those connections, the oldest idle ones (idle for longer than ``keepalive_expiry``
    since it parked them, or beyond ``max_keepalive_connections``: closed, D407), and the queued
    requests, each of which gets the newest idle connection of its origin that has not expired
    (``has_expired()``, which also asks the socket), or a new one. A connection
    handed to a request has left the idle ones, so no pass can close it under that request.
    Connections to close wait in a queue, and a pass hands back at most ``CLOSES_PER_PASS`` of
    them (D385), unless room for a new connection is needed at once. HTTP/1.1 only: a
    connection serves one request at a time.
    """

    _requests: _Requests
    _idle: dict[int, tuple[Connection, OriginKey]]
    _idle_by_origin: dict[OriginKey, dict[int, Connection]]
    _doomed: collections.deque[Connection]
    _parked_at: dict[int, float]
    _passes: int

    def adopt(self) -> None:
        """Take over the state of a plain httpcore pool whose class was just swapped for this."""
        self._requests = _Requests(self._requests)
        self._idle = {}
        self._idle_by_origin = {}
        self._doomed = collections.deque()  # still in the pool until handed back to be closed
        self._parked_at = {}
        self._passes = 0

    def _assign_requests_to_connections(self) -> list[Connection]:
        closing: list[Connection] = []
        self._passes += 1
        if self._passes % SWEEP_EVERY == 0:
            self._sweep()
        released, self._requests.released = self._requests.released, []
        for connection, origin in released:
            if connection.is_closed():
                self._drop(connection)
            elif connection.is_idle():
                self._park(connection, origin)
        now = time.monotonic()
        while self._idle:
            connection, origin = next(iter(self._idle.values()))
            # Idle for too long by the pool's own clock, not ``has_expired()``: that also asks the
            # socket whether the server closed it, two system calls on every pass (D407). A
            # connection the server closed is found when it is next taken (``_take_idle``).
            kept = self._keepalive_expiry is None or (
                now - self._parked_at[id(connection)] <= self._keepalive_expiry
            )
            if len(self._idle) <= self._max_keepalive_connections and kept:
                break
            self._unpark(connection, origin)
            self._doomed.append(connection)
        for request in self._requests:
            if request.connection is not None:
                continue
            free = self._take_idle(_origin_key(request))
            if free is None:
                if len(self._connections) >= self._max_connections:
                    if self._idle:
                        spare, spare_origin = next(iter(self._idle.values()))
                        self._unpark(spare, spare_origin)
                    elif self._doomed:
                        spare = self._doomed.popleft()
                    else:
                        continue  # it waits for a connection to come free
                    self._drop(spare)  # closed now: its room is needed at once
                    closing.append(spare)
                free = self.create_connection(request.request.url.origin)
                self._connections.append(free)
            request.assign_to_connection(free)
        while self._doomed and len(closing) < CLOSES_PER_PASS:
            doomed = self._doomed.popleft()
            self._drop(doomed)
            closing.append(doomed)
        return closing

    def _take_idle(self, origin: OriginKey) -> Connection | None:
        """The newest idle connection to ``origin`` still usable; expired ones met are doomed."""
        bucket = self._idle_by_origin.get(origin)
        while bucket:
            connection = next(reversed(bucket.values()))
            self._unpark(connection, origin)
            if connection.is_closed():
                self._drop(connection)
            elif connection.has_expired() or not connection.is_available():
                self._doomed.append(connection)
            else:
                return connection
        return None

    def _park(self, connection: Connection, origin: OriginKey) -> None:
        key = id(connection)
        self._idle.pop(key, None)  # a repeat moves it to the newest end
        self._idle[key] = (connection, origin)
        self._parked_at[key] = time.monotonic()
        bucket = self._idle_by_origin.setdefault(origin, {})
        bucket.pop(key, None)
        bucket[key] = connection

    def _unpark(self, connection: Connection, origin: OriginKey) -> None:
        key = id(connection)
        self._idle.pop(key, None)
        self._parked_at.pop(key, None)
        bucket = self._idle_by_origin.get(origin)
        if bucket is not None:
            bucket.pop(key, None)
            if not bucket:
                del self._idle_by_origin[origin]

    def _drop(self, connection: Connection) -> None:
        with contextlib.suppress(ValueError):  # already gone from the pool
            self._connections.remove(connection)

    def _sweep(self) -> None:
        """Drop closed connections that no request released (a request that met a closed
        connection is queued again without being removed)."""
        for connection in [c for c in self._connections if c.is_closed()]:
            parked = self._idle.get(id(connection))
            if parked is not None:
                self._unpark(*parked)
            self._drop(connection)


class _CheckedStream(httpcore.AsyncNetworkStream):
    """A connection's socket that looks for the server's close before a request goes out on it
    again (D451).

    The pool asks a connection whether the server closed it when a request takes it
    (``has_expired()``), but the request's task then passes several awaits before its first byte
    goes out, and on a loaded event loop each can take seconds. A server's keep-alive close that
    lands in between meets the request: ``ReadError('')``. The first write of each request after
    the first on this connection asks again; input waiting on an idle HTTP/1.1 connection can only
    be the server's close (httpcore reads it the same way), so the request is refused with
    ``ConnectionNotAvailable``, and httpcore's pool closes this connection and sends the request
    on another. Nothing of the request has been sent.
    """

    def __init__(self, stream: httpcore.AsyncNetworkStream) -> None:
        self._stream = stream
        self._socket: socket.socket | None = stream.get_extra_info("socket")
        """Kept: httpcore's ``is_readable`` finds the socket again each time (``getpeername``)."""
        self._answered = False
        """Whether a read came after the last write: the next write begins a new request."""

    def _closed_by_server(self) -> bool:
        if self._socket is None:
            return bool(self._stream.get_extra_info("is_readable"))
        return is_socket_readable(self._socket)

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        data = await self._stream.read(max_bytes, timeout)
        self._answered = True
        return data

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        if self._answered:
            self._answered = False
            if self._closed_by_server():
                # Rare by design (a server closes an idle connection long after this pool
                # would have): worth a line, since it says a loop here was far behind.
                _log.warning("pooled_connection_closed_by_server")
                raise httpcore.ConnectionNotAvailable()
        await self._stream.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
    ) -> httpcore.AsyncNetworkStream:
        return _CheckedStream(await self._stream.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        # The kept socket answers what httpcore asks at every reuse (``has_expired()``). anyio
        # answers any question about a socket by first building every attribute it has, and
        # the peer's address among them is a ``getpeername`` (D455).
        if self._socket is not None:
            if info == "is_readable":
                return is_socket_readable(self._socket)
            if info == "socket":
                return self._socket
        return self._stream.get_extra_info(info)


class _CheckedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend, handing out :class:`_CheckedStream` sockets."""

    def __init__(self, backend: httpcore.AsyncNetworkBackend) -> None:
        self._backend = backend

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        local_address: str | None = None,
        socket_options: Iterable[SocketOption] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await self._backend.connect_tcp(host, port, timeout, local_address, socket_options)
        return _CheckedStream(stream)

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        socket_options: Iterable[SocketOption] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await self._backend.connect_unix_socket(path, timeout, socket_options)
        return _CheckedStream(stream)

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)


def http_transport(limits: httpx.Limits, *, retries: int = 0) -> httpx.AsyncHTTPTransport:
    """``httpx.AsyncHTTPTransport(limits=limits, retries=retries)`` sending through a
    :class:`LinearConnectionPool` whose connections check for the server's close before each
    request after their first.

    Args:
        limits: The pool's limits (a client given a transport ignores its own ``limits=``).
        retries: More tries of a connection that could not be made (httpcore's ``retries``).
    """
    transport = httpx.AsyncHTTPTransport(limits=limits, retries=retries)
    pool = transport._pool
    # The pass below was written against the state of httpcore's plain HTTP/1.1 pool.
    if type(pool) is not httpcore.AsyncConnectionPool or pool._http2:
        raise RuntimeError(f"http_transport expects httpcore's HTTP/1.1 pool, not {pool!r}")
    pool.__class__ = LinearConnectionPool  # the same state; only the pass differs
    cast(LinearConnectionPool, pool).adopt()
    pool._network_backend = _CheckedBackend(pool._network_backend)
    return transport
