"""AgentParticipant without HTTP: install validation, rewinding a failed activation."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from participants import AgentParticipant, AgentTaskInput, choose_tool
from protocols import CheckpointError, EpisodeId, InternalError, InvalidCheckpointStateError

pytestmark = pytest.mark.anyio
TASK = AgentTaskInput(activations=1, turns=2, max_tokens=4, seed=0)
E0 = EpisodeId(rollout_id="r1")


class ScriptedPeers:
    """Answers every model call with the same text; the first ``fail_tools`` tool calls fail."""

    def __init__(self, fail_tools: int = 0) -> None:
        self.fail_tools = fail_tools
        self.tool_calls: list[tuple[str, int]] = []
        self.model_calls = 0

    async def complete(
        self, session_key: str, messages: list[dict[str, str]], max_tokens: int
    ) -> str:
        self.model_calls += 1
        return f"reply {len(messages)}"

    async def call_tool(
        self, session_key: str, resources_session_id: str, tool: str, arg: int
    ) -> dict[str, int]:
        if self.fail_tools:
            self.fail_tools -= 1
            raise InternalError("the resources server is unreachable")
        self.tool_calls.append((tool, arg))
        return {"value": len(self.tool_calls), "notes": 0}


def test_the_tool_follows_the_sha256_of_the_completion() -> None:
    for text in ("abc", "zz 9", "", "a" * 40):
        d = hashlib.sha256(text.encode("latin-1")).digest()
        assert choose_tool(text) == (("add", "mul", "note")[d[0] % 3], d[1] % 10)


def _record(rollout_id: str = "r1", **session: Any) -> dict[str, Any]:
    base = {
        "conversation": [
            {"role": "system", "content": "counter"},
            {"role": "user", "content": "r1 0"},
        ],
        "resources_session_id": "s1",
        "task_input": TASK.model_dump(),
        "completed_activation": 0,
        "turn_in_activation": 0,
        "stored_reply": None,
    }
    return {
        "episode_id": {"rollout_id": rollout_id, "attempt": 0},
        "session_key": rollout_id,
        "session": {**base, **session},
        "boundary": None,
    }


async def test_install_checks_every_record_before_installing_any() -> None:
    agent = AgentParticipant("agent", ScriptedPeers())
    good = _record()
    other = _record("r2")
    for bad in (
        _record("r2", turn_in_activation=1),  # the conversation is too short for this position
        _record("r2", stored_reply={"activation": 1}),  # a reply with no activation completed
        {**_record("r2"), "session_key": "r9"},
        {**_record("r2"), "session": "nope"},
        _record(),  # the same session twice
    ):
        with pytest.raises(InvalidCheckpointStateError):
            await agent.install([good, bad], [E0])
        assert agent.sessions == {}
    await agent.install([good, other], [E0])
    assert sorted(agent.sessions) == ["r1-a1", "r2-a1"]
    assert [e.capture_key for e in agent.restored_pending()] == ["r1-a1", "r2-a1"]
    with pytest.raises(CheckpointError):
        await agent.install([good], [E0])  # only into a process without sessions


async def test_a_failed_tool_call_rewinds_the_session_to_its_last_boundary() -> None:
    peers = ScriptedPeers(fail_tools=1)
    agent = AgentParticipant("agent", peers)
    await agent.seed(E0, "s1", TASK)
    with pytest.raises(InternalError):
        await agent.activate(E0, 1)
    session = agent.sessions["r1"]
    assert (session.state, len(session.conversation), session.turn_in_activation) == ("idle", 2, 0)
    assert agent.ready()
    reply = await agent.activate(E0, 1)  # the retry continues from the boundary before the call
    assert [m["role"] for m in reply["messages"]] == ["assistant", "tool"] * 2
    assert len(peers.tool_calls) == 2 and peers.model_calls == 3
