"""The fixed-order operations against real control planes in-process, with the call order logged."""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest

from coordinator import CoordinationError, checkpoint_directory
from protocols import (
    CheckpointError,
    EpisodeId,
    InvalidRequestError,
    Phase,
    StaleCheckpointError,
)
from protocols._ids import MAX_ATTEMPT

from .deployment import deployment, flip_ready_later

pytestmark = pytest.mark.anyio
R1, R2 = EpisodeId(rollout_id="r1"), EpisodeId(rollout_id="r2")


def soon(seconds: float = 30.0) -> float:
    return time.time() + seconds


async def test_prepare_goes_stage_by_stage_and_resume_in_reverse() -> None:
    async with deployment() as d:
        d.fakes["environment"].ready_now = False
        async with anyio.create_task_group() as group:
            group.start_soon(flip_ready_later, d.fakes["environment"], 0.2)
            result = await d.coordinator.prepare("c1", soon())
        assert result.prepared
        closes = d.ops("close")
        # The model closes only once the environment stage is prepared.
        assert d.log.index(("environment", "ready", "")) < d.log.index(("policy", "close", "c1"))
        assert closes[:3] == ["environment", "policy", "agent"]
        assert sorted(closes[3:]) == ["resources", "resources2"]
        await d.coordinator.resume("c1", soon())
        opens = d.ops("open")
        assert sorted(opens[:2]) == ["resources", "resources2"]
        assert opens[2:] == ["agent", "policy", "environment"]


async def test_prepare_stops_after_the_first_unprepared_stage() -> None:
    async with deployment() as d:
        d.fakes["policy"].ready_now = False
        d.fakes["policy"].blockers = ["r1", "r2-a1"]
        result = await d.coordinator.prepare("c1", soon(0.3))
        assert not result.prepared
        assert result.blockers() == {"policy": ["r1", "r2-a1"]}
        assert set(result.replies) == {"environment", "policy"}
        assert d.ops("close") == ["environment", "policy"]  # agent and resources never asked
        assert d.planes["agent"].phase is Phase.IDLE


async def test_prepare_raises_on_a_refusal_instead_of_reporting_unprepared() -> None:
    async with deployment() as d:
        await d.coordinator.prepare("c1", soon())
        await d.coordinator.resume("c1", soon())
        with pytest.raises(CoordinationError) as caught:
            await d.coordinator.prepare("c1", soon())  # a resumed id is stale everywhere
        assert caught.value.operation == "prepare"
        assert isinstance(caught.value.causes["environment"], StaleCheckpointError)
        assert d.ops("close") == ["environment", "policy", "agent", "resources", "resources2"]


async def test_restarts_are_the_union_and_leave_the_commit_scope() -> None:
    async with deployment() as d:
        d.fakes["agent"].restarts = ["r2"]
        d.fakes["resources2"].restarts = ["r3-a2"]
        result = await d.coordinator.prepare("c1", soon())
        r3 = EpisodeId(rollout_id="r3", attempt=2)
        assert result.restarts() == {R2, r3}
        assert result.continued([R1, R2, r3, EpisodeId(rollout_id="r3")]) == [
            R1,
            EpisodeId(rollout_id="r3"),
        ]


async def test_resume_keeps_going_past_a_failure_and_raises_at_the_end() -> None:
    async with deployment() as d:
        await d.coordinator.prepare("c1", soon())
        d.router.down.add("agent")
        with pytest.raises(CoordinationError) as caught:
            await d.coordinator.resume("c1", soon())
        assert set(caught.value.failures) == {"agent"}
        assert sorted(d.ops("open")) == ["environment", "policy", "resources", "resources2"]


async def test_retire_follows_the_retire_order_and_goes_past_failures(tmp_path) -> None:  # type: ignore[no-untyped-def]
    async with deployment() as d:
        assert await d.coordinator.retire("retire", soon(), []) == {}
        assert d.router.requests == []
        d.router.down.add("environment")
        with pytest.raises(CoordinationError) as caught:
            await d.coordinator.retire("retire", soon(), [R1, R1])
        assert set(caught.value.failures) == {"environment"}
        retired = d.ops("retire")
        assert retired[0] == "agent"
        assert sorted(retired[1:]) == ["policy", "resources", "resources2"]
        assert all(detail == "r1" for _, op, detail in d.log if op == "retire")
        for name in ("agent", "policy", "resources"):
            assert d.planes[name].marks.is_retired(R1)


async def test_forget_sorts_dedupes_and_stops_at_the_first_failing_group() -> None:
    async with deployment() as d:
        assert await d.coordinator.forget("forget", soon(), []) == {}
        await d.coordinator.forget("forget", soon(), ["b", "a", "b"])
        assert d.ops("forget")[:2] == ["environment", "agent"]
        assert {detail for _, op, detail in d.log if op == "forget"} == {"a,b"}
        d.log.clear()
        d.router.down.add("agent")
        with pytest.raises(CoordinationError) as caught:
            await d.coordinator.forget("forget", soon(), ["a"])
        assert set(caught.value.failures) == {"agent"}
        assert d.ops("forget") == ["environment"]  # model and resources keep their marks


async def _checkpoint(root, scope: list[EpisodeId]) -> str:  # type: ignore[no-untyped-def]
    directory = str(checkpoint_directory(root, "c1"))
    async with deployment() as d:
        for fake in d.fakes.values():
            fake.episodes = scope
        assert (await d.coordinator.prepare("c1", soon())).prepared
        await d.coordinator.commit("c1", soon(), directory, scope)
        await d.coordinator.resume("c1", soon())
    return directory


