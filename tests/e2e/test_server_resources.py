"""The counter resources server in-process: tools and reward, cookie sessions, waiting while a
checkpoint is open, export and install into a fresh app, restore and retire refusals."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from fastapi import FastAPI

from e2e._servers.cluster import default_cluster
from e2e._servers.context import ServeContext
from e2e._servers.resources import create_resources_app
from participants import ResourcesParticipant, read_participant_checkpoint
from protocols import CONTROL_PREFIX

pytestmark = pytest.mark.anyio
TOKEN = "resources-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
TASK = {"task_input": {"activations": 2, "turns": 2, "max_tokens": 8, "seed": 0}}


@asynccontextmanager
async def resources(root: Path, **options: Any) -> AsyncIterator[tuple[httpx.AsyncClient, FastAPI]]:
    ctx = ServeContext(
        name="resources",
        port=0,
        root=root,
        cluster=default_cluster(root),
        control_token=TOKEN,
        capture_token=TOKEN,
    )
    app = create_resources_app(ctx, **options)
    async with app.state.plane.running():  # ASGITransport runs no lifespan
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://resources") as client:
            yield client, app


def cookie(session_id: str) -> dict[str, str]:
    return {"cookie": f"ng_session={session_id}"}


async def seed(client: httpx.AsyncClient, key: str) -> str:
    reply = await client.post(f"/ng-rollout/{key}/seed_session", json=TASK)
    assert reply.status_code == 200, reply.text
    session_id: str = reply.json()["session_id"]
    return session_id


async def tool(
    client: httpx.AsyncClient, key: str, sid: str, name: str, arg: int
) -> httpx.Response:
    return await client.post(
        f"/ng-rollout/{key}/tools/{name}", json={"arg": arg}, headers=cookie(sid)
    )


async def control(client: httpx.AsyncClient, route: str, **body: Any) -> httpx.Response:
    body.setdefault("deadline_ts", time.time() + 30)
    return await client.post(f"{CONTROL_PREFIX}/{route}", json=body, headers=AUTH)


def code(reply: httpx.Response) -> tuple[int, str]:
    return reply.status_code, reply.json()["error"]["code"]


async def until(participant: ResourcesParticipant, condition: Callable[[], bool]) -> None:
    with anyio.fail_after(10):
        while True:
            seen = participant.changes.version
            if condition():
                return
            await participant.changes.wait_past(seen)


async def test_tools_follow_the_counter_arithmetic_and_verify_rewards_the_history(
    tmp_path: Path,
) -> None:
    async with resources(tmp_path) as (client, app):
        reply = await client.post("/ng-rollout/r1/seed_session", json=TASK)
        sid = reply.json()["session_id"]
        assert reply.headers["x-ng-checkpoint-verify"] == "wait"
        assert "x-ng-checkpoint-restart" not in reply.headers
        assert reply.headers["set-cookie"].startswith(f"ng_session={sid};")
        assert "Path=/" in reply.headers["set-cookie"]
        steps = [("add", 5, 6, 0), ("mul", 2, 18, 0), ("note", 4, 18, 1), ("add", 9, 27, 1)]
        for name, arg, value, notes in steps:
            answer = await tool(client, "r1", sid, name, arg)
            assert answer.json() == {"value": value, "notes": notes}
        verified = await client.post("/ng-rollout/r1/verify", headers=cookie(sid))
        assert verified.json() == {"reward": ((27 + 7 * 4) % 101) / 100}
        assert app.state.participant.sessions == {}  # verify ended the session
        assert app.state.counters.counters == {}
        after = await tool(client, "r1", sid, "add", 1)
        assert code(after) == (409, "checkpoint_error")


def sample(text: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    (value,) = [
        line.rsplit(" ", 1)[1]
        for line in text.splitlines()
        if line.startswith(f"{name}{{{wanted}}} ")
    ]
    return float(value)


async def test_metrics_count_requests_by_route_and_outcome(tmp_path: Path) -> None:
    async with resources(tmp_path) as (client, _app):
        sid = await seed(client, "r1")
        await tool(client, "r1", sid, "add", 1)
        assert code(await tool(client, "r1-a1", sid, "add", 1)) == (409, "stale_attempt")
        await client.post("/ng-rollout/r1/verify", headers=cookie(sid))
        text = (await client.get("/metrics")).text
        total = "midflight_resources_requests_total"
        assert sample(text, total, route="seed", outcome="ok") == 1
        assert sample(text, total, route="tool", outcome="ok") == 1
        assert sample(text, total, route="tool", outcome="refused") == 1
        assert sample(text, total, route="verify", outcome="ok") == 1
        assert sample(text, total, route="close", outcome="ok") == 0
        gauge = "midflight_resources_requests_in_progress"
        assert sample(text, gauge, route="verify") == 0


async def test_the_value_wraps_at_the_modulus(tmp_path: Path) -> None:
    async with resources(tmp_path) as (client, _app):
        sid = await seed(client, "r1")
        await tool(client, "r1", sid, "add", 1_000_002)  # 1 + 1_000_002 = modulus
        assert (await tool(client, "r1", sid, "add", 3)).json()["value"] == 3


async def test_cookie_sessions_are_checked(tmp_path: Path) -> None:
    async with resources(tmp_path) as (client, _app):
        sid = await seed(client, "r1")
        jar = await client.post("/ng-rollout/r1/tools/add", json={"arg": 0})  # the client's jar
        assert jar.json() == {"value": 1, "notes": 0}
        client.cookies.clear()
        missing = await client.post("/ng-rollout/r1/tools/add", json={"arg": 1})
        assert code(missing) == (422, "invalid_request")
        assert code(await tool(client, "r1", "unknown", "add", 1)) == (409, "checkpoint_error")
        assert code(await tool(client, "r2", sid, "add", 1)) == (409, "checkpoint_error")
        assert code(await tool(client, "r1-a1", sid, "add", 1)) == (409, "stale_attempt")
        assert code(await tool(client, "r1", sid, "div", 1)) == (422, "invalid_request")
        assert code(await tool(client, "r1", sid, "add", -1)) == (422, "invalid_request")
        assert code(await tool(client, "bad key!", sid, "add", 1)) == (400, "invalid_rollout_id")
        # none of the refused requests touched the counter
        assert (await tool(client, "r1", sid, "add", 0)).json() == {"value": 1, "notes": 0}
        closed = await client.post("/close_session", headers=cookie(sid))
        assert (closed.status_code, closed.json()) == (200, {})
        assert (await client.post("/close_session", headers=cookie(sid))).json() == {}
        assert code(await tool(client, "r1", sid, "add", 1)) == (409, "checkpoint_error")


async def test_a_restart_only_server_says_so_on_every_seed(tmp_path: Path) -> None:
    async with resources(tmp_path, mode="restart_only", verify="replay") as (client, _app):
        reply = await client.post("/ng-rollout/r1/seed_session", json=TASK)
        assert reply.headers["x-ng-checkpoint-restart"] == "1"
        assert reply.headers["x-ng-checkpoint-verify"] == "replay"


async def test_requests_wait_while_a_checkpoint_is_open_and_run_at_resume(tmp_path: Path) -> None:
    async with resources(tmp_path) as (client, app):
        participant: ResourcesParticipant = app.state.participant
        sid = await seed(client, "r1")
        prepared = await control(client, "prepare", checkpoint_id="c1")
        assert prepared.json()["phase"] == "prepared", prepared.text
        replies: dict[str, httpx.Response] = {}

        async def send(name: str, call: Callable[[], Any]) -> None:
            replies[name] = await call()

        async with anyio.create_task_group() as group:
            group.start_soon(send, "tool", lambda: tool(client, "r1", sid, "add", 2))
            group.start_soon(
                send, "seed", lambda: client.post("/ng-rollout/r2/seed_session", json=TASK)
            )
            await until(participant, lambda: participant.waiting == 2)
            assert replies == {}
            status = (await client.get(f"{CONTROL_PREFIX}/status", headers=AUTH)).json()
            assert status["report"]["ready"] and status["phase"] == "prepared"
            assert (await control(client, "resume", checkpoint_id="c1")).status_code == 200
        assert replies["tool"].json() == {"value": 3, "notes": 0}
        assert replies["seed"].status_code == 200


async def test_export_and_install_continue_the_same_sessions_as_the_next_attempt(
    tmp_path: Path,
) -> None:
    checkpoint = tmp_path / "ckpt"
    scope = [{"rollout_id": "r1"}, {"rollout_id": "r2", "attempt": 2}]
    async with resources(tmp_path) as (client, _app):
        s1 = await seed(client, "r1")
        s2 = await seed(client, "r2-a2")
        s3 = await seed(client, "r3")  # outside the scope: not exported
        await tool(client, "r1", s1, "add", 5)
        await tool(client, "r1", s1, "note", 3)
        await tool(client, "r2-a2", s2, "mul", 4)
        await control(client, "prepare", checkpoint_id="c1")
        committed = await control(
            client, "commit", checkpoint_id="c1", checkpoint_dir=str(checkpoint), episode_ids=scope
        )
        assert committed.json()["episode_ids"] == ["r1", "r2-a2"], committed.text
        # the live server goes on after the checkpoint; none of this is in it
        await control(client, "resume", checkpoint_id="c1")
        await tool(client, "r1", s1, "add", 100)
    share = read_participant_checkpoint(
        checkpoint / "gym" / "resources" / "resources", kind="resources", instance="resources"
    )
    assert sorted(share.records, key=lambda r: r["episode_id"]["rollout_id"]) == [
        {"episode_id": {"rollout_id": "r1", "attempt": 0}, "session_id": s1,
         "state": {"value": 6, "notes": [3]}},
        {"episode_id": {"rollout_id": "r2", "attempt": 2}, "session_id": s2,
         "state": {"value": 5, "notes": []}},
    ]  # fmt: skip
    assert s3 not in {r["session_id"] for r in share.records}

    async with resources(tmp_path) as (client, app):
        participant: ResourcesParticipant = app.state.participant
        restored = await control(
            client, "restore", checkpoint_id="r", checkpoint_dir=str(checkpoint), episode_ids=scope
        )
        assert restored.json()["restored"] == ["r1-a1", "r2-a3"], restored.text
        assert [e.capture_key for e in participant.restored_pending()] == ["r1-a1", "r2-a3"]
        async with anyio.create_task_group() as group:  # before resume a request waits
            replies: list[httpx.Response] = []

            async def early() -> None:
                replies.append(await tool(client, "r1-a1", s1, "add", 1))

            group.start_soon(early)
            await until(participant, lambda: participant.waiting == 1)
            await control(client, "resume", checkpoint_id="r")
        assert replies[0].json() == {"value": 7, "notes": 1}
        assert [e.capture_key for e in participant.restored_pending()] == ["r2-a3"]
        assert code(await tool(client, "r1", s1, "add", 1)) == (409, "stale_attempt")
        assert code(await tool(client, "r2-a2", s2, "add", 1)) == (409, "stale_attempt")
        verified = await client.post("/ng-rollout/r1-a1/verify", headers=cookie(s1))
        assert verified.json() == {"reward": ((7 + 7 * 3) % 101) / 100}


async def test_restore_is_refused_by_a_process_that_served_sessions(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    async with resources(tmp_path) as (client, _app):
        await seed(client, "r1")
        await control(client, "prepare", checkpoint_id="c1")
        await control(
            client, "commit", checkpoint_id="c1", checkpoint_dir=str(checkpoint), episode_ids=None
        )
        await control(client, "resume", checkpoint_id="c1")
        refused = await control(
            client,
            "restore",
            checkpoint_id="r",
            checkpoint_dir=str(checkpoint),
            episode_ids=[{"rollout_id": "r1"}],
        )
        assert code(refused) == (409, "checkpoint_error")
    async with resources(tmp_path) as (client, _app):  # served, then closed: still not fresh
        sid = await seed(client, "r9")
        await client.post("/close_session", headers=cookie(sid))
        again = await control(
            client,
            "restore",
            checkpoint_id="r",
            checkpoint_dir=str(checkpoint),
            episode_ids=[{"rollout_id": "r1"}],
        )
        assert code(again) == (409, "checkpoint_error")


@pytest.mark.parametrize("mode", ["stateless", "restart_only"])
async def test_a_server_that_exports_nothing_refuses_a_restore_with_records(
    tmp_path: Path, mode: str
) -> None:
    checkpoint = tmp_path / "ckpt"
    async with resources(tmp_path) as (client, _app):
        await seed(client, "r1")
        await control(client, "prepare", checkpoint_id="c1")
        await control(
            client, "commit", checkpoint_id="c1", checkpoint_dir=str(checkpoint), episode_ids=None
        )
    async with resources(tmp_path, mode=mode) as (client, app):
        refused = await control(
            client,
            "restore",
            checkpoint_id="r",
            checkpoint_dir=str(checkpoint),
            episode_ids=[{"rollout_id": "r1"}],
        )
        assert code(refused) == (409, "checkpoint_error")
        assert app.state.participant.sessions == {}
        assert (await client.post("/ng-rollout/r1-a1/seed_session", json=TASK)).status_code == 200


async def test_retired_attempts_get_stale_attempt_until_forget(tmp_path: Path) -> None:
    async with resources(tmp_path) as (client, app):
        sid = await seed(client, "r1")
        retired = await control(
            client, "retire", checkpoint_id="x", episode_ids=[{"rollout_id": "r1"}]
        )
        assert retired.json() == {"retired": ["r1"]}
        assert app.state.counters.counters == {}
        assert code(await tool(client, "r1", sid, "add", 1)) == (409, "stale_attempt")
        stale_seed = await client.post("/ng-rollout/r1/seed_session", json=TASK)
        assert code(stale_seed) == (409, "stale_attempt")
        assert (await client.post("/close_session", headers=cookie(sid))).status_code == 200
        status = (await client.get(f"{CONTROL_PREFIX}/status", headers=AUTH)).json()
        assert status["retired_rollouts"] == 1 and status["retired_sessions"] == 0
        assert status["mode"] == "exported" and status["verify"] == "wait"
        forgot = await control(client, "forget", checkpoint_id="x", rollout_ids=["r1"])
        assert forgot.json() == {"forgotten": ["r1"]}
        assert (await client.post("/ng-rollout/r1/seed_session", json=TASK)).status_code == 200


async def _slow_verify_during_prepare(
    tmp_path: Path, verify: str
) -> tuple[list[str], list[dict[str, Any]]]:
    """Prepare while a 3 s verify runs; the order things finished in and what the commit wrote."""
    checkpoint = tmp_path / "ckpt"
    order: list[str] = []
    async with resources(tmp_path, verify=verify, verify_delay_ms=3000) as (client, app):
        participant: ResourcesParticipant = app.state.participant
        sid = await seed(client, "r1")
        await tool(client, "r1", sid, "add", 4)

        async def verify_call() -> None:
            reply = await client.post("/ng-rollout/r1/verify", headers=cookie(sid))
            assert reply.json() == {"reward": 0.05}, reply.text
            order.append("verified")

        async with anyio.create_task_group() as group:
            group.start_soon(verify_call)
            if verify == "wait":  # a counted verify: make sure it is in flight first
                await until(participant, lambda: participant.inflight == 1)
            prepared = await control(client, "prepare", checkpoint_id="c1")
            order.append(prepared.json()["phase"])
            await control(
                client, "commit", checkpoint_id="c1", checkpoint_dir=str(checkpoint),
                episode_ids=None,
            )  # fmt: skip
        await control(client, "resume", checkpoint_id="c1")
        assert participant.sessions == {}  # ended by the verify (a replayable one at resume)
    share = read_participant_checkpoint(
        checkpoint / "gym" / "resources" / "resources", kind="resources", instance="resources"
    )
    return order, list(share.records)


async def test_a_slow_wait_verify_holds_prepare_and_is_not_exported(tmp_path: Path) -> None:
    order, records = await _slow_verify_during_prepare(tmp_path, "wait")
    assert order == ["verified", "prepared"]
    assert records == []  # its session ended before the checkpoint: nothing to re-run


async def test_a_slow_replay_verify_does_not_hold_prepare_and_its_session_is_exported(
    tmp_path: Path,
) -> None:
    order, records = await _slow_verify_during_prepare(tmp_path, "replay")
    assert order == ["prepared", "verified"]
    # The session is in the checkpoint, so a restore can run the verify again from it.
    assert [r["state"] for r in records] == [{"value": 5, "notes": []}]


async def test_a_commit_outside_the_run_root_is_refused_with_a_typed_422(tmp_path: Path) -> None:
    root, outside = tmp_path / "run", tmp_path / "elsewhere"
    root.mkdir()
    outside.mkdir()
    async with resources(root) as (client, _app):
        await seed(client, "r1")
        prepared = await control(client, "prepare", checkpoint_id="c1")
        assert prepared.json()["phase"] == "prepared", prepared.text
        for directory in (outside, root / ".." / "elsewhere"):
            refused = await control(
                client, "commit", checkpoint_id="c1", checkpoint_dir=str(directory / "c1")
            )
            assert code(refused) == (422, "invalid_request")
            assert "outside the checkpoint root" in refused.json()["error"]["detail"]
        assert list(outside.iterdir()) == []
        inside = root / "checkpoints" / "c1"
        committed = await control(
            client, "commit", checkpoint_id="c1", checkpoint_dir=str(inside), episode_ids=None
        )
        assert committed.status_code == 200, committed.text


def test_serve_takes_a_checkpoint_root_and_defaults_to_the_run_root(tmp_path: Path) -> None:
    from e2e._servers.context import control_settings, serve_options_from

    plain = serve_options_from(name="r", port=0, cluster=None, root=tmp_path / "run")
    assert control_settings(plain).checkpoint_root == (tmp_path / "run").resolve()
    chosen = serve_options_from(
        name="r", port=0, cluster=None, root=tmp_path / "run", checkpoint_root=tmp_path / "ck"
    )
    assert control_settings(chosen).checkpoint_root == (tmp_path / "ck").resolve()


async def test_a_verify_that_outlives_its_session_is_refused_typed_not_a_500(
    tmp_path: Path,
) -> None:
    async with resources(tmp_path, verify_delay_ms=300.0) as (client, _app):
        sid = await seed(client, "r1")
        replies: list[httpx.Response] = []

        async def slow_verify() -> None:
            replies.append(await client.post("/ng-rollout/r1/verify", headers=cookie(sid)))

        async with anyio.create_task_group() as group:
            group.start_soon(slow_verify)
            await anyio.sleep(0.05)
            # The caller gave up (its read timed out) and closed the session meanwhile.
            closed = await client.post("/close_session", headers=cookie(sid))
            assert closed.status_code == 200
        (late,) = replies
        assert code(late) == (409, "checkpoint_error")
        assert "closed while its verify ran" in late.json()["error"]["detail"]
