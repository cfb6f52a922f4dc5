"""``HttpClient`` (D414): a reply, read whole or streamed and closed, is freed by reference
counting; nothing of a call is left for the cyclic garbage collector. A real uvicorn server
on 127.0.0.1 and the project's own transport."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from coordinator import HttpClient, http_transport

pytestmark = pytest.mark.anyio
CALLS = 20


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _app() -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(body: dict[str, int]) -> dict[str, int]:
        return {"keys": len(body)}

    return app


@asynccontextmanager
async def _server() -> AsyncIterator[str]:
    config = uvicorn.Config(_app(), host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(30):  # bounds the start-up; asserts nothing about speed
            while not server.started:  # noqa: ASYNC110 - uvicorn announces its start no other way
                await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        await task


async def _left_in_cycles(call: Callable[[], Awaitable[None]]) -> int:
    """How many objects ``CALLS`` calls leave that only the cyclic collector can free."""
    await call()  # the connection and everything made once, outside the count
    gc.collect()
    gc.disable()
    try:
        for _ in range(CALLS):
            await call()
        return gc.collect()
    finally:
        gc.enable()


@pytest.mark.parametrize("kind", [httpx.AsyncClient, HttpClient])
async def test_a_reply_read_whole_leaves_nothing_for_the_collector_only_with_http_client(
    kind: type[httpx.AsyncClient],
) -> None:
    async with (
        _server() as url,
        kind(base_url=url, transport=http_transport(httpx.Limits())) as client,
    ):

        async def call() -> None:
            reply = await client.post("/echo", json={"a": 1})
            assert reply.json() == {"keys": 1}

        left = await _left_in_cycles(call)
    if kind is HttpClient:
        assert left == 0
    else:  # the cycle HttpClient cuts: without it each call leaves dozens of objects
        assert left >= CALLS * 10


async def test_a_streamed_reply_is_freed_once_it_is_closed() -> None:
    async with (
        _server() as url,
        HttpClient(base_url=url, transport=http_transport(httpx.Limits())) as client,
    ):

        async def call() -> None:
            async with client.stream("POST", "/echo", json={"a": 1, "b": 2}) as reply:
                body = b"".join([chunk async for chunk in reply.aiter_raw()])
            assert body == b'{"keys":2}'

        assert await _left_in_cycles(call) == 0


async def test_a_reply_cut_loose_still_reads_and_closes_as_before() -> None:
    async with (
        _server() as url,
        HttpClient(base_url=url, transport=http_transport(httpx.Limits())) as client,
    ):
        reply = await client.post("/echo", json={"a": 1})
        assert await reply.aread() == b'{"keys":1}'
        assert [chunk async for chunk in reply.aiter_bytes()] == [b'{"keys":1}']
        await reply.aclose()  # a second close is a no-op, as on any closed reply
        assert reply.is_closed and reply.elapsed.total_seconds() >= 0
        async with client.stream("POST", "/echo", json={}) as streamed:
            assert await streamed.aread() == b'{"keys":0}'
        assert streamed.is_closed
