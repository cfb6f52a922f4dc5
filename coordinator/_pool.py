"""The connection pool every midflight client sends through: httpcore's, with its assignment pass
replaced (D381).

httpx 0.28 builds on httpcore 1.0.9, whose pool misbehaves with hundreds of requests at once on
one client, which is where a controller of thousands of rollouts, and the reference servers'
data path, live. :func:`http_transport` is ``httpx.AsyncHTTPTransport`` with the pool below.
"""

from __future__ import annotations

import httpcore
import httpx
from httpcore._async.interfaces import AsyncConnectionInterface


class LinearConnectionPool(httpcore.AsyncConnectionPool):
    """httpcore's pool, with its assignment pass replaced: linear, and never closing a connection
    a request is about to use (D381).

    httpcore 1.0.9 runs ``_assign_requests_to_connections`` whenever a request starts or a
    response closes, and that pass has two faults that only show with hundreds in flight:

    - It closes an idle connection whenever *all* connections, busy ones included, number more
      than ``max_keepalive_connections``, and it may pick one that it has just handed to a queued
      request whose task has not yet marked it busy. The close then lands under that request
      once it is sent: ``ReadError('')``, or a wait until the caller's deadline
      (encode/httpcore#1110, open). With more than 64 rollouts in flight, nothing was kept
      idle either, so almost every call opened a connection.
    - It is quadratic: a list of every connection per idle connection, and per queued request.
      At 2,000 rollouts in flight at once the environment's event loop spent its time there,
      and a rollout waited 37 s (median) for its first model call.

    This pass walks the requests once and the connections once. A connection any request holds
    is never closed as expired or surplus; surplus idle connections are the oldest ones beyond
    ``max_keepalive_connections``; an idle connection is handed to one queued request per pass.
    HTTP/1.1 only: a connection serves one request at a time.
    """

    def _assign_requests_to_connections(self) -> list[AsyncConnectionInterface]:
        held = {id(request.connection) for request in self._requests if request.connection}
        closing: list[AsyncConnectionInterface] = []
        kept: list[AsyncConnectionInterface] = []
        idle: list[AsyncConnectionInterface] = []  # oldest first, held by no request
        for connection in self._connections:
            if connection.is_closed():
                continue  # nothing to close: drop it from the pool
            if id(connection) in held:
                kept.append(connection)
            elif connection.has_expired():
                closing.append(connection)
            else:
                kept.append(connection)
                if connection.is_idle():
                    idle.append(connection)
        surplus = len(idle) - self._max_keepalive_connections
        if surplus > 0:
            doomed = {id(connection) for connection in idle[:surplus]}
            closing.extend(idle[:surplus])
            idle = idle[surplus:]
            kept = [connection for connection in kept if id(connection) not in doomed]
        self._connections = kept
        for request in self._requests:
            if not request.is_queued():
                continue
            origin = request.request.url.origin
            free = next(
                (c for c in idle if c.can_handle_request(origin) and c.is_available()), None
            )
            if free is not None:
                idle.remove(free)  # one request per idle connection and pass
            else:
                if len(self._connections) >= self._max_connections:
                    if not idle:
                        continue  # it waits for a connection to come free
                    spare = idle.pop(0)
                    self._connections.remove(spare)
                    closing.append(spare)
                free = self.create_connection(origin)
                self._connections.append(free)
            request.assign_to_connection(free)
        return closing


def http_transport(limits: httpx.Limits, *, retries: int = 0) -> httpx.AsyncHTTPTransport:
    """``httpx.AsyncHTTPTransport(limits=limits, retries=retries)`` sending through a
    :class:`LinearConnectionPool`.

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
    return transport
