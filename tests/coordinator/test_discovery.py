"""Discovery: status of each URL; 404 is not a participant; no model is an error."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from tenacity import wait_none

from coordinator import CoordinationError, discover
from protocols import UnauthorizedError

from .deployment import TOKEN, deployment

pytestmark = pytest.mark.anyio


async def test_discovery_finds_participants_sorted_and_skips_plain_servers() -> None:
    async with deployment() as d:
        d.router.add("plain", FastAPI())  # no control routes: 404
        urls = ["http://plain", *(f"http://{name}" for name in d.fakes)]
        members = await discover(urls, token=TOKEN, transport=d.router, wait=wait_none())
        try:
            assert [(m.kind, m.instance) for m in members] == [
                ("environment", "environment"),
                ("model", "policy"),
                ("agent", "agent"),
                ("resources", "resources"),
                ("resources", "resources2"),
            ]
        finally:
            for member in members:
                await member.client.aclose()


async def test_discovery_fails_without_a_model_or_on_any_other_failure() -> None:
    async with deployment((("environment", "environment"), ("agent", "agent"))) as d:
        with pytest.raises(CoordinationError) as caught:
            await discover(["http://environment"], token=TOKEN, transport=d.router)
        assert "deployment" in caught.value.failures
    async with deployment() as d:
        with pytest.raises(CoordinationError) as caught:
            await discover(["http://policy", "http://agent"], token="wrong", transport=d.router)
        assert isinstance(caught.value.causes["http://agent"], UnauthorizedError)
        d.router.down.add("agent")
        d.router.requests.clear()
        with pytest.raises(CoordinationError) as caught:
            await discover(
                ["http://policy", "http://agent"], token=TOKEN, transport=d.router, wait=wait_none()
            )
        assert set(caught.value.failures) == {"http://agent"}
        assert sum(r.url.host == "agent" for r in d.router.requests) == 3  # three tries
