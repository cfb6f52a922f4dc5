"""The environment participant: episodes, boundaries, parking, export, restore and retire."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from participants import EpisodeOutcome
from protocols import (
    AdmissionClosedError,
    CheckpointError,
    EpisodeId,
    InvalidCheckpointStateError,
    Phase,
    RestoreRequest,
    RetireRequest,
    StaleAttemptError,
    task_digest,
)

from .environment_fakes import Env, ScriptedPeers, environment, ep, settle, soon, task
from .fakes import WindDown

pytestmark = pytest.mark.anyio


async def test_an_episode_seeds_runs_each_activation_verifies_and_returns(tmp_path: Path) -> None:
    async with environment(tmp_path) as env:
        env.start("r1")
        outcome = await env.outcome("r1")
    assert outcome == EpisodeOutcome(result={"reward": 0.42, "model_calls": 4, "tool_calls": 4})
    assert env.peers.calls == [
        ("seed_resources", "r1", task()["task_input"]),
        ("seed_agent", "r1", "s1"),
        ("activate", "r1", 1),
        ("activate", "r1", 2),
        ("verify", "r1", "s1"),
        ("close", "r1", "s1"),
    ]
    assert env.participant.steps.episodes == {}


async def test_a_new_run_is_refused_while_a_checkpoint_is_open(tmp_path: Path) -> None:
    async with environment(tmp_path) as env:
        assert await env.prepare("c1") is Phase.PREPARED
        with pytest.raises(AdmissionClosedError):
            await env.participant.run(ep("r1"), task())
        await env.resume("c1")
        env.start("r1")
        assert (await env.outcome("r1")).result is not None


async def test_a_replay_step_does_not_block_prepare_and_parks_at_its_next_boundary(
    tmp_path: Path,
) -> None:
    async with environment(tmp_path) as env:
        env.peers.hold("activate")
        env.start("r1")
        await env.peers.entered["activate"].wait()
        assert await env.prepare("c1") is Phase.PREPARED
        (record,) = await env.commit("c1", ["r1"])
        assert record["boundary"]["next"] == "invoke_agent"
        assert record["boundary"]["activation"] == 1
        assert record["task_digest"] == task_digest(task())
        env.peers.release("activate")
        await settle()
        # The activation returned while closed: the episode parks at the next boundary.
        assert env.participant.steps.episodes["r1"].state == "parked"
        assert env.participant.steps.episodes["r1"].boundary["activation"] == 2  # type: ignore[index]
        assert env.peers.names().count("activate") == 1
        await env.resume("c1")
        assert (await env.outcome("r1")).result is not None
        assert env.peers.names().count("activate") == 2


async def test_a_wait_step_blocks_prepare_until_it_has_finished(tmp_path: Path) -> None:
    async with environment(tmp_path, ScriptedPeers(verify_mode="wait")) as env:
        env.peers.hold("verify")
        env.start("r1")
        await env.peers.entered["verify"].wait()
        assert await env.prepare("c1", seconds=0.2) is Phase.PREPARING
        assert env.participant.readiness().blockers == ["r1"]
        env.peers.release("verify")
        assert await env.prepare("c1") is Phase.PREPARED
        (record,) = await env.commit("c1", ["r1"])
        assert record["boundary"]["next"] == "return"
        assert record["boundary"]["reward"] == 0.42
        await env.resume("c1")
        assert (await env.outcome("r1")).result["reward"] == 0.42


async def test_a_replay_verify_does_not_block_prepare(tmp_path: Path) -> None:
    async with environment(tmp_path, ScriptedPeers(verify_mode="replay")) as env:
        env.peers.hold("verify")
        env.start("r1")
        await env.peers.entered["verify"].wait()
        assert await env.prepare("c1") is Phase.PREPARED
        (record,) = await env.commit("c1", ["r1"])
        assert record["boundary"]["next"] == "verify"
        env.peers.release("verify")
        await env.resume("c1")
        assert (await env.outcome("r1")).result is not None


async def test_an_episode_in_its_first_replay_step_is_exported_without_a_boundary(
    tmp_path: Path,
) -> None:
    async with environment(tmp_path) as env:
        env.peers.hold("seed_agent")
        env.start("r1")
        await env.peers.entered["seed_agent"].wait()
        assert await env.prepare("c1") is Phase.PREPARED
        (record,) = await env.commit("c1", None)
        assert record["boundary"] is None
        env.peers.release("seed_agent")
        await env.resume("c1")
        await env.outcome("r1")


async def test_a_scoped_export_names_each_episode_as_an_unscoped_one_does(tmp_path: Path) -> None:
    """D425: with a scope, a record's episode id is the scope's attempt, dumped as before."""
    async with environment(tmp_path) as env:
        env.peers.hold("activate")
        for key in ("r1", "r2", "r3"):
            env.start(key)
        await env.peers.entered["activate"].wait()
        await settle()
        assert await env.prepare("c1") is Phase.PREPARED
        everything = await env.participant.export(None)
        scoped = await env.participant.export([ep("r3"), ep("r1")])
        assert [r["episode_id"] for r in everything] == [
            EpisodeId(rollout_id=key).model_dump() for key in ("r1", "r2", "r3")
        ]
        assert scoped == [everything[0], everything[2]]
        env.peers.release("activate")
        await env.resume("c1")


async def _checkpoint_mid_activation(env: Env) -> None:
    env.peers.hold("activate")
    env.start("r1")
    await env.peers.entered["activate"].wait()
    env.peers.release("activate")
    env.peers.hold("activate")  # the second activation is in flight at the checkpoint
    await env.peers.entered["activate"].wait()
    assert await env.prepare("c1") is Phase.PREPARED
    await env.commit("c1", ["r1"])


async def _restore_and_resume(env: Env, tmp_path: Path) -> None:
    """Restore ``r1`` from checkpoint ``c1`` under ``tmp_path``, then resume."""
    await env.plane.restore(
        RestoreRequest(
            checkpoint_id="r-1",
            deadline_ts=soon(),
            checkpoint_dir=str(tmp_path / "c1"),
            episode_ids=[ep("r1")],
        )
    )
    await env.resume("r-1")


async def test_a_restored_episode_continues_from_its_boundary_as_the_next_attempt(
    tmp_path: Path,
) -> None:
    async with environment(tmp_path) as first:
        await _checkpoint_mid_activation(first)
    fresh = ScriptedPeers()
    async with environment(tmp_path, fresh) as second:
        reply = await second.plane.restore(
            RestoreRequest(
                checkpoint_id="r-1",
                deadline_ts=soon(),
                checkpoint_dir=str(tmp_path / "c1"),
                episode_ids=[ep("r1")],
            )
        )
        assert reply.restored == ["r1-a1"]
        # Only after the resume that follows the restore; the crashed attempt is fenced.
        with pytest.raises(AdmissionClosedError):
            await second.participant.run(ep("r1-a1"), task())
        await second.resume("r-1")
        with pytest.raises(StaleAttemptError):
            await second.participant.run(ep("r1"), task())
        second.start("r1-a1")
        outcome = await second.outcome("r1-a1")
    assert outcome.result == {"reward": 0.42, "model_calls": 4, "tool_calls": 4}
    # No re-seed; the new capture key; the resources session from the boundary.
    assert fresh.calls == [
        ("activate", "r1-a1", 2),
        ("verify", "r1-a1", "s1"),
        ("close", "r1-a1", "s1"),
    ]


async def test_restored_records_are_carried_into_a_later_commit_only_when_in_scope(
    tmp_path: Path,
) -> None:
    async with environment(tmp_path) as first:
        await _checkpoint_mid_activation(first)
    async with environment(tmp_path) as second:
        await _restore_and_resume(second, tmp_path)
        assert await second.prepare("c2") is Phase.PREPARED
        (record,) = await second.commit("c2", ["r1-a1"])
        assert record["episode_id"] == {"rollout_id": "r1", "attempt": 1}
        assert record["boundary"]["activation"] == 2
        await second.resume("c2")
        assert await second.prepare("c3") is Phase.PREPARED
        assert await second.commit("c3", ["other"]) == []
        assert second.participant.restored_pending() == []  # deleted: left out of the scope


async def test_a_restored_key_sent_with_another_task_is_refused(tmp_path: Path) -> None:
    async with environment(tmp_path) as first:
        await _checkpoint_mid_activation(first)
    async with environment(tmp_path) as second:
        await _restore_and_resume(second, tmp_path)
        with pytest.raises(CheckpointError, match="different task"):
            await second.participant.run(ep("r1-a1"), task(activations=3))
        assert second.participant.restored_pending() == [ep("r1-a1")]
        assert second.peers.calls == []


async def test_retire_cancels_a_running_episode_and_refuses_it_afterwards(tmp_path: Path) -> None:
    async with environment(tmp_path) as env:
        env.peers.hold("activate")
        env.start("r1")
        await env.peers.entered["activate"].wait()
        await env.plane.retire(
            RetireRequest(checkpoint_id="retire", deadline_ts=soon(), episode_ids=[ep("r1")])
        )
        assert isinstance(await env.outcome("r1"), StaleAttemptError)
        assert env.participant.steps.episodes == {}
        with pytest.raises(StaleAttemptError):
            await env.participant.run(ep("r1"), task())
        env.peers.release("activate")
        env.start("r1-a1")
        assert (await env.outcome("r1-a1")).result is not None
    assert "close" not in env.peers.names("r1")  # cancelled, not cleaned up by the episode


class _WindingDown(ScriptedPeers):
    """Activations held by a :class:`WindDown`."""

    def __init__(self) -> None:
        super().__init__()
        self.wind_down = WindDown()

    async def activate(self, key: str, activation: int) -> dict[str, Any]:
        await self.wind_down.hold(key)
        raise AssertionError("unreachable")


async def test_a_retire_cancels_every_episode_of_its_batch_before_it_waits_for_one(
    tmp_path: Path,
) -> None:
    """D412: stopped one after another, each episode's wind-down cost the retire a few turns of
    a loop that took seconds a turn at 4,000 in flight."""
    peers = _WindingDown()
    keys = [f"r{i}" for i in range(10)]
    async with environment(tmp_path, peers) as env:
        for key in keys:
            env.start(key)
        await settle()
        assert set(env.participant.steps.episodes) == set(keys)
        env.group.start_soon(env.participant.retire_many, [ep(key) for key in keys])
        try:
            await settle()
            # Every episode is winding down at once, before the retire waits for the first.
            assert sorted(peers.wind_down.cancelled) == sorted(keys)
        finally:
            peers.wind_down.released.set()  # the shielded wind-downs must end, or a test hangs
        for key in keys:
            assert isinstance(await env.outcome(key), StaleAttemptError)
    assert env.participant.steps.episodes == {}


async def test_a_running_key_is_refused(tmp_path: Path) -> None:
    async with environment(tmp_path) as env:
        env.peers.hold("activate")
        env.start("r1")
        await env.peers.entered["activate"].wait()
        with pytest.raises(CheckpointError, match="already running"):
            await env.participant.run(ep("r1"), task())
        env.peers.release("activate")
        assert (await env.outcome("r1")).result is not None


async def test_install_checks_every_record_before_installing_any(tmp_path: Path) -> None:
    good = {
        "episode_id": {"rollout_id": "r1", "attempt": 0},
        "task_digest": "a" * 64,
        "boundary": None,
    }
    bad = {**good, "episode_id": {"rollout_id": "r2", "attempt": 0}, "boundary": {"next": "fly"}}
    async with environment(tmp_path) as env:
        with pytest.raises(InvalidCheckpointStateError):
            await env.participant.install([good, bad], [ep("r1"), ep("r2")])
        assert env.participant.restored == {}
        assert not env.participant.awaiting_resume
        await env.participant.install([good], [ep("r1")])
        assert env.participant.restored_pending() == [ep("r1-a1")]
        with pytest.raises(CheckpointError, match="without live episodes"):
            await env.participant.install([good], [ep("r1")])


async def test_a_restart_episode_never_blocks_parks_or_exports(tmp_path: Path) -> None:
    async with environment(tmp_path, ScriptedPeers(restart=True, verify_mode="wait")) as env:
        env.peers.hold("verify")
        env.start("r1")
        await env.peers.entered["verify"].wait()
        assert await env.prepare("c1") is Phase.PREPARED
        assert env.participant.readiness().restarts == ["r1"]
        assert await env.commit("c1", None) == []
        env.peers.release("verify")
        assert (await env.outcome("r1")).result is not None  # it ran on through the checkpoint
        await env.resume("c1")


async def test_a_failing_replay_step_while_closed_exports_no_boundary_and_reports_after_resume(
    tmp_path: Path,
) -> None:
    async with environment(tmp_path) as env:
        env.peers.hold("activate")
        env.start("r1")
        await env.peers.entered["activate"].wait()
        assert await env.prepare("c1") is Phase.PREPARED
        env.peers.refuse["activate"] = RuntimeError("agent vanished")
        env.peers.release("activate")
        await settle()
        assert "r1" not in env.outcomes  # no episode finishes while the checkpoint is open
        assert env.participant.ready()
        (record,) = await env.commit("c1", ["r1"])
        assert record["boundary"] is None  # starts over from its input after a crash
        await env.resume("c1")
        outcome = await env.outcome("r1")
    assert outcome.failure == {"code": "internal_error", "detail": "agent vanished"}


@pytest.mark.parametrize("verify_mode", ["replay", "wait"])
async def test_a_verify_in_flight_at_the_checkpoint_is_rerun_after_restore_only_in_replay_mode(
    tmp_path: Path, verify_mode: str
) -> None:
    async with environment(tmp_path, ScriptedPeers(verify_mode=verify_mode)) as first:
        first.peers.hold("verify")
        first.start("r1")
        await first.peers.entered["verify"].wait()
        if verify_mode == "wait":  # the verify holds prepare until it has finished
            assert await first.prepare("c1", seconds=0.2) is Phase.PREPARING
            first.peers.release("verify")
        assert await first.prepare("c1") is Phase.PREPARED
        await first.commit("c1", ["r1"])  # the crash comes before any resume
    fresh = ScriptedPeers(verify_mode=verify_mode)
    async with environment(tmp_path, fresh) as second:
        await _restore_and_resume(second, tmp_path)
        second.start("r1-a1")
        assert (await second.outcome("r1-a1")).result["reward"] == 0.42
    assert "seed_resources" not in fresh.names()  # continued from the checkpoint, not rerun
    assert ("verify" in fresh.names("r1-a1")) is (verify_mode == "replay")


async def test_a_worker_refuses_a_restored_run_while_closed_without_asking_the_fan_out(
    tmp_path: Path,
) -> None:
    """A shard of a server with several workers claims a restored key from its fan-out, which
    refuses every claim while a checkpoint is open; the shard knows it is closed, so a retried
    run is refused on the spot, with no claim sent (D400)."""
    async with environment(tmp_path) as first:
        await _checkpoint_mid_activation(first)
    async with environment(tmp_path) as second:
        await _restore_and_resume(second, tmp_path)
        claims: list[str] = []

        async def claim(key: str) -> bool:
            claims.append(key)
            if not second.participant.steps.accepting:
                raise AdmissionClosedError(
                    "a checkpoint is open; claim restored state after resume"
                )
            return True

        second.participant.claim_restored = claim
        assert await second.prepare("c2") is Phase.PREPARED
        for _ in range(3):
            with pytest.raises(AdmissionClosedError):
                await second.participant.run(ep("r1-a1"), task())
        assert claims == []
        assert second.participant.restored_pending() == [ep("r1-a1")]
        await second.resume("c2")
        second.start("r1-a1")
        outcome = await second.outcome("r1-a1")
    assert claims == ["r1-a1"]
    assert outcome.result == {"reward": 0.42, "model_calls": 4, "tool_calls": 4}
