"""A bound on request bodies, for every route of a server app (D241).

A body over the limit gets ``413 request_too_large`` before it is parsed: a ``content-length``
over it before any byte is read, a streamed body as soon as the bytes read pass it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Final

from fastapi.responses import JSONResponse

from protocols import RequestTooLargeError

DEFAULT_MAX_BODY_BYTES: Final = 32 * 1024 * 1024
"""The largest request body a server app reads (D241): far above any body the reference flow
sends, and half a worker-channel frame (D194), so a relayed body always fits in one."""

_Scope = MutableMapping[str, Any]
_Message = MutableMapping[str, Any]
_Receive = Callable[[], Awaitable[_Message]]
_Send = Callable[[_Message], Awaitable[None]]
_ASGIApp = Callable[[_Scope, _Receive, _Send], Awaitable[None]]


def _reply(error: RequestTooLargeError) -> JSONResponse:
    return JSONResponse(error.envelope(), status_code=error.http_status)


class BodyLimit:
    """ASGI middleware: a body over ``max_bytes`` gets ``413 request_too_large``, unparsed.

    A ``content-length`` over the limit is refused before any byte is read. A body sent without
    one (chunked) is counted as it streams: the read that passes the limit raises instead of
    returning, so the app never sees a whole body; whatever the app answers then is replaced
    by the 413 (unless its reply had already started, when the connection is dropped).

    Args:
        app: The app to guard.
        max_bytes: The largest body accepted.
    """

    def __init__(self, app: _ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.app = app
        self.max_bytes = max_bytes

    def _refusal(self, size: str) -> RequestTooLargeError:
        return RequestTooLargeError(
            f"the request body is {size}; this server reads at most {self.max_bytes} bytes"
        )

    async def __call__(self, scope: _Scope, receive: _Receive, send: _Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name.lower() == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0  # the server's own parser refuses it
                if declared > self.max_bytes:
                    await _reply(self._refusal(f"{declared} bytes"))(scope, receive, send)
                    return
        received = 0
        too_large: RequestTooLargeError | None = None
        started = False

        async def counted() -> _Message:
            nonlocal received, too_large
            if too_large is not None:
                raise too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    too_large = self._refusal(f"over {self.max_bytes} bytes (streamed)")
                    raise too_large
            return message

        async def guarded(message: _Message) -> None:
            nonlocal started
            if too_large is not None and not started:
                return  # the app's answer to a body it never got whole: the 413 replaces it
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted, guarded)
        except Exception:
            if too_large is None or started:
                raise
        if too_large is not None and not started:
            await _reply(too_large)(scope, receive, send)
