"""The agent server in-process, against fake policy and resources peers behind ASGITransport."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from e2e._servers.agent import create_agent_app
from e2e._servers.cluster import default_cluster
from e2e._servers.context import ServeContext
from participants import AgentParticipant
from tests.e2e.agent_fakes import (
    AUTH,
    ROLLOUT,
    TOKEN,
    FakePeers,
    control,
    expected_episode,
    wait_for,
)

pytestmark = pytest.mark.anyio
TASK = {"activations": 2, "turns": 2, "max_tokens": 8, "seed": 5}
KEY = ROLLOUT
NEXT = f"{ROLLOUT}-a1"


@asynccontextmanager
async def agent(
    peers: FakePeers, root: Path, *, restart_only: bool = False
) -> AsyncIterator[httpx.AsyncClient]:
    """A fresh agent server process stand-in: its lifespan entered, a client to it."""
    ctx = ServeContext("agent", 0, root, default_cluster(root), TOKEN, TOKEN)
    transport = httpx.ASGITransport(app=peers.app())
    app = create_agent_app(
        ctx, restart_only=restart_only, transports={"model": transport, "resources": transport}
    )
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://agent", timeout=30
    )
    async with app.router.lifespan_context(app), client:
        client.app = app  # type: ignore[attr-defined]
        yield client


def participant_of(client: httpx.AsyncClient) -> AgentParticipant:
    participant = client.app.state.participant  # type: ignore[attr-defined]
    assert isinstance(participant, AgentParticipant)
    return participant


async def seed(client: httpx.AsyncClient, key: str = KEY, **task: int) -> httpx.Response:
    body = {"resources_session_id": "s1", "task_input": {**TASK, **task}}
    return await client.post(f"/ng-rollout/{key}/sessions/seed", json=body)


async def activate(client: httpx.AsyncClient, index: int, key: str = KEY) -> httpx.Response:
    return await client.post(
        f"/ng-rollout/{key}/sessions/activate", headers={"x-ng-agent-activation": str(index)}
    )


async def ctl(client: httpx.AsyncClient, op: str, **body: Any) -> httpx.Response:
    return await client.post(f"/ng-control/v1/checkpoint/{op}", json=control(**body), headers=AUTH)


def code(reply: httpx.Response) -> str:
    return str(reply.json()["error"]["code"])


async def test_an_activation_runs_its_turns_with_the_contracts_messages_and_tools(
    tmp_path: Path,
) -> None:
    peers = FakePeers()
    peers.new_session()
    expected = expected_episode(ROLLOUT, TASK)
    async with agent(peers, tmp_path) as client:
        assert (await seed(client)).json() == {"session_key": KEY}
        for index in (1, 2):
            reply = await activate(client, index)
            assert reply.status_code == 200, reply.text
            assert reply.json() == {
                "activation": index,
                "messages": expected[index - 1],
                "turns": 2,
            }
    assert len(peers.model_calls) == 4
    tools = [m["content"].split()[:2] for a in expected for m in a if m["role"] == "tool"]
    assert [[tool, str(arg)] for _, _, tool, arg in peers.tool_calls] == tools
    assert {(key, session) for key, session, _, _ in peers.tool_calls} == {(KEY, "s1")}


async def test_the_last_activation_repeats_its_reply_and_other_indexes_are_refused(
    tmp_path: Path,
) -> None:
    peers = FakePeers()
    peers.new_session()
    async with agent(peers, tmp_path) as client:
        assert code(await activate(client, 1)) == "checkpoint_error"  # not seeded
        await seed(client)
        assert code(await activate(client, 2)) == "activation_out_of_order"
        first = await activate(client, 1)
        again = await activate(client, 1)
        assert again.status_code == 200 and again.json() == first.json()
        assert len(peers.model_calls) == 2, "a repeated activation must not run again"
        assert code(await activate(client, 3)) == "activation_out_of_order"
        missing = await client.post(f"/ng-rollout/{KEY}/sessions/activate")
        assert missing.status_code == 422 and code(missing) == "invalid_request"
        assert len(peers.model_calls) == 2
        assert (await activate(client, 2)).status_code == 200
        assert code(await activate(client, 1)) == "activation_out_of_order"  # an earlier index
        assert len(peers.model_calls) == 4


async def test_bad_seeds_are_refused_and_change_nothing(tmp_path: Path) -> None:
    peers = FakePeers()
    async with agent(peers, tmp_path) as client:
        bad = await seed(client, turns=0)
        assert bad.status_code == 422 and code(bad) == "invalid_request"
        assert participant_of(client).sessions == {}
        assert (await seed(client)).status_code == 200
        assert (await seed(client)).status_code == 200  # the same seed again is a no-op
        assert code(await seed(client, turns=3)) == "checkpoint_error"
        malformed = await client.post("/ng-rollout/bad key/sessions/seed", json={})
        assert malformed.status_code in (400, 404, 422)


@pytest.mark.parametrize(
    "session_id",
    ['ng(\u2948$h"\x045', "s 1", "s;1", "s,1", 's"1', "s\\1", "s\t1", "\u00e9", "s\x7f"],
)
async def test_a_resources_session_id_no_cookie_can_carry_is_refused_at_the_seed(
    tmp_path: Path, session_id: str
) -> None:
    # D359: the id goes back as the ng_session cookie on every tool call; one a cookie cannot
    # carry failed there, as a 500 in the middle of an activation (the hostile-input soak).
    peers = FakePeers()
    async with agent(peers, tmp_path) as client:
        body = {"resources_session_id": session_id, "task_input": TASK}
        bad = await client.post(f"/ng-rollout/{KEY}/sessions/seed", json=body)
        assert bad.status_code == 422 and code(bad) == "invalid_request"
        assert participant_of(client).sessions == {}
        uuid_like = {"resources_session_id": "9f0c-A_b.~!#$%&'*+/:<=>?@[]^`{|}", "task_input": TASK}
        assert (await client.post(f"/ng-rollout/{KEY}/sessions/seed", json=uuid_like)).is_success


async def test_a_running_tool_call_blocks_prepare_and_the_session_parks_after_it(
    tmp_path: Path,
) -> None:
    peers = FakePeers()
    peers.new_session()
    peers.tool_gates[1] = anyio.Event()
    expected = expected_episode(ROLLOUT, TASK)
    async with agent(peers, tmp_path) as client, anyio.create_task_group() as group:
        await seed(client)
        replies: list[httpx.Response] = []

        async def first_activation() -> None:
            replies.append(await activate(client, 1))

        group.start_soon(first_activation)
        await wait_for(lambda: len(peers.tool_calls) == 1, "the first tool call")
        early = await ctl(client, "prepare", checkpoint_id="c1", deadline_ts=time.time() + 0.3)
        assert early.json()["phase"] == "preparing"
        assert early.json()["report"]["blockers"] == [KEY]
        peers.tool_gates[1].set()
        ready = await ctl(client, "prepare", checkpoint_id="c1")
        assert ready.json()["phase"] == "prepared", ready.text
        assert ready.json()["report"]["counts"] == {"sessions": 1, "at_boundary": 1}
        assert len(peers.model_calls) == 1, "a parked session must not call the model"
        commit = await ctl(client, "commit", checkpoint_id="c1", checkpoint_dir=str(tmp_path / "c"))
        assert commit.status_code == 200, commit.text
        [record] = await participant_of(client).export(None)
        assert record["boundary"] == {"at": "after_tool_round", "activation": 1, "turn": 1}
        assert record["session"]["conversation"][2:] == expected[0][:2]
        assert (await ctl(client, "resume", checkpoint_id="c1")).status_code == 200
        await wait_for(lambda: bool(replies), "the activation to finish")
    assert replies[0].json()["messages"] == expected[0]


async def test_a_model_reply_arriving_while_closed_is_held_at_the_boundary_before_it(
    tmp_path: Path,
) -> None:
    peers = FakePeers()
    peers.new_session()
    peers.model_gates[1] = anyio.Event()
    expected = expected_episode(ROLLOUT, TASK)
    async with agent(peers, tmp_path) as client, anyio.create_task_group() as group:
        await seed(client)
        replies: list[httpx.Response] = []

        async def first_activation() -> None:
            replies.append(await activate(client, 1))

        group.start_soon(first_activation)
        await wait_for(lambda: len(peers.model_calls) == 1, "the first model call")
        ready = await ctl(client, "prepare", checkpoint_id="c1")
        assert ready.json()["phase"] == "prepared", (
            "a session waiting on the model is at a boundary"
        )
        peers.model_gates[1].set()
        session = participant_of(client).sessions[KEY]
        await wait_for(lambda: session.parked, "the reply to be held")
        assert peers.tool_calls == [] and len(session.conversation) == 2
        status = await client.get("/ng-control/v1/checkpoint/status", headers=AUTH)
        assert status.json()["report"]["ready"] is True
        [record] = await participant_of(client).export(None)
        assert record["boundary"] == {"at": "before_model_call", "activation": 1, "turn": 0}
        assert len(record["session"]["conversation"]) == 2
        # The model counts that reply delivered: the export carries it with the boundary.
        assert record["session"]["held_reply"] == expected[0][0]["content"]
        assert (await ctl(client, "resume", checkpoint_id="c1")).status_code == 200
        await wait_for(lambda: bool(replies), "the activation to finish")
    assert replies[0].json()["messages"] == expected[0]
    assert len(peers.model_calls) == 2


async def test_a_restored_session_reissues_the_pending_model_call_and_repeats_no_tool_call(
    tmp_path: Path,
) -> None:
    peers = FakePeers()
    peers.new_session()
    peers.model_gates[4] = anyio.Event()  # the second turn of activation 2 never returns
    expected = expected_episode(ROLLOUT, TASK)
    directory = str(tmp_path / "ckpt")
    async with agent(peers, tmp_path) as client, anyio.create_task_group() as group:
        await seed(client)
        first = (await activate(client, 1)).json()
        group.start_soon(activate, client, 2)
        await wait_for(lambda: len(peers.model_calls) == 4, "the pending model call")
        assert (await ctl(client, "prepare", checkpoint_id="c1")).json()["phase"] == "prepared"
        scope = [{"rollout_id": ROLLOUT, "attempt": 0}]
        commit = await ctl(
            client, "commit", checkpoint_id="c1", checkpoint_dir=directory, episode_ids=scope
        )
        assert commit.json()["episode_ids"] == [KEY], commit.text
        group.cancel_scope.cancel()  # the crash: the process and its pending call are gone
    pending = peers.model_calls[3][1]
    assert len(peers.tool_calls) == 3

    async with agent(peers, tmp_path) as client:
        restore = await ctl(
            client, "restore", checkpoint_id="c2", checkpoint_dir=directory, episode_ids=scope
        )
        assert restore.json()["restored"] == [NEXT], restore.text
        assert (await ctl(client, "resume", checkpoint_id="c2")).status_code == 200
        assert code(await activate(client, 2)) == "stale_attempt"  # attempt 0 is fenced
        assert code(await seed(client)) == "stale_attempt"
        closing = await client.post(f"/ng-rollout/{KEY}/sessions/close")
        assert code(closing) == "stale_attempt"
        assert (await activate(client, 1, NEXT)).json() == first  # the stored reply survives
        second = await activate(client, 2, NEXT)
        assert second.status_code == 200, second.text
    assert second.json()["messages"] == expected[1]
    assert peers.model_calls[4] == (NEXT, pending), "the pending call is re-issued as it was"
    assert len(peers.model_calls) == 5
    assert len(peers.tool_calls) == 4, "no tool call may run twice"
    assert [key for key, *_ in peers.tool_calls] == [KEY, KEY, KEY, NEXT]


async def test_a_held_reply_travels_with_the_checkpoint_and_is_never_asked_again(
    tmp_path: Path,
) -> None:
    peers = FakePeers()
    peers.new_session()
    peers.model_gates[1] = anyio.Event()
    expected = expected_episode(ROLLOUT, TASK)
    directory = str(tmp_path / "ckpt")
    scope = [{"rollout_id": ROLLOUT, "attempt": 0}]
    async with agent(peers, tmp_path) as client, anyio.create_task_group() as group:
        await seed(client)
        group.start_soon(activate, client, 1)
        await wait_for(lambda: len(peers.model_calls) == 1, "the first model call")
        assert (await ctl(client, "prepare", checkpoint_id="c1")).json()["phase"] == "prepared"
        peers.model_gates[1].set()  # the model delivered it; it reaches the closed agent
        session = participant_of(client).sessions[KEY]
        await wait_for(lambda: session.parked, "the reply to be held")
        commit = await ctl(
            client, "commit", checkpoint_id="c1", checkpoint_dir=directory, episode_ids=scope
        )
        assert commit.status_code == 200, commit.text
        group.cancel_scope.cancel()  # the crash
    assert len(peers.model_calls) == 1
    async with agent(peers, tmp_path) as client:
        restore = await ctl(
            client, "restore", checkpoint_id="c2", checkpoint_dir=directory, episode_ids=scope
        )
        assert restore.status_code == 200, restore.text
        assert (await ctl(client, "resume", checkpoint_id="c2")).status_code == 200
        reply = await activate(client, 1, NEXT)
        assert reply.status_code == 200, reply.text
    assert reply.json()["messages"] == expected[0]
    # The held (delivered) call was taken from the checkpoint, not executed again.
    assert len(peers.model_calls) == 2
    assert peers.model_calls[1][0] == NEXT


async def test_retire_cancels_a_running_activation_and_frees_its_session(tmp_path: Path) -> None:
    peers = FakePeers()
    peers.new_session()
    peers.model_gates[1] = anyio.Event()
    async with agent(peers, tmp_path) as client, anyio.create_task_group() as group:
        await seed(client)
        replies: list[httpx.Response] = []

        async def first_activation() -> None:
            replies.append(await activate(client, 1))

        group.start_soon(first_activation)
        await wait_for(lambda: len(peers.model_calls) == 1, "the first model call")
        retire = await ctl(
            client, "retire", checkpoint_id="r", episode_ids=[{"rollout_id": ROLLOUT}]
        )
        assert retire.status_code == 200, retire.text
        assert participant_of(client).sessions == {}
        await wait_for(lambda: bool(replies), "the cancelled activation to answer")
        assert code(replies[0]) == "stale_attempt"
        assert code(await activate(client, 1)) == "stale_attempt"
        status = await client.get("/ng-control/v1/checkpoint/status", headers=AUTH)
        assert status.json()["report"]["counts"]["sessions"] == 0
    assert peers.tool_calls == []


async def test_close_ends_a_session_and_a_closed_session_cannot_activate(tmp_path: Path) -> None:
    peers = FakePeers()
    peers.new_session()
    async with agent(peers, tmp_path) as client:
        await seed(client)
        assert (await client.post(f"/ng-rollout/{KEY}/sessions/close")).json() == {}
        assert code(await activate(client, 1)) == "checkpoint_error"
        assert (await client.post(f"/ng-rollout/{KEY}/sessions/close")).json() == {}


async def test_restore_into_a_process_that_already_served_is_refused(tmp_path: Path) -> None:
    peers = FakePeers()
    peers.new_session()
    directory = str(tmp_path / "ckpt")
    scope = [{"rollout_id": ROLLOUT, "attempt": 0}]
    async with agent(peers, tmp_path) as client:
        await seed(client)
        assert (await ctl(client, "prepare", checkpoint_id="c1")).json()["phase"] == "prepared"
        commit = await ctl(
            client, "commit", checkpoint_id="c1", checkpoint_dir=directory, episode_ids=scope
        )
        assert commit.status_code == 200, commit.text
        assert (await ctl(client, "resume", checkpoint_id="c1")).status_code == 200
        await client.post(f"/ng-rollout/{KEY}/sessions/close")  # no session is left, yet...
        restore = await ctl(
            client, "restore", checkpoint_id="c2", checkpoint_dir=directory, episode_ids=scope
        )
        assert restore.status_code == 409 and code(restore) == "checkpoint_error", restore.text
        assert participant_of(client).sessions == {}, "a refused restore installs nothing"


async def test_a_restart_only_agent_marks_its_seeds_and_reports_its_sessions_as_restarts(
    tmp_path: Path,
) -> None:
    peers = FakePeers()
    peers.new_session()
    async with agent(peers, tmp_path, restart_only=True) as client:
        seeded = await seed(client)
        assert seeded.headers["x-ng-checkpoint-restart"] == "1"
        prepared = await ctl(client, "prepare", checkpoint_id="c1")
        assert prepared.json()["report"]["restarts"] == [KEY], prepared.text
        scope = [{"rollout_id": ROLLOUT, "attempt": 0}]
        commit = await ctl(
            client,
            "commit",
            checkpoint_id="c1",
            checkpoint_dir=str(tmp_path / "c"),
            episode_ids=scope,
        )
        assert commit.status_code == 409 and code(commit) == "restart_in_scope"
    async with agent(peers, tmp_path) as client:
        assert "x-ng-checkpoint-restart" not in (await seed(client)).headers
