"""The control client against real control planes: lost replies, retries, the reserved pool."""

from __future__ import annotations

import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from coordinator import ControlClient, checkpoint, checkpoint_directory, verify_checkpoint
from participants import ControlPlane, participant_app
from protocols import EpisodeId, Phase

from .deployment import TOKEN, Logged, deployment

pytestmark = pytest.mark.anyio
R1 = EpisodeId(rollout_id="r1")


async def test_a_retried_checkpoint_with_lost_replies_is_idempotent_end_to_end(
    tmp_path: Path,
) -> None:
    async with deployment() as d:
        for fake in d.fakes.values():
            fake.episodes = [R1]
        lost: set[tuple[str, str]] = set()
        real = d.router.handle_async_request

        async def lose_first_reply(request: httpx.Request) -> httpx.Response:
            # The participant does the work, then the reply is lost on the way back, once per
            # (server, route): the client must send the same request again.
            reply = await real(request)
            key = (request.url.host, request.url.path)
            if request.method == "POST" and key not in lost:
                lost.add(key)
                await reply.aread()
                raise httpx.ReadError("reply lost", request=request)
            return reply

        d.router.handle_async_request = lose_first_reply  # type: ignore[method-assign]
        outcome = await checkpoint(d.coordinator, tmp_path, "c1", deadline_seconds=30)
        assert outcome.published
        routes = {path.rsplit("/", 1)[1] for _, path in lost}
        assert routes == {"prepare", "commit", "resume"}
        posts = [r for r in d.router.requests if r.method == "POST"]
        assert len(posts) == 2 * 3 * len(d.fakes)  # every call twice, all with the same id
        assert {r.content.count(b'"c1"') for r in posts} == {1}
        for name, plane in d.planes.items():
            assert plane.phase is Phase.IDLE, name
            assert d.ops("close").count(name) == 1  # the second prepare found it prepared
    directory = checkpoint_directory(tmp_path, "c1")
    assert verify_checkpoint(directory) == []
    assert len(list(directory.glob("gym/*/*/records-*.jsonl"))) == len(d.fakes)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@asynccontextmanager
async def _serve(app: FastAPI) -> AsyncIterator[str]:
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    async with anyio.create_task_group() as group:
        group.start_soon(server.serve)
        with anyio.fail_after(10):
            while not server.started:  # noqa: ASYNC110 - uvicorn offers no started event
                await anyio.sleep(0.02)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True


async def test_a_control_call_is_served_while_data_calls_saturate_their_pool() -> None:
    log: list[tuple[str, str, str]] = []
    plane = ControlPlane(Logged("model", "policy", log))
    app = participant_app(plane, token=TOKEN)
    release = anyio.Event()
    saturated = anyio.Event()
    entered = 0

    @app.post("/v1/slow")
    async def slow() -> dict[str, bool]:
        nonlocal entered
        entered += 1
        if entered == 2:
            saturated.set()
        await release.wait()
        return {"ok": True}

    async with plane.running(), _serve(app) as url:
        data = httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=2))
        control = ControlClient(url, token=TOKEN, attempts=1)
        async with data, control, anyio.create_task_group() as group:
            for _ in range(6):  # three times what the data pool holds
                group.start_soon(data.post, "/v1/slow")
            with anyio.fail_after(10):
                await saturated.wait()
            # Every data connection is held; the control call has its own pool and goes through.
            reply = await control.prepare("c1", time.time() + 5)
            assert reply.phase == Phase.PREPARED
            assert not release.is_set() and entered == 2  # the data pool was still full
            await control.resume("c1", time.time() + 5)
            release.set()
