"""The retrying boundary both coordinator clients share: the policy as data, the deadline stop."""

from __future__ import annotations

import time

import httpx
import pytest
from tenacity import wait_none

from coordinator import ControlClient, LedgerClient
from coordinator._retry import is_retryable
from protocols import CheckpointOpenError, DeadlineExceededError, StaleCheckpointError

pytestmark = pytest.mark.anyio


def always(status: int, code: str) -> tuple[httpx.MockTransport, list[httpx.Request]]:
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(status, json={"error": {"code": code, "detail": code}})

    return httpx.MockTransport(handle), seen


async def test_no_attempt_starts_once_the_deadline_has_passed() -> None:
    transport, seen = always(409, "deadline_exceeded")
    client = ControlClient("http://p", token="t", transport=transport, wait=wait_none(), attempts=5)
    async with client:
        with pytest.raises(DeadlineExceededError):
            await client.resume("c1", time.time() - 1)
    assert len(seen) == 1


async def test_both_clients_retry_by_the_same_table() -> None:
    transport, seen = always(409, "checkpoint_open")
    async with LedgerClient(
        "http://m", capture_token="t", transport=transport, wait=wait_none(), attempts=2
    ) as ledger:
        with pytest.raises(CheckpointOpenError):
            await ledger.delete(["a"])
    assert len(seen) == 2
    assert is_retryable(CheckpointOpenError()) and is_retryable(httpx.ConnectError("down"))
    assert not is_retryable(StaleCheckpointError()) and not is_retryable(TimeoutError())


def test_a_client_needs_at_least_one_attempt() -> None:
    with pytest.raises(ValueError, match="attempts"):
        ControlClient("http://p", token="t", attempts=0)
    with pytest.raises(ValueError, match="attempts"):
        LedgerClient("http://m", capture_token="t", attempts=0)
