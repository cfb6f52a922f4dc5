"""uvicorn's HTTP/1.1 protocols, httptools' (what the servers run, D457) and h11's, with a
keep-alive close that first looks for a waiting request (D451).

uvicorn arms a timer when it finishes a response and closes the connection when the timer fires,
unless a request has been read from it by then. On a busy event loop the two are far apart: the
timer's callback runs at the end of a batch of ready callbacks that may take seconds, and a
request that reached the socket during that batch has not been read yet. uvicorn then closes a
socket with unread data, the kernel answers the client with a reset, and a client that sent a
whole request reads nothing back (``ReadError('')`` or "Server disconnected without sending a
response"). The protocols below ask the socket first: a connection with bytes (or the client's
close) waiting is left to the read that is already due, and the timer is armed again in case that
read never comes.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Final

import structlog
from httpcore._utils import is_socket_readable
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_log: Final = structlog.get_logger("midflight.serve")

# Both of uvicorn's HTTP/1.1 protocols keep the timer, the transport and the loop under the same
# names; the mixin is checked against one of them and placed before either.
if TYPE_CHECKING:

    class _Protocol:
        transport: asyncio.Transport
        loop: asyncio.AbstractEventLoop
        timeout_keep_alive: int
        timeout_keep_alive_task: asyncio.TimerHandle | None

        def timeout_keep_alive_handler(self) -> None: ...
        def data_received(self, data: bytes) -> None: ...

else:
    _Protocol = object


class _PatientKeepAlive(_Protocol):
    """A keep-alive timer that never closes a connection with input waiting."""

    _late: float | None = None
    """How late the keep-alive timer ran when it last left this connection open; cleared once
    the input it found has been read."""

    def timeout_keep_alive_handler(self) -> None:
        """Close the idle connection, unless its next request (or its close) has already arrived;
        then check again after another keep-alive period."""
        sock = self.transport.get_extra_info("socket")
        # httpcore's readability check: ``poll``, so descriptors past 1,024 work too.
        if not self.transport.is_closing() and sock is not None and is_socket_readable(sock):
            fired = self.timeout_keep_alive_task
            self._late = 0.0 if fired is None else self.loop.time() - fired.when()
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )
            return
        super().timeout_keep_alive_handler()

    def data_received(self, data: bytes) -> None:
        """uvicorn's, saying first when a request came in on a connection the keep-alive timer
        would have closed (a client's close that the timer found says nothing: closing was
        right)."""
        if self._late is not None:
            # Rare by design (a client idle for the whole keep-alive, then a late timer): worth
            # a line, since it says a loop here was far behind and a request was kept.
            _log.warning("keep_alive_close_deferred", late_s=round(self._late, 3))
            self._late = None
        super().data_received(data)


class PatientH11Protocol(_PatientKeepAlive, H11Protocol):
    """uvicorn's h11 protocol (pure Python) with the patient keep-alive."""


class PatientHttpToolsProtocol(_PatientKeepAlive, HttpToolsProtocol):
    """uvicorn's httptools protocol (llhttp, in C) with the patient keep-alive: what the
    reference servers run (D457)."""
