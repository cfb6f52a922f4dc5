"""The resources participant driven directly: admission while closed, counting, readiness,
retire and forget, install refusals and the replayable verify."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from participants import ControlPlane, ResourcesParticipant
from protocols import (
    CheckpointError,
    CheckpointRequest,
    DeadlineExceededError,
    EpisodeId,
    ForgetRequest,
    InvalidCheckpointStateError,
    Phase,
    RetireIncompleteError,
    RetireRequest,
    StaleAttemptError,
)

pytestmark = pytest.mark.anyio
R1 = EpisodeId(rollout_id="r1")


class FakeHooks:
    """Session state in a dict; remembers what was freed."""

    def __init__(self) -> None:
        self.states: dict[str, Any] = {}
        self.freed: list[str] = []

    async def export_session_states(self, session_ids: Sequence[str]) -> dict[str, Any]:
        return {sid: self.states[sid] for sid in session_ids if sid in self.states}

    async def restore_session_states(self, states: Mapping[str, Any]) -> None:
        self.states.update(states)

    async def retire_session_state(self, session_id: str) -> None:
        self.freed.append(session_id)
        self.states.pop(session_id, None)


@asynccontextmanager
async def plane_of(participant: ResourcesParticipant) -> AsyncIterator[ControlPlane]:
    plane = ControlPlane(participant)
    async with plane.running():
        yield plane


async def until(participant: ResourcesParticipant, condition: Callable[[], bool]) -> None:
    with anyio.fail_after(10):
        while True:
            seen = participant.changes.version
            if condition():
                return
            await participant.changes.wait_past(seen)


async def seed(participant: ResourcesParticipant, episode: EpisodeId, sid: str) -> None:
    async with participant.admit("seed", episode_id=episode, session_id=None):
        assert isinstance(participant.hooks, FakeHooks)
        participant.hooks.states[sid] = {"value": 1}
        await participant.bind_session(sid, episode)


def request(checkpoint_id: str, seconds: float = 10.0) -> CheckpointRequest:
    return CheckpointRequest(checkpoint_id=checkpoint_id, deadline_ts=time.time() + seconds)


def make(**options: Any) -> ResourcesParticipant:
    return ResourcesParticipant("resources", FakeHooks(), **options)


async def test_an_inflight_request_blocks_prepare_until_it_finishes() -> None:
    participant = make()
    async with plane_of(participant) as plane:
        await seed(participant, R1, "s1")
        async with participant.admit("tool", episode_id=R1, session_id="s1"):
            reply = await plane.prepare(request("c1", seconds=0.2))
            assert reply.phase is Phase.PREPARING
            assert reply.report.blockers == ["r1"]
            assert reply.report.counts["inflight"] == 1
        again = await plane.prepare(request("c1"))
        assert again.phase is Phase.PREPARED


async def test_requests_wait_while_closed_and_are_admitted_at_resume() -> None:
    participant = make()
    admitted: list[str] = []
    async with plane_of(participant) as plane:
        await seed(participant, R1, "s1")
        assert (await plane.prepare(request("c1"))).phase is Phase.PREPARED

        async def tool() -> None:
            async with participant.admit("tool", episode_id=R1, session_id="s1"):
                admitted.append("tool")

        async with anyio.create_task_group() as group:
            group.start_soon(tool)
            await until(participant, lambda: participant.waiting == 1)
            assert admitted == []
            assert plane.participant.ready(), "a waiting request must not block prepare"
            await plane.resume(request("c1"))
        assert admitted == ["tool"]


async def test_a_replayable_verify_is_admitted_at_once_and_its_end_deferred() -> None:
    participant = make(verify="replay")
    async with plane_of(participant) as plane:
        await seed(participant, R1, "s1")
        await plane.prepare(request("c1"))
        with anyio.fail_after(5):
            async with participant.admit("verify", episode_id=R1, session_id="s1") as admission:
                assert not admission.counted
                await participant.end_session(admission)
        records = await participant.export(None)
        assert [r["session_id"] for r in records] == ["s1"]
        await plane.resume(request("c1"))
        assert participant.sessions == {}
        assert participant.hooks.freed == ["s1"]  # type: ignore[attr-defined]


async def test_a_wait_verify_ends_its_session_at_once() -> None:
    participant = make()
    async with plane_of(participant):
        await seed(participant, R1, "s1")
        async with participant.admit("verify", episode_id=R1, session_id="s1") as admission:
            assert admission.counted
            await participant.end_session(admission)
        assert participant.sessions == {}


async def test_sessions_of_other_attempts_and_rollouts_are_refused() -> None:
    participant = make()
    async with plane_of(participant):
        await seed(participant, R1, "s1")
        with pytest.raises(StaleAttemptError):
            async with participant.admit("tool", episode_id=R1.next_attempt(), session_id="s1"):
                pass
        with pytest.raises(CheckpointError, match="another rollout"):
            async with participant.admit(
                "tool", episode_id=EpisodeId(rollout_id="r2"), session_id="s1"
            ):
                pass
        with pytest.raises(CheckpointError, match="unknown session"):
            async with participant.admit("tool", episode_id=R1, session_id="nope"):
                pass


async def test_retire_refuses_at_once_waits_for_inflight_then_frees() -> None:
    participant = make()
    done: list[str] = []
    async with plane_of(participant) as plane:
        await seed(participant, R1, "s1")
        await seed(participant, EpisodeId(rollout_id="r2"), "s2")
        release = anyio.Event()

        async def inflight() -> None:
            async with participant.admit("tool", episode_id=R1, session_id="s1"):
                await release.wait()

        async def retire() -> None:
            await plane.retire(RetireRequest(checkpoint_id="x", deadline_ts=time.time() + 10,
                                             episode_ids=[R1]))  # fmt: skip
            done.append("retired")

        async with anyio.create_task_group() as group:
            group.start_soon(inflight)
            await until(participant, lambda: participant.inflight == 1)
            group.start_soon(retire)
            await until(participant, lambda: participant.sessions["s1"].retired)
            with pytest.raises(StaleAttemptError):
                async with participant.admit("tool", episode_id=R1, session_id="s1"):
                    pass
            assert done == [] and "s1" in participant.sessions
            assert not participant.ready()
            release.set()
        assert done == ["retired"]
        assert set(participant.sessions) == {"s2"}
        assert participant.hooks.freed == ["s1"]  # type: ignore[attr-defined]
        with pytest.raises(StaleAttemptError):
            await seed(participant, R1, "s3")
        await seed(participant, R1.next_attempt(), "s4")  # the next attempt is served
        # close is never refused, even for a retired attempt's cookie
        async with participant.admit("close", episode_id=None, session_id="s1"):
            pass


async def test_forget_before_the_retired_sessions_are_freed_is_retire_incomplete() -> None:
    participant = make()
    async with plane_of(participant) as plane:
        await seed(participant, R1, "s1")
        release = anyio.Event()
        async with anyio.create_task_group() as group:

            async def inflight() -> None:
                async with participant.admit("tool", episode_id=R1, session_id="s1"):
                    await release.wait()

            group.start_soon(inflight)
            await until(participant, lambda: participant.inflight == 1)
            with pytest.raises(DeadlineExceededError):
                await plane.retire(
                    RetireRequest(
                        checkpoint_id="x", deadline_ts=time.time() + 0.2, episode_ids=[R1]
                    )
                )
            forget = ForgetRequest(
                checkpoint_id="x", deadline_ts=time.time() + 10, rollout_ids=["r1"]
            )
            with pytest.raises(RetireIncompleteError):
                await plane.forget(forget)
            assert plane.marks.is_retired(R1), "a refused forget changes nothing"
            release.set()
        await plane.retire(
            RetireRequest(checkpoint_id="x", deadline_ts=time.time() + 10, episode_ids=[R1])
        )
        await plane.forget(forget)
        assert not plane.marks.is_retired(R1)


async def test_a_seed_finishing_after_its_retire_marked_it_is_refused_and_freed() -> None:
    participant = make()
    async with plane_of(participant) as plane:
        release = anyio.Event()
        refused: list[BaseException] = []

        async def seeding() -> None:
            try:
                async with participant.admit("seed", episode_id=R1, session_id=None):
                    await release.wait()
                    participant.hooks.states["s1"] = {}  # type: ignore[attr-defined]
                    await participant.bind_session("s1", R1)
            except StaleAttemptError as exc:
                refused.append(exc)

        async with anyio.create_task_group() as group:
            group.start_soon(seeding)
            await until(participant, lambda: bool(participant.seeds))
            group.start_soon(
                plane.retire,
                RetireRequest(checkpoint_id="x", deadline_ts=time.time() + 10, episode_ids=[R1]),
            )
            await until(participant, lambda: plane.marks.is_retired(R1))
            release.set()
        assert len(refused) == 1
        assert participant.sessions == {} and participant.hooks.freed == ["s1"]  # type: ignore[attr-defined]


async def test_install_refuses_a_live_process_and_bad_records() -> None:
    record = {"episode_id": {"rollout_id": "r1", "attempt": 0}, "session_id": "s1", "state": {}}
    live = make()
    await seed(live, R1, "s0")
    with pytest.raises(CheckpointError, match="has not served"):
        await live.install([record], [R1])
    for mode in ("stateless", "restart_only"):
        with pytest.raises(CheckpointError, match=mode):
            await make(mode=mode).install([record], [R1])
    fresh = make()
    with pytest.raises(InvalidCheckpointStateError):
        await fresh.install([record, record], [R1])
    with pytest.raises(InvalidCheckpointStateError):
        await fresh.install([{**record, "extra": 1}], [R1])
    assert fresh.sessions == {} and fresh.hooks.states == {}  # type: ignore[attr-defined]
    await fresh.install([record], [R1])
    assert fresh.restored_pending() == [R1.next_attempt()]


async def test_restart_only_reports_restarts_and_never_blocks_prepare() -> None:
    participant = make(mode="restart_only")
    async with plane_of(participant) as plane:
        await seed(participant, R1, "s1")
        async with participant.admit("tool", episode_id=R1, session_id="s1"):
            reply = await plane.prepare(request("c1"))
            assert reply.phase is Phase.PREPARED
            assert reply.report.restarts == ["r1"]
            with anyio.fail_after(5):  # a tool request is admitted while closed
                async with participant.admit("tool", episode_id=R1, session_id="s1"):
                    pass
        assert await participant.export(None) == []


async def test_hidden_lifecycle_calls_track_export_and_free_a_session() -> None:
    participant = make()
    async with plane_of(participant) as plane:
        assert isinstance(participant.hooks, FakeHooks)
        participant.hooks.states["h1"] = {"value": 5}
        await participant.session_started("h1", R1)
        reply = await plane.prepare(request("c1"))
        assert reply.phase is Phase.PREPARED
        await participant.session_ended("h1")  # while open: the state the prepare saw stays
        assert [r["session_id"] for r in await participant.export(None)] == ["h1"]
        assert participant.hooks.freed == []
        await plane.resume(request("c1"))
        assert participant.hooks.freed == ["h1"] and participant.sessions == {}
        await participant.session_ended("h1")  # already gone: a no-op
        assert participant.hooks.freed == ["h1"]


async def test_a_hidden_session_of_a_retired_attempt_is_refused_and_freed() -> None:
    participant = make()
    async with plane_of(participant) as plane:
        await plane.retire(
            RetireRequest(checkpoint_id="t1", episode_ids=[R1], deadline_ts=time.time() + 10)
        )
        assert isinstance(participant.hooks, FakeHooks)
        participant.hooks.states["h1"] = {"value": 5}
        with pytest.raises(StaleAttemptError):
            await participant.session_started("h1", R1)
        assert participant.sessions == {} and participant.hooks.freed == ["h1"]
        assert participant.served_live_work()  # a process that tracked a session cannot restore


async def test_a_mutation_in_flight_holds_prepare_and_is_in_the_exported_state() -> None:
    participant = make()
    async with plane_of(participant) as plane:
        await seed(participant, R1, "s1")
        assert isinstance(participant.hooks, FakeHooks)
        async with participant.admit("tool", episode_id=R1, session_id="s1"):
            held = await plane.prepare(request("c1", seconds=0.3))
            assert held.phase is Phase.PREPARING  # the tool has not finished
            participant.hooks.states["s1"] = {"value": 2}  # the mutation lands late
        assert (await plane.prepare(request("c1"))).phase is Phase.PREPARED
        [record] = await participant.export(None)
        assert record["state"] == {"value": 2}
