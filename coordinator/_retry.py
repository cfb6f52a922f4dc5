"""The one retrying boundary of the coordinator's HTTP clients.

``ControlClient`` (a participant's control routes) and ``LedgerClient`` (a model server's ledger
routes) send every request through a ``RetryingCaller``: each attempt runs under a deadline (an
``anyio`` scope and the httpx timeout, both the attempt's budget), a non-200 reply becomes the
typed ``WireError`` of its code, and the whole call is retried by one tenacity loop. The policy is
data (``RetryPolicy``: attempts, the wait between them, an optional deadline after which nothing is
retried) and applies here only, never nested: the clients above do not retry, and nothing below
does. Only transport failures and codes the error table marks retryable are retried, so a call
goes out again only where the request may not have arrived, its reply was lost, or the server
said to come back; both clients' calls are idempotent, so a repeat is harmless.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import anyio
import httpx
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential
from tenacity.stop import stop_base
from tenacity.wait import wait_base

from protocols import WireError, error_from_envelope

from ._http_client import HttpClient
from ._pool import http_transport
from ._tracing import inject_headers

DEFAULT_CONTROL_ATTEMPTS: Final = 3
"""How many times a retryable failure is tried in all, by default."""

IDLE_CONNECTION_EXPIRY_S: Final = 2.0
"""How long a pooled connection may sit idle before a call opens a new one instead (D371).

uvicorn closes a connection idle for 5 s, as does httpx's default pool: a call sent down a
connection at the moment the server closed it reads nothing back (``RemoteProtocolError: Server
disconnected without sending a response``). Expiring idle connections at 2 s keeps a pooled
connection well inside any server's keep-alive of 5 s, so that race costs no retry."""


def pool_limits(max_connections: int | None = 100, max_keepalive: int | None = 20) -> httpx.Limits:
    """httpx's pool limits with idle connections expiring at ``IDLE_CONNECTION_EXPIRY_S``."""
    return httpx.Limits(
        max_connections=max_connections,
        max_keepalive_connections=max_keepalive,
        keepalive_expiry=IDLE_CONNECTION_EXPIRY_S,
    )


ReplyCheck = Callable[[str, httpx.Response], None]
"""Looks at a reply before its envelope is read: ``(path, reply)``; raises to refuse it."""


def is_retryable(error: BaseException) -> bool:
    """Whether a failed call may be sent again unchanged (same checkpoint id, same ids).

    Transport failures (the request may not have arrived, or its reply was lost) and error codes
    marked retryable are; every other refusal is final.
    """
    if isinstance(error, httpx.TransportError):
        return True
    return isinstance(error, WireError) and error.retryable


def _default_wait() -> wait_base:
    return wait_exponential(multiplier=0.2, max=2.0)


@dataclass(frozen=True)
class RetryPolicy:
    """How a call is retried: the tenacity strategies, as data.

    Attributes:
        attempts: How many times a retryable failure is tried in all.
        wait: The pause between attempts (a tenacity wait strategy).

    Raises:
        ValueError: Fewer than one attempt.
    """

    attempts: int = DEFAULT_CONTROL_ATTEMPTS
    wait: wait_base = field(default_factory=_default_wait)

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("attempts must be at least 1")

    @classmethod
    def of(cls, attempts: int, wait: wait_base | None) -> RetryPolicy:
        """The policy of a client's ``attempts`` and ``wait`` arguments (the default wait if none)."""
        return cls(attempts) if wait is None else cls(attempts, wait)

    def retrying(self, *, deadline_ts: float | None = None) -> AsyncRetrying:
        """The tenacity loop of one call.

        Args:
            deadline_ts: When given, no attempt starts at or after this wall-clock time (the
                server would refuse the deadline anyway).
        """
        stop: stop_base = stop_after_attempt(self.attempts)
        if deadline_ts is not None:
            stop = stop | _PastDeadline(deadline_ts)
        return AsyncRetrying(
            retry=retry_if_exception(is_retryable), stop=stop, wait=self.wait, reraise=True
        )


