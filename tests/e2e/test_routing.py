"""A shard's routing wrapper: a request owned by another slot that cannot be reached is refused
typed and retryable, never a bare 500."""

from __future__ import annotations

import socket
from typing import Any

import httpx
import pytest

from e2e._launch.routing import ShardRouting
from participants import slot_of

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port  # nothing listens there once the probe is closed


async def test_an_unreachable_owner_slot_is_a_typed_503(tmp_path: Any) -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("the request belongs to the other slot")

    dead = f"http://127.0.0.1:{_closed_port()}"
    rollout = next(f"r{i}" for i in range(100) if slot_of(f"r{i}", 2) == 1)
    routing = ShardRouting(app, shard=None, slot=0, peers=["http://unused", dead], token=None)  # type: ignore[arg-type]
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=routing), base_url="http://shard"
    ) as client:
        reply = await client.post(f"/ng-rollout/{rollout}-a0/call", json={})
    assert reply.status_code == 503, reply.text
    error = reply.json()["error"]
    assert error["code"] == "checkpoint_coordinator_unavailable"
    assert "did not answer the routed request" in error["detail"]
