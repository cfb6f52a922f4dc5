"""The real environment process: a checkpoint mid-activation, SIGKILL, restore, continue as N+1."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import uvicorn

from e2e._launch.sockets import bind_listening_socket
from e2e._servers.cluster import Cluster, ServerEntry, write_cluster
from protocols import CONTROL_PREFIX

from .environment_peers import PeerLog, fake_peers_app
from .processes import serve

pytestmark = [pytest.mark.process, pytest.mark.anyio]
TOKEN = "environment-process-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@asynccontextmanager
async def peers_listening(log: PeerLog) -> AsyncIterator[str]:
    """The fake agent + resources app on a real 127.0.0.1 port, in this event loop."""
    sock = bind_listening_socket(0)
    server = uvicorn.Server(
        uvicorn.Config(fake_peers_app(log), log_level="warning", lifespan="off")
    )
    async with anyio.create_task_group() as group:
        # The socket already listens: clients may connect before uvicorn accepts.
        group.start_soon(server.serve, [sock])
        try:
            yield f"http://127.0.0.1:{sock.getsockname()[1]}"
        finally:
            log.release.set()
            server.should_exit = True


def body(attempt: int) -> dict[str, Any]:
    return {
        "episode_id": {"rollout_id": "r1", "attempt": attempt},
        "task": {
            "task_id": {"taskset": "counter", "task_id": "r1"},
            "task_input": {"activations": 2, "turns": 2, "max_tokens": 32, "seed": 0},
        },
    }


async def control(client: httpx.AsyncClient, route: str, **payload: Any) -> dict[str, Any]:
    payload.setdefault("deadline_ts", time.time() + 30)
    reply = await client.post(f"{CONTROL_PREFIX}/{route}", json=payload, headers=AUTH)
    assert reply.status_code == 200, reply.text
    result: dict[str, Any] = reply.json()
    return result


async def test_a_checkpointed_episode_survives_sigkill_and_continues_as_the_next_attempt(
    tmp_path: Path,
) -> None:
    log = PeerLog(verify_mode="wait", hold_activation=2)
    env = {"MIDFLIGHT_CONTROL_TOKEN": TOKEN}
    async with peers_listening(log) as peers_url:
        cluster = tmp_path / "cluster.toml"
        write_cluster(
            cluster,
            Cluster(
                root=tmp_path,
                servers=(
                    ServerEntry("agent", "agent", peers_url),
                    ServerEntry("resources", "resources", peers_url),
                ),
            ),
        )
        args = ("--cluster", str(cluster))
        with serve("environment", *args, log=tmp_path / "env-1.log", env=env) as (url, _):
            async with (
                httpx.AsyncClient(base_url=url, timeout=30) as client,
                anyio.create_task_group() as group,
            ):

                async def doomed_run() -> None:
                    with pytest.raises(httpx.TransportError):
                        await client.post("/run", json=body(0))

                group.start_soon(doomed_run)
                with anyio.fail_after(20):
                    await log.held.wait()
                prepared = await control(client, "prepare", checkpoint_id="c1")
                assert prepared["phase"] == "prepared"
                committed = await control(
                    client,
                    "commit",
                    checkpoint_id="c1",
                    checkpoint_dir=str(tmp_path / "c1"),
                    episode_ids=[{"rollout_id": "r1"}],
                )
                assert committed["episode_ids"] == ["r1"]
                group.cancel_scope.cancel()
        # The first process group is SIGKILLed; a fresh one restores the checkpoint.
        log.hold_activation = None
        with serve("environment", *args, log=tmp_path / "env-2.log", env=env) as (url, _):
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                restored = await control(
                    client,
                    "restore",
                    checkpoint_id="r-1",
                    checkpoint_dir=str(tmp_path / "c1"),
                    episode_ids=[{"rollout_id": "r1"}],
                )
                assert restored["restored"] == ["r1-a1"]
                early = await client.post("/run", json=body(1))
                assert early.json()["error"]["code"] == "admission_closed"
                await control(client, "resume", checkpoint_id="r-1")
                stale = await client.post("/run", json=body(0))
                assert stale.json()["error"]["code"] == "stale_attempt"
                reply = await client.post("/run", json=body(1))
    assert reply.json()["result"] == {"reward": 0.37, "model_calls": 4, "tool_calls": 4}
    continued = [(r["route"], r["activation"]) for r in log.requests if r["key"] == "r1-a1"]
    assert continued == [
        ("sessions/activate", "2"),
        ("verify", None),
        ("sessions/close", None),
    ]
    assert log.seen("verify")[0]["cookie"] == "ng_session=sess-r1"
