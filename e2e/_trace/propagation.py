"""The trace context on the reference servers' own HTTP calls (httpx request hooks)."""

from __future__ import annotations

from typing import Any, Final

import httpx

from participants import inject_headers


async def inject_trace_context(request: httpx.Request) -> None:
    """httpx ``request`` event hook: send the current trace context with the request."""
    inject_headers(request.headers)


TRACE_HOOKS: Final[dict[str, list[Any]]] = {"request": [inject_trace_context]}
"""``event_hooks`` for an ``httpx.AsyncClient`` whose calls carry the trace context."""
