"""The environment through checkpoints: finishing, re-closing, restarts, served processes, deadlines.

Each test names one rule of control-plane §2.5 / §4.1 / §7 that the issue's "done when" list asks
for; the scripted peers hold calls so that every interleaving is chosen, never timed.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from participants import ManualClock
from protocols import (
    CheckpointError,
    CheckpointRequest,
    Phase,
    RestartInScopeError,
    RestoreRequest,
    RetireRequest,
)

from .environment_fakes import Env, ScriptedPeers, environment, ep, settle, soon

pytestmark = pytest.mark.anyio


async def test_an_episode_finishing_during_prepare_is_neither_lost_nor_redone(
    tmp_path: Path,
) -> None:
    async with environment(tmp_path, ScriptedPeers(verify_mode="replay")) as env:
        env.peers.hold("close")  # r1 will be in its final clean-up when prepare starts
        env.start("r1")
        await env.peers.entered["close"].wait()
        env.peers.hold("verify")  # r2 will be in a replay verify
        env.start("r2")
        await env.peers.entered["verify"].wait()
        # Clean-up has no boundary to park at: it holds prepare until the episode has finished.
        assert await env.prepare("c1", seconds=0.2) is Phase.PREPARING
        assert env.participant.readiness().blockers == ["r1"]
        env.peers.release("close")
        assert await env.prepare("c1") is Phase.PREPARED
        finished = {key for key, outcome in env.outcomes.items() if outcome.result is not None}
        exported = {record["episode_id"]["rollout_id"] for record in await env.commit("c1", None)}
        assert finished == {"r1"}
        assert exported == {"r2"}  # disjoint, and together every episode
        # While prepared nothing finishes: r2's verify returns and it parks at `return`.
        env.peers.release("verify")
        await settle()
        assert "r2" not in env.outcomes
        assert env.participant.steps.episodes["r2"].state == "parked"
        await env.resume("c1")
        assert (await env.outcome("r2")).result is not None
    for key in ("r1", "r2"):  # nothing of either episode ran twice
        assert env.peers.names(key) == [
            "seed_resources",
            "seed_agent",
            "activate",
            "activate",
            "verify",
            "close",
        ]


async def _park_at_second_activation(env: Env) -> None:
    env.peers.hold("activate")
    env.start("r1")
    await env.peers.entered["activate"].wait()
    assert await env.prepare("c1") is Phase.PREPARED
    env.peers.release("activate")
    await settle()
    assert env.participant.steps.episodes["r1"].state == "parked"


async def test_an_episode_woken_by_resume_stays_parked_if_a_new_checkpoint_closed_first(
    tmp_path: Path,
) -> None:
    async with environment(tmp_path) as env:
        await _park_at_second_activation(env)
        # Reopen and close again before the parked episode gets to run: neither call yields.
        await env.participant.open_admission()
        await env.participant.close_admission(
            CheckpointRequest(checkpoint_id="c2", deadline_ts=soon())
        )
        await settle()
        assert env.participant.steps.episodes["r1"].state == "parked"
        assert env.peers.names("r1").count("activate") == 1
        assert env.participant.ready()
        await env.resume("c1")  # the runtime's resume reopens for good
        assert (await env.outcome("r1")).result is not None
        assert env.peers.names("r1").count("activate") == 2


async def test_a_restart_never_blocks_is_reported_and_a_commit_naming_it_is_refused(
    tmp_path: Path,
) -> None:
    async with environment(tmp_path, ScriptedPeers(restart=True, verify_mode="wait")) as env:
        env.peers.hold("verify")  # a wait step: it would block prepare if it were not a restart
        env.start("r1")
        await env.peers.entered["verify"].wait()
        assert await env.prepare("c1") is Phase.PREPARED
        assert env.participant.readiness().restarts == ["r1"]
        with pytest.raises(RestartInScopeError):
            await env.commit("c1", ["r1"])
        assert await env.commit("c1", []) == []
        env.peers.release("verify")
        await env.resume("c1")
        assert (await env.outcome("r1")).result is not None


async def test_an_episode_becomes_a_restart_only_once_no_checkpoint_is_open(
    tmp_path: Path,
) -> None:
    async with environment(tmp_path, ScriptedPeers(restart=True, verify_mode="wait")) as env:
        env.peers.hold("seed_resources")
        env.start("r1")
        await env.peers.entered["seed_resources"].wait()
        assert await env.prepare("c1") is Phase.PREPARED
        env.peers.release("seed_resources")  # the seed reply says "restart" while closed
        await settle()
        # The sets stay fixed for this checkpoint: r1 is exported (from its input), not a restart.
        assert env.participant.readiness().restarts == []
        (record,) = await env.commit("c1", ["r1"])
        assert record["boundary"] is None
        env.peers.hold("verify")
        await env.resume("c1")
        await env.peers.entered["verify"].wait()
        assert env.participant.readiness().restarts == ["r1"]
        env.peers.release("verify")
        assert (await env.outcome("r1")).result is not None


async def test_retire_waits_for_an_episode_in_its_final_clean_up(tmp_path: Path) -> None:
    async with environment(tmp_path) as env:
        env.peers.hold("close")
        env.start("r1")
        await env.peers.entered["close"].wait()
        retired = anyio.Event()

        async def retire() -> None:
            await env.plane.retire(
                RetireRequest(checkpoint_id="retire", deadline_ts=soon(), episode_ids=[ep("r1")])
            )
            retired.set()

        env.group.start_soon(retire)
        await settle()
        assert not retired.is_set()
        assert env.participant.readiness().blockers == ["r1"]
        env.peers.release("close")
        with anyio.fail_after(10):
            await retired.wait()
        # Not cancelled: the result it already had is delivered.
        assert (await env.outcome("r1")).result is not None
        assert env.participant.steps.episodes == {}


async def test_restore_into_a_process_that_already_served_is_refused(tmp_path: Path) -> None:
    async with environment(tmp_path) as first:
        await _park_at_second_activation(first)
        await first.commit("c1", ["r1"])
    async with environment(tmp_path) as second:
        second.start("r9")  # this process serves (and finishes) one episode
        assert (await second.outcome("r9")).result is not None
        assert second.participant.steps.episodes == {}
        with pytest.raises(CheckpointError):
            await second.plane.restore(
                RestoreRequest(
                    checkpoint_id="r-1",
                    deadline_ts=soon(),
                    checkpoint_dir=str(tmp_path / "c1"),
                    episode_ids=[ep("r1")],
                )
            )
        assert second.participant.restored_pending() == []
        second.start("r8")  # left idle and open
        assert (await second.outcome("r8")).result is not None


async def test_a_restored_episode_admitted_while_closed_never_blocks_the_checkpoint(
    tmp_path: Path,
) -> None:
    # The replacement's /run may arrive while a later checkpoint is open: it stands at its
    # restored boundary, so readiness must not regress, not even for one scheduling step.
    async with environment(tmp_path) as first:
        await _park_at_second_activation(first)
        await first.commit("c1", ["r1"])
    async with environment(tmp_path) as second:
        await second.plane.restore(
            RestoreRequest(
                checkpoint_id="r-1",
                deadline_ts=soon(),
                checkpoint_dir=str(tmp_path / "c1"),
                episode_ids=[ep("r1")],
            )
        )
        await second.resume("r-1")
        assert await second.prepare("c2") is Phase.PREPARED
        seen: list[bool] = []
        notify = second.participant.changes.notify

        def notify_and_record() -> None:
            seen.append(second.participant.ready())
            notify()

        second.participant.changes.notify = notify_and_record  # type: ignore[method-assign]
        second.start("r1-a1")
        await settle()
        assert seen and all(seen), seen
        assert second.participant.steps.episodes["r1-a1"].state == "parked"
        (record,) = await second.commit("c2", ["r1-a1"])  # still ready: the commit goes ahead
        assert record["boundary"]["next"] == "invoke_agent"
        await second.resume("c2")
        assert (await second.outcome("r1-a1")).result is not None
    assert second.peers.names("r1-a1") == ["activate", "verify", "close"]


async def test_the_episode_deadline_stops_while_a_checkpoint_holds_the_episode(
    tmp_path: Path,
) -> None:
    clock = ManualClock()
    async with environment(tmp_path, episode_seconds=10.0, clock=clock) as env:
        env.peers.hold("activate")
        env.start("r1")
        await env.peers.entered["activate"].wait()
        clock.advance(6.0)  # running: counted
        assert await env.prepare("c1") is Phase.PREPARED
        clock.advance(500.0)  # in a replay step while closed: not counted
        env.peers.release("activate")
        env.peers.hold("activate")
        await settle()
        assert env.participant.steps.episodes["r1"].state == "parked"
        clock.advance(500.0)  # parked: not counted
        await settle()
        assert "r1" not in env.outcomes
        await env.resume("c1")
        await env.peers.entered["activate"].wait()  # activation 2, with 4 s left
        clock.advance(3.5)
        await settle()
        assert "r1" not in env.outcomes
        clock.advance(0.5)
        outcome = await env.outcome("r1")
    assert outcome.failure is not None
    assert outcome.failure["code"] == "deadline_exceeded"
    assert env.peers.names("r1")[-1] == "close"  # its sessions are still freed


async def test_an_episode_out_of_time_during_prepare_parks_before_it_reports(
    tmp_path: Path,
) -> None:
    clock = ManualClock()
    peers = ScriptedPeers(verify_mode="wait")
    async with environment(tmp_path, peers, episode_seconds=10.0, clock=clock) as env:
        env.peers.hold("verify")  # a wait step blocks prepare and keeps counting
        env.start("r1")
        await env.peers.entered["verify"].wait()
        assert await env.prepare("c1", seconds=0.2) is Phase.PREPARING
        clock.advance(10.0)
        assert await env.prepare("c1") is Phase.PREPARED
        assert "r1" not in env.outcomes  # no episode finishes while a checkpoint is open
        (record,) = await env.commit("c1", ["r1"])
        assert record["boundary"]["next"] == "verify"  # the boundary before the cancelled step
        await env.resume("c1")
        outcome = await env.outcome("r1")
    assert outcome.failure is not None
    assert outcome.failure["code"] == "deadline_exceeded"