class _PastDeadline(stop_base):
    """Stops retrying once the wall clock reaches ``deadline_ts``."""

    def __init__(self, deadline_ts: float) -> None:
        self._deadline_ts = deadline_ts

    def __call__(self, retry_state: Any) -> bool:
        return time.time() >= self._deadline_ts


class RetryingCaller:
    """Sends JSON requests to one server under deadlines, typed errors and the retry policy.

    Args:
        url: The server's root URL (named in timeout messages).
        prefix: The route prefix every path is relative to.
        token: The bearer token sent with every request.
        name: What these calls are, for messages (``control``, ``ledger control``).
        policy: How calls are retried.
        transport: An httpx transport (tests pass ``httpx.ASGITransport``).
        limits: The connection pool's limits (``pool_limits()`` when ``None``).
        check_reply: Looks at every reply before its envelope is read and may raise.
    """

    def __init__(
        self,
        url: str,
        *,
        prefix: str,
        token: str,
        name: str,
        policy: RetryPolicy,
        transport: httpx.AsyncBaseTransport | None = None,
        limits: httpx.Limits | None = None,
        check_reply: ReplyCheck | None = None,
    ) -> None:
        self.url = url
        self.name = name
        self.policy = policy
        self._check_reply = check_reply
        self._http = HttpClient(
            base_url=url + prefix,
            headers={"authorization": f"Bearer {token}"},
            # A transport of the caller's (a test's ASGI app) is used as given (D381).
            transport=transport or http_transport(pool_limits() if limits is None else limits),
        )

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    async def send_once(self, method: str, path: str, body: Any, budget: float) -> Any:
        """One attempt, bounded by ``budget`` seconds; the JSON payload of a 200 reply.

        Raises:
            TimeoutError: No reply within the budget (naming the request).
            httpx.TransportError: The request or its reply was lost (httpx's own timeout
                included, as a ``ReadTimeout`` naming the request).
            WireError: The server refused, typed by its code.
        """
        try:
            with anyio.fail_after(budget):
                headers: dict[str, str] = {}
                inject_headers(headers)  # the participant's span continues this trace
                if isinstance(body, bytes):  # encoded already (``encode_wire``)
                    headers["content-type"] = "application/json"
                    sent: dict[str, Any] = {"content": body}
                else:
                    sent = {"json": body}
                reply = await self._http.request(
                    method, path, timeout=budget, headers=headers, **sent
                )
        except TimeoutError:
            raise TimeoutError(
                f"{self.name} {method} {path} to {self.url} got no reply within {budget:.2f} s"
            ) from None
        except httpx.TimeoutException as exc:
            # httpx's own timeout: treat like a lost reply (retryable transport failure).
            raise httpx.ReadTimeout(
                f"{self.name} {method} {path} to {self.url} timed out: {exc}", request=exc.request
            ) from exc
        if self._check_reply is not None:
            self._check_reply(path, reply)
        try:
            payload = reply.json()
        except ValueError:
            payload = reply.text
        if reply.status_code != 200:
            raise error_from_envelope(reply.status_code, payload)
        return payload

    async def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        budget: Callable[[], float],
        deadline_ts: float | None = None,
    ) -> Any:
        """Send until a 200 reply or a final failure, per the policy; its JSON payload.

        Args:
            method: The HTTP method.
            path: The route, relative to the prefix.
            body: The JSON body (``None`` for none), or its encoded bytes; the same body goes
                out on every attempt.
            budget: Seconds each attempt may take, asked afresh before each one.
            deadline_ts: No attempt starts at or after this wall-clock time.

        Raises:
            The last attempt's failure (see ``send_once``).
        """
        payload: Any = None
        async for attempt in self.policy.retrying(deadline_ts=deadline_ts):
            with attempt:
                payload = await self.send_once(method, path, body, budget())
        return payload
