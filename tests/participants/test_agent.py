"""AgentParticipant without HTTP: install validation, rewinding a failed activation, hardening
(seeds, closes and retires racing a checkpoint) and the batched session hooks."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from participants import (
    AgentParticipant,
    AgentSession,
    AgentTaskInput,
    CounterSessionHooks,
    RestoredAgentSession,
)
from participants._agent.session import choose_tool
from protocols import (
    CheckpointError,
    CheckpointRequest,
    EpisodeId,
    InternalError,
    InvalidCheckpointStateError,
    StaleAttemptError,
)
from tests.participants.fakes import WindDown

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
        _record("r2", resources_session_id="s;1"),  # no cookie can carry it (D359)
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


class GatedHooks(CounterSessionHooks):
    """Counter hooks whose seed work waits on ``open_gate``; records every call."""

    def __init__(self) -> None:
        self.open_gate: anyio.Event | None = None
        self.opened: list[str] = []
        self.exports: list[list[str]] = []
        self.restores: list[list[str]] = []
        self.retired: list[str] = []
        self.omit: set[str] = set()
        self.fail_restore = False

    async def open_agent_session(
        self, episode_id: EpisodeId, task_input: AgentTaskInput, resources_session_id: str
    ) -> None:
        if self.open_gate is not None:
            await self.open_gate.wait()
        self.opened.append(episode_id.capture_key)

    async def export_agent_sessions(
        self, sessions: Sequence[AgentSession]
    ) -> Mapping[str, dict[str, Any]]:
        self.exports.append([s.episode_id.capture_key for s in sessions])
        states = await super().export_agent_sessions(sessions)
        return {k: v for k, v in states.items() if k not in self.omit}

    async def restore_agent_sessions(self, restored: Sequence[RestoredAgentSession]) -> None:
        self.restores.append([r.session_key for r in restored])
        if self.fail_restore:
            raise CheckpointError("the sandbox snapshot is gone")

    async def retire_agent_session(self, session_key: str) -> None:
        self.retired.append(session_key)


class HeldModelPeers(ScriptedPeers):
    """A model call that cannot be abandoned once sent: it finishes only when ``gate`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = anyio.Event()

    async def complete(
        self, session_key: str, messages: list[dict[str, str]], max_tokens: int
    ) -> str:
        self.model_calls += 1
        with anyio.CancelScope(shield=True):
            await self.gate.wait()
        return f"reply {len(messages)}"


async def wait_all_tasks_blocked() -> None:
    """Let every other task run until it waits (these tests do no I/O, so a few rounds do)."""
    for _ in range(100):
        await anyio.lowlevel.checkpoint()


CLOSE = CheckpointRequest(checkpoint_id="c1", deadline_ts=2e9)


async def test_an_in_flight_seed_holds_prepare_until_registered_and_is_then_exported() -> None:
    hooks = GatedHooks()
    hooks.open_gate = anyio.Event()
    agent = AgentParticipant("agent", ScriptedPeers(), hooks)
    async with anyio.create_task_group() as group:
        group.start_soon(agent.seed, E0, "s1", TASK)
        await wait_all_tasks_blocked()  # the seed is past admission, building its session
        await agent.close_admission(CLOSE)
        assert not agent.ready() and agent.readiness().blockers == ["r1"]
        hooks.open_gate.set()
    assert agent.ready()
    [record] = await agent.export(None)
    assert record["session_key"] == "r1" and hooks.exports == [["r1"]]


async def test_a_session_closing_during_prepare_blocks_it_until_closed() -> None:
    peers = HeldModelPeers()
    agent = AgentParticipant("agent", peers)
    await agent.seed(E0, "s1", TASK)
    closed: list[bool] = []

    async def close() -> None:
        await agent.close(E0)
        closed.append(True)

    async with anyio.create_task_group() as group:
        try:
            group.start_soon(_activate_quietly, agent)
            await wait_all_tasks_blocked()
            assert peers.model_calls == 1
            await agent.close_admission(CLOSE)
            assert agent.ready(), "a session waiting on the model is at its boundary"
            group.start_soon(close)
            await wait_all_tasks_blocked()  # the close has cancelled and waits for the call
            assert not closed and agent.sessions["r1"].closing
            assert not agent.ready() and agent.readiness().blockers == ["r1"]
        finally:
            peers.gate.set()  # the shielded call must end, or a failed test would hang
    assert closed and agent.sessions == {} and agent.ready()


async def _activate_quietly(agent: AgentParticipant) -> None:
    with contextlib.suppress(StaleAttemptError):  # cancelled by the close or the retire
        await agent.activate(E0, 1)


async def test_retire_waits_for_an_in_progress_seed_and_the_seed_frees_what_it_built() -> None:
    hooks = GatedHooks()
    hooks.open_gate = anyio.Event()
    agent = AgentParticipant("agent", ScriptedPeers(), hooks)
    order: list[str] = []

    async def seed() -> None:
        with pytest.raises(StaleAttemptError):
            await agent.seed(E0, "s1", TASK)
        order.append("seed refused")

    async def retire() -> None:
        await agent.retire(E0)
        order.append("retired")

    async with anyio.create_task_group() as group:
        group.start_soon(seed)
        await wait_all_tasks_blocked()
        agent.marks.raise_to([E0])  # what the runtime does before it calls retire
        group.start_soon(retire)
        await wait_all_tasks_blocked()
        order.append("seed work ends")
        hooks.open_gate.set()
    assert order == ["seed work ends", "seed refused", "retired"]
    assert agent.sessions == {} and hooks.opened == ["r1"] and hooks.retired == ["r1"]


async def test_install_is_refused_while_a_seed_is_in_progress() -> None:
    hooks = GatedHooks()
    hooks.open_gate = anyio.Event()
    agent = AgentParticipant("agent", ScriptedPeers(), hooks)
    async with anyio.create_task_group() as group:
        group.start_soon(agent.seed, E0, "s1", TASK)
        await wait_all_tasks_blocked()
        with pytest.raises(CheckpointError):
            await agent.install([_record("r2")], [EpisodeId(rollout_id="r2")])
        assert hooks.restores == []
        hooks.open_gate.set()
    assert sorted(agent.sessions) == ["r1"]


async def test_export_and_install_go_through_one_batched_hook_call_each() -> None:
    hooks = GatedHooks()
    agent = AgentParticipant("agent", ScriptedPeers(), hooks)
    second = EpisodeId(rollout_id="r2")
    await agent.seed(E0, "s1", TASK)
    await agent.seed(second, "s2", TASK)
    await agent.activate(E0, 1)
    assert hooks.exports == [], "a session is described only when a checkpoint exports it"
    records = await agent.export(None)
    assert hooks.exports == [["r1", "r2"]] and len(records) == 2
    hooks.omit = {"r2"}
    with pytest.raises(CheckpointError):
        await agent.export(None)  # a session the hook leaves out fails the commit
    fresh = AgentParticipant("agent", ScriptedPeers(), hooks)
    hooks.fail_restore = True
    with pytest.raises(CheckpointError):
        await fresh.install(records, [E0, second])
    assert fresh.sessions == {}, "a failing restore hook installs nothing"
    hooks.fail_restore = False
    await fresh.install(records, [E0, second])
    assert hooks.restores[-1] == ["r1-a1", "r2-a1"] and sorted(fresh.sessions) == ["r1-a1", "r2-a1"]
    await fresh.retire(EpisodeId(rollout_id="r1", attempt=1))
    assert hooks.retired == ["r1-a1"] and sorted(fresh.sessions) == ["r2-a1"]


def _held_record() -> dict[str, Any]:
    """A session restored one turn into its activation, holding the reply of its second call."""
    conversation = [
        {"role": "system", "content": "counter"},
        {"role": "user", "content": "r1 0"},
        {"role": "assistant", "content": "first"},
        {"role": "tool", "content": "add 1 -> 1 0"},
    ]
    return _record(conversation=conversation, turn_in_activation=1, held_reply="held")


async def test_a_restored_held_reply_survives_a_checkpoint_before_the_session_continues() -> None:
    # Hunt seed 161: the session restored with a held reply was checkpointed again before its
    # replacement ran; the export dropped the reply, and after the next crash the restored
    # session asked the model for that (delivered) call a second time.
    agent = AgentParticipant("agent", ScriptedPeers())
    await agent.install([_held_record()], [E0])
    (record,) = await agent.export(None)
    assert record["session"]["held_reply"] == "held"


async def test_a_held_reply_in_use_when_a_checkpoint_closes_is_exported_with_its_boundary() -> None:
    peers = ScriptedPeers()
    agent = AgentParticipant("agent", peers)
    await agent.install([_held_record()], [E0])
    replacement = EpisodeId(rollout_id="r1", attempt=1)
    await agent.close_admission(CheckpointRequest(checkpoint_id="c", deadline_ts=1e12))
    replies: list[dict[str, Any]] = []
    async with anyio.create_task_group() as group:

        async def run() -> None:
            replies.append(await agent.activate(replacement, 1))

        group.start_soon(run)
        await anyio.wait_all_tasks_blocked()
        session = agent.sessions["r1-a1"]
        assert session.parked  # at the boundary before the call the held reply answers
        (record,) = await agent.export(None)
        assert record["session"]["held_reply"] == "held"
        assert record["boundary"] == {"at": "before_model_call", "activation": 1, "turn": 1}
        await agent.open_admission()
    assert peers.model_calls == 0  # the held reply answered the turn: no call asked again
    assert replies[0]["messages"][2]["content"] == "held"


class WindingDownPeers(ScriptedPeers):
    """Model calls held by a :class:`WindDown`."""

    def __init__(self) -> None:
        super().__init__()
        self.wind_down = WindDown()

    async def complete(
        self, session_key: str, messages: list[dict[str, str]], max_tokens: int
    ) -> str:
        self.model_calls += 1
        await self.wind_down.hold(session_key)
        raise AssertionError("unreachable")


async def test_a_retire_cancels_every_running_session_of_its_batch_before_it_waits_for_one() -> (
    None
):
    """D412: stopped one after another, each session's wind-down cost the retire a few turns of
    a loop that took seconds a turn at 4,000 in flight, and 100 sessions outlasted 30 s."""
    peers = WindingDownPeers()
    agent = AgentParticipant("agent", peers)
    episodes = [EpisodeId(rollout_id=f"r{i}") for i in range(20)]
    for index, episode in enumerate(episodes):
        await agent.seed(episode, f"s{index}", TASK)

    async def activate(episode: EpisodeId) -> None:
        with contextlib.suppress(StaleAttemptError):
            await agent.activate(episode, 1)

    async with anyio.create_task_group() as group:
        try:
            for episode in episodes:
                group.start_soon(activate, episode)
            await wait_all_tasks_blocked()
            assert peers.model_calls == len(episodes)
            agent.marks.raise_to(episodes)  # what the runtime does before it calls retire_many
            group.start_soon(agent.retire_many, episodes)
            await wait_all_tasks_blocked()
            # Every call is winding down at once, before the retire waits for the first of them.
            assert sorted(peers.wind_down.cancelled) == sorted(e.capture_key for e in episodes)
            assert all(session.retired for session in agent.sessions.values())
        finally:
            peers.wind_down.released.set()  # the shielded wind-downs must end, or a test hangs
    assert agent.sessions == {}


async def test_retire_waits_only_for_an_activation_that_is_running() -> None:
    """D435: a session no activation has run in has nothing to wait for; a running one does."""
    peers = WindingDownPeers()
    agent = AgentParticipant("agent", peers)
    idle, running = EpisodeId(rollout_id="idle"), EpisodeId(rollout_id="running")
    await agent.seed(idle, "s1", TASK)
    await agent.seed(running, "s2", TASK)
    assert agent.sessions["idle"].stopped is None
    agent.marks.raise_to([idle])  # what the runtime does before it calls retire_many
    with anyio.fail_after(5):
        await agent.retire_many([idle])  # nothing runs: no wait
    assert "idle" not in agent.sessions
    retired = anyio.Event()

    async def activate() -> None:
        with contextlib.suppress(StaleAttemptError):
            await agent.activate(running, 1)

    async def retire() -> None:
        await agent.retire_many([running])
        retired.set()

    async with anyio.create_task_group() as group:
        try:
            group.start_soon(activate)
            await wait_all_tasks_blocked()
            assert peers.model_calls == 1
            agent.marks.raise_to([running])
            group.start_soon(retire)
            await wait_all_tasks_blocked()
            assert not retired.is_set()  # the activation is still winding down
        finally:
            peers.wind_down.released.set()
    assert retired.is_set() and agent.sessions == {}
