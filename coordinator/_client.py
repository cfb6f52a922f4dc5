"""The async control client of one participant: ``/ng-control/v1/checkpoint/*`` over HTTP.

Each client owns its own connection pool, used for nothing but control calls, so data-plane
traffic that fills a host's connection limit can never starve a prepare or a resume. Every POST is
bounded by the time left until its ``deadline_ts`` plus ``COORDINATION_REPLY_SLACK_SECONDS`` (the
participant bounds its own work by the deadline; the slack lets its reply travel back). A non-200
reply becomes the typed exception of its code. Retries apply at this one boundary, with the same
checkpoint id, and only to transport failures and codes the error table marks retryable.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeVar

import anyio
import httpx
from pydantic import BaseModel
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
)
from tenacity.stop import stop_base
from tenacity.wait import wait_base

from protocols import (
    CONTROL_PREFIX,
    COORDINATION_REPLY_SLACK_SECONDS,
    CheckpointRequest,
    CommitReply,
    CommitRequest,
    EpisodeId,
    ForgetReply,
    ForgetRequest,
    MidflightError,
    PrepareReply,
    RenewReply,
    RestoreReply,
    RestoreRequest,
    ResumeReply,
    RetireReply,
    RetireRequest,
    StatusReply,
    WireError,
    dump_wire,
    error_from_envelope,
)

DEFAULT_CONTROL_ATTEMPTS: Final = 3
STATUS_TIMEOUT_SECONDS: Final = 60.0
"""Cap of one status probe (discovery), as in the reference."""

R = TypeVar("R", bound=BaseModel)


class NotAParticipantError(MidflightError):
    """The server answered 404 on the status route: it has no control routes."""


def is_retryable(error: BaseException) -> bool:
    """Whether a failed control call may be sent again with the same checkpoint id.

    Transport failures (the request may not have arrived, or its reply was lost) and error codes
    marked retryable are; every other refusal is final.
    """
    if isinstance(error, httpx.TransportError):
        return True
    return isinstance(error, WireError) and error.retryable


class ControlClient:
    """Calls the control routes of one participant.

    Args:
        url: The participant's root URL; a trailing ``/`` is ignored.
        token: The control bearer token.
        transport: An httpx transport (tests pass ``httpx.ASGITransport``).
        attempts: How many times a retryable failure is tried in all.
        wait: The pause between attempts (a tenacity wait strategy).
        max_connections: Size of this client's reserved control pool.

    Raises:
        ValueError: Empty token or fewer than one attempt.
    """

    def __init__(
        self,
        url: str,
        *,
        token: str,
        transport: httpx.AsyncBaseTransport | None = None,
        attempts: int = DEFAULT_CONTROL_ATTEMPTS,
        wait: wait_base | None = None,
        max_connections: int = 4,
    ) -> None:
        if not token:
            raise ValueError("the control client needs a non-empty control token")
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        self.url = url.rstrip("/")
        self.attempts = attempts
        self._wait: wait_base = wait or wait_exponential(multiplier=0.2, max=2.0)
        # A pool of our own: data clients elsewhere in the controller never share it.
        self._http = httpx.AsyncClient(
            base_url=self.url + CONTROL_PREFIX,
            headers={"authorization": f"Bearer {token}"},
            transport=transport,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=2),
        )

    async def __aenter__(self) -> ControlClient:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the reserved connection pool."""
        await self._http.aclose()

    # ------------------------------------------------------------------ transport

    async def _send_once(self, method: str, route: str, body: Any, budget: float) -> Any:
        try:
            with anyio.fail_after(budget):
                reply = await self._http.request(method, f"/{route}", json=body, timeout=budget)
        except TimeoutError:
            raise TimeoutError(
                f"control {route} to {self.url} got no reply within {budget:.1f} s"
            ) from None
        except httpx.TimeoutException as exc:
            # httpx's own timeout: treat like a lost reply (retryable transport failure).
            raise httpx.ReadTimeout(
                f"control {route} to {self.url} timed out: {exc}", request=exc.request
            ) from exc
        if reply.status_code == 404 and route == "status":
            raise NotAParticipantError(f"{self.url} has no control routes (HTTP 404)")
        try:
            payload = reply.json()
        except ValueError:
            payload = reply.text
        if reply.status_code != 200:
            raise error_from_envelope(reply.status_code, payload)
        return payload

    async def _call(
        self,
        method: str,
        route: str,
        body: BaseModel | None,
        reply_model: type[R],
        *,
        budget: Callable[[], float],
        stop: stop_base | None = None,
    ) -> R:
        wire = None if body is None else dump_wire(body)
        retrying = AsyncRetrying(
            retry=retry_if_exception(is_retryable),
            stop=stop or stop_after_attempt(self.attempts),
            wait=self._wait,
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                payload = await self._send_once(method, route, wire, budget())
        return reply_model.model_validate(payload)

    def _post(self, route: str, body: CheckpointRequest, reply_model: type[R]) -> Any:
        deadline = body.deadline_ts

        def budget() -> float:
            return max(0.0, deadline - time.time()) + COORDINATION_REPLY_SLACK_SECONDS

        def past_deadline(_state: Any) -> bool:
            # No point retrying once the participant would refuse the deadline anyway.
            return time.time() >= deadline

        stop = stop_after_attempt(self.attempts) | _Stop(past_deadline)
        return self._call("POST", route, body, reply_model, budget=budget, stop=stop)

    # ------------------------------------------------------------------ operations

    async def status(self, *, probe_seconds: float = STATUS_TIMEOUT_SECONDS) -> StatusReply:
        """``GET status`` (also discovery).

        Raises:
            NotAParticipantError: The server has no control routes (404).
            WireError: Any other refusal, typed by its code.
        """
        return await self._call("GET", "status", None, StatusReply, budget=lambda: probe_seconds)

    async def prepare(self, checkpoint_id: str, deadline_ts: float) -> PrepareReply:
        """Close admission and wait (until the deadline) for a safe cut."""
        request = CheckpointRequest(checkpoint_id=checkpoint_id, deadline_ts=deadline_ts)
        reply: PrepareReply = await self._post("prepare", request, PrepareReply)
        return reply

    async def renew(self, checkpoint_id: str, deadline_ts: float) -> RenewReply:
        """Extend the lease of the open checkpoint."""
        request = CheckpointRequest(checkpoint_id=checkpoint_id, deadline_ts=deadline_ts)
        reply: RenewReply = await self._post("renew", request, RenewReply)
        return reply

    async def commit(
        self,
        checkpoint_id: str,
        deadline_ts: float,
        checkpoint_dir: str,
        episode_ids: Sequence[EpisodeId] | None,
        *,
        stop: bool = False,
    ) -> CommitReply:
        """Export the scope and write this participant's records and manifest."""
        request = CommitRequest(
            checkpoint_id=checkpoint_id,
            deadline_ts=deadline_ts,
            checkpoint_dir=checkpoint_dir,
            episode_ids=None if episode_ids is None else list(episode_ids),
            stop=stop,
        )
        reply: CommitReply = await self._post("commit", request, CommitReply)
        return reply

    async def restore(
        self,
        checkpoint_id: str,
        deadline_ts: float,
        checkpoint_dir: str,
        episode_ids: Sequence[EpisodeId],
    ) -> RestoreReply:
        """Install the scope of a published checkpoint under the next attempts."""
        request = RestoreRequest(
            checkpoint_id=checkpoint_id,
            deadline_ts=deadline_ts,
            checkpoint_dir=checkpoint_dir,
            episode_ids=list(episode_ids),
        )
        reply: RestoreReply = await self._post("restore", request, RestoreReply)
        return reply

    async def resume(self, checkpoint_id: str, deadline_ts: float) -> ResumeReply:
        """Reopen admission (also aborts an unpublished checkpoint)."""
        request = CheckpointRequest(checkpoint_id=checkpoint_id, deadline_ts=deadline_ts)
        reply: ResumeReply = await self._post("resume", request, ResumeReply)
        return reply

    async def retire(
        self, checkpoint_id: str, deadline_ts: float, episode_ids: Sequence[EpisodeId]
    ) -> RetireReply:
        """Refuse, stop and free these attempts and every earlier one."""
        request = RetireRequest(
            checkpoint_id=checkpoint_id, deadline_ts=deadline_ts, episode_ids=list(episode_ids)
        )
        reply: RetireReply = await self._post("retire", request, RetireReply)
        return reply

    async def forget(
        self, checkpoint_id: str, deadline_ts: float, rollout_ids: Sequence[str]
    ) -> ForgetReply:
        """Remove the retire marks of these rollouts."""
        request = ForgetRequest(
            checkpoint_id=checkpoint_id, deadline_ts=deadline_ts, rollout_ids=list(rollout_ids)
        )
        reply: ForgetReply = await self._post("forget", request, ForgetReply)
        return reply


class _Stop(stop_base):
    """A tenacity stop condition from a predicate on the retry state."""

    def __init__(self, predicate: Callable[[Any], bool]) -> None:
        self._predicate = predicate

    def __call__(self, retry_state: Any) -> bool:
        return self._predicate(retry_state)
