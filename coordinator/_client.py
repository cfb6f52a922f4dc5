"""The async control client of one participant: ``/ng-control/v1/checkpoint/*`` over HTTP.

Each client owns its own connection pool, used for nothing but control calls, so data-plane
traffic that fills a host's connection limit can never starve a prepare or a resume. Every POST is
bounded by the time left until its ``deadline_ts`` plus ``COORDINATION_REPLY_SLACK_SECONDS`` (the
participant bounds its own work by the deadline; the slack lets its reply travel back). A non-200
reply becomes the typed exception of its code. Retries apply at one boundary, the
``RetryingCaller`` of ``_retry.py`` that ``LedgerClient`` shares, with the same checkpoint id, and
only to transport failures and codes the error table marks retryable; no attempt starts after the
call's deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeVar

import httpx
from pydantic import BaseModel
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
    encode_wire,
)

from ._retry import DEFAULT_CONTROL_ATTEMPTS, RetryingCaller, RetryPolicy, pool_limits

STATUS_TIMEOUT_SECONDS: Final = 60.0
"""Cap of one status probe (discovery), as in the reference."""

R = TypeVar("R", bound=BaseModel)


class NotAParticipantError(MidflightError):
    """The server answered 404 on the status route: it has no control routes."""


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
        policy = RetryPolicy.of(attempts, wait)
        self.url = url.rstrip("/")
        self.attempts = attempts
        # A pool of our own: data clients elsewhere in the controller never share it.
        self._caller = RetryingCaller(
            self.url,
            prefix=CONTROL_PREFIX,
            token=token,
            name="control",
            policy=policy,
            transport=transport,
            limits=pool_limits(max_connections, max_keepalive=2),
            check_reply=self._refuse_a_non_participant,
        )

    async def __aenter__(self) -> ControlClient:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the reserved connection pool."""
        await self._caller.aclose()

    # ------------------------------------------------------------------ transport

    def _refuse_a_non_participant(self, path: str, reply: httpx.Response) -> None:
        # A 404 on status is not an envelope: the server has no control routes at all.
        if reply.status_code == 404 and path == "/status":
            raise NotAParticipantError(f"{self.url} has no control routes (HTTP 404)")

    async def _call(
        self,
        method: str,
        route: str,
        body: BaseModel | None,
        reply_model: type[R],
        *,
        budget: Callable[[], float],
        deadline_ts: float | None = None,
        wire: bytes | None = None,
    ) -> R:
        if wire is None and body is not None:
            wire = encode_wire(body)
        payload = await self._caller.call(
            method, f"/{route}", wire, budget=budget, deadline_ts=deadline_ts
        )
        return reply_model.model_validate(payload)

    def _post(
        self,
        route: str,
        body: CheckpointRequest,
        reply_model: type[R],
        wire: bytes | None = None,
    ) -> Any:
        deadline = body.deadline_ts

        def budget() -> float:
            return max(0.0, deadline - time.time()) + COORDINATION_REPLY_SLACK_SECONDS

        # No retry once the deadline has passed: the participant would refuse it anyway.
        return self._call(
            "POST", route, body, reply_model, budget=budget, deadline_ts=deadline, wire=wire
        )

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
        return await self.send_restore(request)

    async def send_restore(
        self, request: RestoreRequest, wire: bytes | None = None
    ) -> RestoreReply:
        """Send a restore request built (and so checked) already.

        A coordinator restores every participant with the same request: it builds, checks and
        encodes it once (D438). ``wire`` is ``encode_wire(request)``, when the caller has it.
        """
        reply: RestoreReply = await self._post("restore", request, RestoreReply, wire)
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