async def test_restore_all_or_nothing_retires_next_attempts_and_resumes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    directory = await _checkpoint(tmp_path, [R1, R2])
    async with deployment() as d:
        d.fakes["agent"].fail_install = CheckpointError("cannot install")
        with pytest.raises(CoordinationError) as caught:
            await d.coordinator.restore("r-1", soon(), directory, [R1, R2])
        assert set(caught.value.failures) == {"agent"}
        assert isinstance(caught.value.causes["agent"], CheckpointError)
        next_attempts = {"r1-a1", "r2-a1"}
        for name, plane in d.planes.items():
            assert plane.phase is Phase.IDLE, name
            assert {e.capture_key for e in next_attempts_retired(plane)} == next_attempts
        assert sorted(d.ops("open")) == sorted(d.fakes)
        installs = d.ops("install")
        assert sorted(installs) == sorted(d.fakes)
        # every retire happened after every install, and every reopen after every retire
        last_install = max(i for i, e in enumerate(d.log) if e[1] == "install")
        first_retire = min(i for i, e in enumerate(d.log) if e[1] == "retire")
        last_retire = max(i for i, e in enumerate(d.log) if e[1] == "retire")
        # (the agent reopened on its own when its install failed; the others wait for resume)
        first_open = min(i for i, e in enumerate(d.log) if e[1] == "open" and e[0] != "agent")
        assert last_install < first_retire < last_retire < first_open


async def test_a_restore_of_the_last_attempt_is_refused_before_anything_is_sent(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # The checkpoint continued attempt 9,999; its restore would install attempt 10,000 (D361).
    last = EpisodeId(rollout_id="r9", attempt=MAX_ATTEMPT)
    directory = await _checkpoint(tmp_path, [R1, last])
    async with deployment() as d:
        with pytest.raises(InvalidRequestError, match="r9-a9999 is attempt 9999"):
            await d.coordinator.restore("r-1", soon(), directory, [R1, last])
        assert d.log == []  # no restore, no cleanup retire, no resume
        assert all(plane.phase is Phase.IDLE for plane in d.planes.values())


async def test_a_restore_of_two_attempts_of_one_rollout_is_refused_before_anything_is_sent(
    tmp_path,
) -> None:  # type: ignore[no-untyped-def]
    # Restoring r1 installs r1-a1, which the fence of r1-a1 would then refuse (D365).
    directory = await _checkpoint(tmp_path, [R1])
    async with deployment() as d:
        with pytest.raises(InvalidRequestError, match="two attempts of rollout 'r1'"):
            await d.coordinator.restore("r-1", soon(), directory, [R1, R1.next_attempt()])
        assert d.log == []
        assert all(plane.phase is Phase.IDLE for plane in d.planes.values())


def next_attempts_retired(plane) -> list[EpisodeId]:  # type: ignore[no-untyped-def]
    return [
        EpisodeId(rollout_id=r, attempt=1)
        for r in ("r1", "r2")
        if plane.marks.is_retired(EpisodeId(rollout_id=r, attempt=1))
    ]


async def test_a_successful_restore_leaves_everyone_restored(tmp_path) -> None:  # type: ignore[no-untyped-def]
    directory = await _checkpoint(tmp_path, [R1])
    async with deployment() as d:
        replies = await d.coordinator.restore("r-1", soon(), directory, [R1])
        assert {reply.restored[0] for reply in replies.values()} == {"r1-a1"}
        assert all(plane.phase is Phase.RESTORED for plane in d.planes.values())
        assert d.ops("retire") == []
        await d.coordinator.renew("r-1", soon(60))
        await d.coordinator.resume("r-1", soon())
        assert all(plane.phase is Phase.IDLE for plane in d.planes.values())


async def test_a_restore_builds_and_encodes_one_request_for_every_participant(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    # Five participants restore the same scope: one request, checked and encoded once (D438).
    import coordinator._client as client_module
    import coordinator._fixed_order as fixed_order

    directory = await _checkpoint(tmp_path, [R1, R2])
    encoded: list[object] = []
    real = fixed_order.encode_wire

    def counting(model: Any) -> bytes:
        encoded.append(model)
        return real(model)

    monkeypatch.setattr(fixed_order, "encode_wire", counting)
    monkeypatch.setattr(client_module, "encode_wire", counting)
    async with deployment() as d:
        replies = await d.coordinator.restore("r-1", soon(), directory, [R1, R2])
        assert len(replies) == 5
        assert all(reply.restored == ["r1-a1", "r2-a1"] for reply in replies.values())
    assert [type(model).__name__ for model in encoded] == ["RestoreRequest"]


async def test_a_restore_request_no_participant_would_take_is_refused_before_anything_is_sent(
    tmp_path,
) -> None:  # type: ignore[no-untyped-def]
    directory = await _checkpoint(tmp_path, [R1])
    async with deployment() as d:
        with pytest.raises(InvalidRequestError, match="the restore request is malformed"):
            await d.coordinator.restore("r-1", float("nan"), directory, [R1])
        with pytest.raises(InvalidRequestError, match="the restore request is malformed"):
            await d.coordinator.restore("r-1", soon(), "", [R1])
        assert d.log == []  # no restore, no cleanup retire, no resume
        assert all(plane.phase is Phase.IDLE for plane in d.planes.values())
