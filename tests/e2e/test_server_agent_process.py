"""The real agent process: a checkpoint mid-activation, SIGKILL, restore into a fresh process."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import uvicorn

from e2e._launch.sockets import bind_listening_socket
from e2e._launch.spawn import ServerProcess
from e2e._servers.cluster import Cluster, ServerEntry, write_cluster
from tests.e2e.agent_fakes import AUTH, ROLLOUT, TOKEN, FakePeers, control, expected_episode

pytestmark = [pytest.mark.process, pytest.mark.anyio]
TASK = {"activations": 2, "turns": 2, "max_tokens": 8, "seed": 1}


def agent_process(cluster: Path, log: Path) -> ServerProcess:
    argv = [sys.executable, "-m", "e2e", "serve", "agent", "--port", "0", "--cluster", str(cluster)]
    return ServerProcess(argv, env={"MIDFLIGHT_CONTROL_TOKEN": TOKEN}, log_path=log)


async def ctl(client: httpx.AsyncClient, op: str, **body: Any) -> dict[str, Any]:
    reply = await client.post(f"/ng-control/v1/checkpoint/{op}", json=control(**body), headers=AUTH)
    assert reply.status_code == 200, reply.text
    result: dict[str, Any] = reply.json()
    return result


async def test_a_killed_agent_continues_from_its_checkpoint_in_a_fresh_process(
    tmp_path: Path,
) -> None:
    peers = FakePeers()
    peers.new_session()
    peers.model_gates[3] = anyio.Event()  # activation 2's first model call is pending at the cut
    expected = expected_episode(ROLLOUT, TASK)
    sock = bind_listening_socket(0)
    fake_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    fake = uvicorn.Server(
        uvicorn.Config(
            peers.app(), log_level="warning", lifespan="off", timeout_graceful_shutdown=5
        )
    )
    cluster = tmp_path / "cluster.toml"
    servers = (
        ServerEntry("policy", "model", fake_url),
        ServerEntry("resources", "resources", fake_url),
    )
    write_cluster(cluster, Cluster(root=tmp_path, servers=servers))
    directory = str(tmp_path / "ckpt")
    scope = [{"rollout_id": ROLLOUT, "attempt": 0}]
    async with anyio.create_task_group() as group:
        group.start_soon(fake.serve, [sock])
        with agent_process(cluster, tmp_path / "agent.log") as server:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                body = {"resources_session_id": "s1", "task_input": TASK}
                await client.post(f"/ng-rollout/{ROLLOUT}/sessions/seed", json=body)
                one = await client.post(
                    f"/ng-rollout/{ROLLOUT}/sessions/activate",
                    headers={"x-ng-agent-activation": "1"},
                )
                assert one.json()["messages"] == expected[0], one.text

                async def doomed() -> None:
                    with contextlib.suppress(httpx.TransportError):  # the process dies under it
                        await client.post(
                            f"/ng-rollout/{ROLLOUT}/sessions/activate",
                            headers={"x-ng-agent-activation": "2"},
                        )

                group.start_soon(doomed)
                with anyio.fail_after(20):
                    while len(peers.model_calls) < 3:  # noqa: ASYNC110 - a peer in this process
                        await anyio.sleep(0.01)
                assert (await ctl(client, "prepare", checkpoint_id="c1"))["phase"] == "prepared"
                await ctl(
                    client,
                    "commit",
                    checkpoint_id="c1",
                    checkpoint_dir=directory,
                    episode_ids=scope,
                )
                server.kill()
                peers.model_gates[3].set()  # let the fake answer into the void, so it can stop
        with agent_process(cluster, tmp_path / "agent.log") as server:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                restored = await ctl(
                    client,
                    "restore",
                    checkpoint_id="c2",
                    checkpoint_dir=directory,
                    episode_ids=scope,
                )
                assert restored["restored"] == [f"{ROLLOUT}-a1"]
                await ctl(client, "resume", checkpoint_id="c2")
                two = await client.post(
                    f"/ng-rollout/{ROLLOUT}-a1/sessions/activate",
                    headers={"x-ng-agent-activation": "2"},
                )
                late = await client.post(
                    f"/ng-rollout/{ROLLOUT}/sessions/activate",
                    headers={"x-ng-agent-activation": "2"},
                )
        fake.should_exit = True
    assert two.status_code == 200, two.text
    assert two.json()["messages"] == expected[1]
    assert late.json()["error"]["code"] == "stale_attempt"
    assert peers.model_calls[3] == (f"{ROLLOUT}-a1", peers.model_calls[2][1])
    assert len(peers.model_calls) == 5 and len(peers.tool_calls) == 4
