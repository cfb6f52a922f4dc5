"""The control client: bounded calls, typed errors, retries only where the table allows."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from tenacity import wait_none

from coordinator import ControlClient, NotAParticipantError
from protocols import (
    COORDINATION_REPLY_SLACK_SECONDS,
    DeadlineExceededError,
    StaleCheckpointError,
)

pytestmark = pytest.mark.anyio
STATUS = {
    "kind": "model",
    "instance": "policy",
    "phase": "idle",
    "checkpoint_id": None,
    "lease_expires_at": None,
    "retired_rollouts": 0,
    "report": {"ready": True},
}


def scripted(*answers: object) -> tuple[httpx.MockTransport, list[httpx.Request]]:
    """A transport answering in turn: an exception to raise, or (status, body)."""
    seen: list[httpx.Request] = []
    queue = list(answers)

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        answer = queue.pop(0)
        if isinstance(answer, Exception):
            raise answer
        status, body = answer  # type: ignore[misc]
        return httpx.Response(status, json=body)

    return httpx.MockTransport(handle), seen


def envelope(code: str) -> dict[str, object]:
    return {"error": {"code": code, "detail": code}}


PREPARED = (200, {"phase": "prepared", "report": {"ready": True}})


async def test_transport_failures_and_retryable_codes_are_retried_with_the_same_id() -> None:
    transport, seen = scripted(
        httpx.ConnectError("refused"), (409, envelope("deadline_exceeded")), PREPARED
    )
    async with ControlClient("http://p", token="t", transport=transport, wait=wait_none()) as c:
        reply = await c.prepare("c1", time.time() + 30)
    assert reply.phase == "prepared"
    assert [json.loads(r.content)["checkpoint_id"] for r in seen] == ["c1", "c1", "c1"]
    assert all(r.headers["authorization"] == "Bearer t" for r in seen)


async def test_final_refusals_are_not_retried_and_come_back_typed() -> None:
    transport, seen = scripted((409, envelope("stale_checkpoint")), PREPARED)
    async with ControlClient("http://p", token="t", transport=transport, wait=wait_none()) as c:
        with pytest.raises(StaleCheckpointError):
            await c.prepare("c1", time.time() + 30)
    assert len(seen) == 1


async def test_retries_stop_at_the_attempt_limit() -> None:
    transport, seen = scripted(*[(409, envelope("deadline_exceeded"))] * 5)
    client = ControlClient("http://p", token="t", transport=transport, wait=wait_none(), attempts=3)
    async with client:
        with pytest.raises(DeadlineExceededError):
            await client.resume("c1", time.time() + 30)
    assert len(seen) == 3


async def test_every_post_is_bounded_by_the_time_left_plus_the_slack() -> None:
    transport, seen = scripted(PREPARED)
    deadline = time.time() + 40
    async with ControlClient("http://p", token="t", transport=transport) as client:
        await client.prepare("c1", deadline)
    budget = seen[0].extensions["timeout"]["read"]
    assert 40 < budget <= 40 + COORDINATION_REPLY_SLACK_SECONDS
    assert budget > 40 + COORDINATION_REPLY_SLACK_SECONDS - 2  # not some unrelated default


async def test_status_404_means_not_a_participant() -> None:
    transport, _ = scripted((404, {"detail": "Not Found"}), (200, STATUS))
    async with ControlClient("http://p", token="t", transport=transport) as client:
        with pytest.raises(NotAParticipantError):
            await client.status()
        assert (await client.status()).instance == "policy"


def test_a_control_client_needs_a_token() -> None:
    with pytest.raises(ValueError, match="token"):
        ControlClient("http://p", token="")


async def test_a_request_goes_out_as_json_bytes_with_a_json_content_type() -> None:
    # D357: the body is the bytes pydantic-core writes; a server that reads the content type
    # (not only FastAPI, which parses a body without one) must still see JSON.
    transport, seen = scripted(PREPARED)
    deadline = time.time() + 30
    async with ControlClient("http://p", token="t", transport=transport, wait=wait_none()) as c:
        await c.prepare("c1", deadline)
    (request,) = seen
    assert request.headers["content-type"] == "application/json"
    assert json.loads(request.content) == {"checkpoint_id": "c1", "deadline_ts": deadline}
