"""RestartOnlyAgentParticipant: never blocks, reports restarts, exports nothing, restores nothing."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest

from participants import ControlPlane, RestartOnlyAgentParticipant
from protocols import (
    CheckpointError,
    CheckpointRequest,
    CommitRequest,
    EpisodeId,
    RestartInScopeError,
)
from tests.participants.test_agent import (
    CLOSE,
    E0,
    TASK,
    HeldModelPeers,
    ScriptedPeers,
    _record,
    wait_all_tasks_blocked,
)

pytestmark = pytest.mark.anyio


async def test_a_running_session_never_blocks_and_keeps_running_through_a_checkpoint() -> None:
    peers = HeldModelPeers()
    agent = RestartOnlyAgentParticipant("agent-restart", peers)
    await agent.seed(E0, "s1", TASK)
    replies: list[dict[str, object]] = []

    async def activate() -> None:
        replies.append(await agent.activate(E0, 1))

    async with anyio.create_task_group() as group:
        try:
            group.start_soon(activate)
            await wait_all_tasks_blocked()
            await agent.close_admission(CLOSE)
            report = agent.readiness()
            assert report.ready and report.restarts == ["r1"]
            assert report.counts == {"inflight": 1}
        finally:
            peers.gate.set()
        await wait_all_tasks_blocked()
        # Still closed: the session went on past its boundaries and finished its activation.
        assert replies and replies[0]["activation"] == 1 and len(peers.tool_calls) == 2
    assert await agent.export(None) == []


async def test_a_new_seed_waits_while_a_checkpoint_is_open() -> None:
    agent = RestartOnlyAgentParticipant("agent-restart", ScriptedPeers())
    await agent.close_admission(CLOSE)
    async with anyio.create_task_group() as group:
        group.start_soon(agent.seed, E0, "s1", TASK)
        await wait_all_tasks_blocked()
        assert agent.sessions == {} and agent.readiness().restarts == []
        await agent.open_admission()
    assert sorted(agent.sessions) == ["r1"]


async def test_restore_with_records_fails_and_an_empty_one_is_accepted() -> None:
    agent = RestartOnlyAgentParticipant("agent-restart", ScriptedPeers())
    with pytest.raises(CheckpointError):
        await agent.install([_record()], [E0])
    assert agent.sessions == {}
    await agent.install([], [])
    await agent.seed(E0, "s1", TASK)
    with pytest.raises(CheckpointError):
        await agent.install([], [])  # a process with live sessions is not fresh


async def test_a_commit_naming_a_restart_is_refused_with_restart_in_scope(tmp_path: Path) -> None:
    agent = RestartOnlyAgentParticipant("agent-restart", ScriptedPeers())
    await agent.seed(E0, "s1", TASK)
    request = CheckpointRequest(checkpoint_id="c1", deadline_ts=time.time() + 30)
    directory = str(tmp_path / "c")
    async with ControlPlane(agent).running() as plane:
        prepared = await plane.prepare(request)
        assert prepared.report.ready and prepared.report.restarts == ["r1"]
        with pytest.raises(RestartInScopeError):
            await plane.commit(_commit(request, directory, [E0]))
        reply = await plane.commit(_commit(request, directory, [EpisodeId(rollout_id="r2")]))
        assert reply.episode_ids == []
        await plane.resume(request)


def _commit(request: CheckpointRequest, directory: str, scope: list[EpisodeId]) -> CommitRequest:
    return CommitRequest(**request.model_dump(), checkpoint_dir=directory, episode_ids=scope)
