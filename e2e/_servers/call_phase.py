"""How far a peer call got before it failed, read from httpcore's ``trace`` extension (D382).

"did not answer within 60 s" says nothing of where the time went: in the client's pool, in
connecting, in sending, or waiting for a server that had the whole request. A
:class:`CallPhase` rides on one request as ``extensions={"trace": phase}`` and keeps the last
event httpcore reported, so a failure can say which it was.
"""

from __future__ import annotations

import time
from typing import Any, Final

_CONNECTING: Final = ("connection.connect_tcp.", "connection.retry.", "connection.start_tls.")
_SENDING: Final = ("http11.send_request_headers.", "http11.send_request_body.started")
_CLEANUP: Final = ("http11.response_closed.", "connection.close.")
"""Steps httpcore also runs after a failure or a cancellation: they say nothing of how far the
call got, so they are not kept."""


class CallPhase:
    """The last trace event of one HTTP/1.1 request, and how many connections it tried."""

    def __init__(self) -> None:
        self.event = ""
        self.connects = 0
        self.began = time.monotonic()
        self.sent_after: float | None = None
        """Seconds from the call's start to its request's first byte going out."""

    async def __call__(self, name: str, info: dict[str, Any]) -> None:
        """httpcore's async trace callback: called at each step's start, end or failure."""
        del info
        if name.startswith(_CLEANUP):
            return
        self.event = name
        if name == "connection.connect_tcp.started":
            self.connects += 1
        elif name == "http11.send_request_headers.started" and self.sent_after is None:
            self.sent_after = time.monotonic() - self.began

    @property
    def extensions(self) -> dict[str, Any]:
        """What to pass as a request's ``extensions`` so this phase follows it."""
        return {"trace": self}

    def describe(self) -> str:
        """Where the call was when it ended, in words; for a request that went out, on which
        connection and how long after the call began."""
        where = self._where()
        if self.sent_after is None:
            return where
        connection = "a new connection" if self.connects else "a pooled connection"
        tried = ""
        if self.connects > 1:  # connects that failed and were tried again took some of the time
            failed = self.connects - 1
            tried = f", after {failed} failed connection {'attempt' if failed == 1 else 'attempts'}"
        return f"{where} (sent on {connection} {self.sent_after:.1f} s after the call began{tried})"

    def broke(self, what: str, error: Exception) -> str:
        """The detail of a call whose connection broke: ``<what> failed: <error>; <where>``."""
        return f"{what} failed: {error!r}; {self.describe()}"[:500]

    def _where(self) -> str:
        event = self.event
        if not event:
            return "it never left the client: no connection was free or made yet"
        if event.startswith(_CONNECTING):
            tries = "try" if self.connects == 1 else "tries"
            return f"no connection was made ({self.connects} {tries})"
        if event == "connection.connect_tcp.complete" or event.startswith(_SENDING):
            return "the connection was made; the request was being sent"
        waiting = event.startswith("http11.receive_response_headers.") and not event.endswith(
            ".complete"
        )
        if waiting or event == "http11.send_request_body.complete":
            return "the whole request was sent; no answer had come"
        return "the answer had begun; it was being read"
