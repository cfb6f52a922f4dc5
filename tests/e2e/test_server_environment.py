"""The environment server in-process: ``/run`` over HTTP against fake agent and resources peers."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from e2e._servers.cluster import default_cluster
from e2e._servers.context import ServeContext
from e2e._servers.environment import PeerTimeouts, create_environment_app
from participants import ManualClock
from protocols import CONTROL_PREFIX

from .environment_peers import PeerLog, fake_peers_app

pytestmark = pytest.mark.anyio
TOKEN = "environment-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def run_body(key: str = "r1", attempt: int = 0, activations: int = 2) -> dict[str, Any]:
    return {
        "episode_id": {"rollout_id": key, "attempt": attempt},
        "task": {
            "task_id": {"taskset": "counter", "task_id": key},
            "task_input": {"activations": activations, "turns": 2, "max_tokens": 32, "seed": 0},
        },
    }


@asynccontextmanager
async def environment_server(
    tmp_path: Path, log: PeerLog, **options: Any
) -> AsyncIterator[httpx.AsyncClient]:
    ctx = ServeContext(
        name="environment",
        port=0,
        root=tmp_path,
        cluster=default_cluster(tmp_path),
        control_token=TOKEN,
        capture_token=TOKEN,
    )
    peers = httpx.ASGITransport(app=fake_peers_app(log))
    app = create_environment_app(ctx, agent_transport=peers, resources_transport=peers, **options)
    # ASGITransport does not run the lifespan: enter it here.
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://env") as client:
            yield client


async def control(client: httpx.AsyncClient, route: str, **body: Any) -> httpx.Response:
    body.setdefault("deadline_ts", time.time() + 30)
    return await client.post(f"{CONTROL_PREFIX}/{route}", json=body, headers=AUTH)


async def test_run_drives_the_peers_and_returns_the_result(tmp_path: Path) -> None:
    log = PeerLog(verify_mode="wait")
    async with environment_server(tmp_path, log) as client:
        reply = await client.post("/run", json=run_body("r1"))
        other = await client.post("/run", json=run_body("r2", activations=1))
    assert reply.status_code == 200
    assert reply.json() == {
        "episode_id": {"rollout_id": "r1", "attempt": 0},
        "task_id": {"taskset": "counter", "task_id": "r1"},
        "result": {"reward": 0.37, "model_calls": 4, "tool_calls": 4},
    }
    assert other.json()["result"]["model_calls"] == 2
    assert [(r["route"], r["key"]) for r in log.requests[:7]] == [
        ("seed_session", "r1"),
        ("sessions/seed", "r1"),
        ("sessions/activate", "r1"),
        ("sessions/activate", "r1"),
        ("verify", "r1"),
        ("sessions/close", "r1"),
        ("close_session", None),
    ]
    assert [r["activation"] for r in log.seen("sessions/activate")] == ["1", "2", "1"]
    assert '"resources_session_id":"sess-r1"' in log.seen("sessions/seed")[0]["body"]
    # Each episode sends its own session cookie, never another episode's (nor a remembered one).
    assert [r["cookie"] for r in log.seen("seed_session")] == [None, None]
    assert [r["cookie"] for r in log.seen("verify")] == ["ng_session=sess-r1", "ng_session=sess-r2"]
    assert [r["cookie"] for r in log.seen("close_session")] == [
        "ng_session=sess-r1",
        "ng_session=sess-r2",
    ]


async def test_bad_input_is_a_typed_422_and_reaches_no_peer(tmp_path: Path) -> None:
    log = PeerLog()
    async with environment_server(tmp_path, log) as client:
        body = run_body()
        body["task"]["task_input"]["activations"] = -1
        reply = await client.post("/run", json=body)
        bad_id = await client.post(
            "/run", json={**run_body(), "episode_id": {"rollout_id": "x-a1"}}
        )
    assert reply.status_code == 422
    assert reply.json()["error"]["code"] == "invalid_request"
    assert bad_id.status_code in (400, 422)
    assert log.requests == []


async def test_run_refusals_carry_their_codes(tmp_path: Path) -> None:
    log = PeerLog()
    async with environment_server(tmp_path, log) as client:
        assert (await control(client, "prepare", checkpoint_id="c1")).json()["phase"] == "prepared"
        closed = await client.post("/run", json=run_body("r1"))
        await control(client, "resume", checkpoint_id="c1")
        retire = await control(
            client, "retire", checkpoint_id="retire", episode_ids=[{"rollout_id": "r1"}]
        )
        stale = await client.post("/run", json=run_body("r1"))
    assert (closed.status_code, closed.json()["error"]["code"]) == (409, "admission_closed")
    assert retire.status_code == 200
    assert (stale.status_code, stale.json()["error"]["code"]) == (409, "stale_attempt")
    assert log.requests == []


async def test_a_peer_refusal_ends_the_episode_with_a_failure(tmp_path: Path) -> None:
    log = PeerLog(refuse_activation=(2, "activation_out_of_order"))
    async with environment_server(tmp_path, log) as client:
        reply = await client.post("/run", json=run_body("r1"))
    assert reply.status_code == 200
    body = reply.json()
    assert "result" not in body
    assert body["failure"]["code"] == "activation_out_of_order"
    assert log.seen("verify") == []


async def test_a_task_input_takes_the_contract_defaults(tmp_path: Path) -> None:
    log = PeerLog()
    async with environment_server(tmp_path, log) as client:
        body = run_body("r1")
        body["task"]["task_input"] = {}
        reply = await client.post("/run", json=body)
    assert reply.json()["result"]["model_calls"] == 4  # A = 2, T = 2
    assert '"max_tokens":32' in log.seen("seed_session")[0]["body"]


async def test_run_gives_up_on_an_episode_past_its_budget(tmp_path: Path) -> None:
    log = PeerLog(hold_activation=2)
    clock = ManualClock()
    async with environment_server(tmp_path, log, episode_seconds=60.0, clock=clock) as client:
        replies: list[httpx.Response] = []

        async def run() -> None:
            replies.append(await client.post("/run", json=run_body("r1")))

        async with anyio.create_task_group() as group:
            group.start_soon(run)
            with anyio.fail_after(10):
                await log.held.wait()
            clock.advance(60.0)
    (reply,) = replies
    assert reply.status_code == 200
    assert reply.json()["failure"]["code"] == "deadline_exceeded"
    assert log.seen("verify") == []
    assert [r["route"] for r in log.requests[-2:]] == ["sessions/close", "close_session"]


async def test_a_verify_past_its_timeout_fails_the_episode_with_a_typed_detail(
    tmp_path: Path,
) -> None:
    log = PeerLog(verify_seconds=30.0)
    timeouts = PeerTimeouts(verify_s=0.2)
    async with environment_server(tmp_path, log, timeouts=timeouts) as client:
        with anyio.fail_after(20):
            reply = await client.post("/run", json=run_body("r1"))
    assert reply.status_code == 200
    failure = reply.json()["failure"]
    assert failure["code"] == "deadline_exceeded"
    assert "resources verify of r1 did not answer within 0.2 s" in failure["detail"]
    assert "--verify-timeout-s" in failure["detail"]
    assert [r["route"] for r in log.requests[-2:]] == ["sessions/close", "close_session"]


async def test_a_verify_within_a_longer_timeout_succeeds(tmp_path: Path) -> None:
    log = PeerLog(verify_seconds=0.3)
    async with environment_server(tmp_path, log, timeouts=PeerTimeouts(verify_s=5.0)) as client:
        reply = await client.post("/run", json=run_body("r1"))
    assert reply.json()["result"]["reward"] == 0.37


def test_serve_environment_takes_its_peer_timeouts_as_options() -> None:
    from typer.testing import CliRunner

    from e2e._cli.app import build_app

    text = CliRunner().invoke(build_app(), ["serve", "environment", "--help"]).output
    for option in ("--peer-timeout-s", "--activation-timeout-s", "--verify-timeout-s"):
        assert option in text
