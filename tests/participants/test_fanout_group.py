"""The fan-out of a server with several processes, with real shards on a real Unix socket, in-process."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs

from participants import ControlPlane, FanoutShard, Placement, ProcessFanout, listen_private
from participants._fanout.messages import Readiness
from protocols import (
    CheckpointCoordinatorUnavailableError,
    CheckpointError,
    CheckpointRequest,
    EpisodeId,
    InvalidCheckpointStateError,
    InvalidRequestError,
    Phase,
    PrepareReport,
    RestoreRequest,
    RetireRequest,
)

from .fakes import FakeParticipant

pytestmark = pytest.mark.anyio


@dataclass
class Shard:
    fake: FakeParticipant
    shard: FanoutShard
    stack: AsyncExitStack
    lost_fanout: list[bool]


class Server:
    """A fan-out with its plane, and shards that join and leave on demand."""

    def __init__(self, fanout: ProcessFanout, plane: ControlPlane, path: Path) -> None:
        self.fanout = fanout
        self.plane = plane
        self.path = path
        self.shards: dict[int, Shard] = {}

    async def join(self, pid: int, slot: int) -> Shard:
        fake = FakeParticipant()
        local = ControlPlane(fake)
        lost: list[bool] = []
        shard = FanoutShard(
            local,
            slot=slot,
            socket_path=self.path,
            pid=pid,
            on_fanout_lost=lambda: lost.append(True),
        )
        stack = AsyncExitStack()
        await stack.enter_async_context(shard.running())
        joined = Shard(fake, shard, stack, lost)
        self.shards[pid] = joined
        await wait_for(
            lambda: pid in self.fanout.shards and self.fanout.shards[pid].report is not None
        )
        return joined

    async def stop(self, pid: int) -> None:
        await self.shards.pop(pid).stack.aclose()

    async def lose(self, pid: int) -> None:
        """The shard vanishes without a word (as under SIGKILL)."""
        lost = self.shards.pop(pid)
        await lost.shard.channel.aclose()
        await wait_for(lambda: pid not in self.fanout.shards)
        lost.shard._stopping = True  # the test owns it now; let its context exit quietly
        await lost.stack.aclose()


async def wait_for(condition: object, within: float = 10.0) -> None:
    with anyio.fail_after(within):
        while not condition():  # type: ignore[operator]  # noqa: ASYNC110 - polls another task's state
            await anyio.sleep(0.01)


@asynccontextmanager
async def server(
    tmp_path: Path, expected: int = 2, placement: Placement = "slot"
) -> AsyncIterator[Server]:
    fanout = ProcessFanout("environment", "fake", expected=expected, placement=placement)
    plane = ControlPlane(fanout)
    path = tmp_path / "c.sock"
    listener = await listen_private(path)
    async with plane.running(), anyio.create_task_group() as group:
        group.start_soon(fanout.serve, listener, plane)
        made = Server(fanout, plane, path)
        try:
            yield made
        finally:
            for pid in reversed(list(made.shards)):  # LIFO: their task groups nest
                await made.stop(pid)
            group.cancel_scope.cancel()
    await listener.aclose()


def request(checkpoint_id: str = "c1", seconds: float = 20.0) -> CheckpointRequest:
    return CheckpointRequest(checkpoint_id=checkpoint_id, deadline_ts=time.time() + seconds)


async def test_the_socket_is_private_to_its_owner(tmp_path: Path) -> None:
    async with server(tmp_path) as made:
        assert made.path.stat().st_mode & 0o777 == 0o600


async def test_prepare_closes_every_shard_and_waits_for_all(tmp_path: Path) -> None:
    async with server(tmp_path) as made:
        a = await made.join(101, 0)
        b = await made.join(102, 1)
        b.fake.start(EpisodeId(rollout_id="r1"))
        b.fake.begin_step("r1")
        replies = []
        async with anyio.create_task_group() as group:

            async def prepare() -> None:
                replies.append(await made.plane.prepare(request()))

            group.start_soon(prepare)
            await wait_for(lambda: not a.fake.admission_open and not b.fake.admission_open)
            await anyio.sleep(0.6)  # past a report poll: still waiting for shard b's episode
            assert not replies
            b.fake.end_step("r1")
        assert replies[0].phase is Phase.PREPARED
        assert replies[0].report.counts["workers"] == 2
        assert replies[0].report.counts["episodes"] == 1


async def test_unreported_shards_block_and_a_late_joiner_closes_at_once(tmp_path: Path) -> None:
    async with server(tmp_path) as made:
        await made.join(101, 0)
        reply = await made.plane.prepare(request(seconds=0.5))
        assert reply.phase is Phase.PREPARING
        assert "environment-workers-unreported:1" in reply.report.blockers
        late = await made.join(102, 1)
        assert not late.fake.admission_open  # closed at once: a checkpoint is open
        reply = await made.plane.prepare(request())
        assert reply.phase is Phase.PREPARED


async def test_retire_marks_reach_shards_that_join_later(tmp_path: Path) -> None:
    async with server(tmp_path) as made:
        early = await made.join(101, 0)
        episode = EpisodeId(rollout_id="r7", attempt=1)
        await made.plane.retire(
            RetireRequest(checkpoint_id="x", deadline_ts=time.time() + 10, episode_ids=[episode])
        )
        assert early.fake.marks.is_retired(episode)
        late = await made.join(102, 1)
        assert late.fake.marks.is_retired(episode)
        assert late.fake.marks.is_retired(EpisodeId(rollout_id="r7", attempt=0))


async def test_a_shard_lost_while_closed_blocks_until_resume_with_a_warning(
    tmp_path: Path,
) -> None:
    async with server(tmp_path) as made:
        await made.join(101, 0)
        await made.join(102, 1)
        assert (await made.plane.prepare(request())).phase is Phase.PREPARED
        with capture_logs() as logs:
            await made.lose(102)
        lost = [e for e in logs if e["event"] == "shard.lost"]
        assert lost and lost[0]["log_level"] == "warning" and lost[0]["pid"] == 102
        assert lost[0]["open_checkpoint_can_commit"] is False
        report = made.fanout.readiness()
        assert "environment-worker-lost" in report.blockers and not report.ready
        await made.join(103, 1)  # a replacement does not make the lost share come back
        assert "environment-worker-lost" in made.fanout.readiness().blockers
        with pytest.raises(InvalidCheckpointStateError, match="102"):
            await made.fanout.export(None)
        await made.plane.resume(request())
        assert "environment-worker-lost" not in made.fanout.readiness().blockers


async def test_a_clean_stop_is_not_reported_as_lost(tmp_path: Path) -> None:
    async with server(tmp_path) as made:
        await made.join(101, 0)
        with capture_logs() as logs:
            await made.stop(101)
            await wait_for(lambda: 101 not in made.fanout.shards)
        events = [e["event"] for e in logs]
        assert "shard.stopped" in events and "shard.lost" not in events
        assert made.fanout.lost_since_start == 0


async def test_a_shard_that_loses_its_fanout_stops_itself(tmp_path: Path) -> None:
    async with server(tmp_path) as made:
        joined = await made.join(101, 0)
        await made.fanout.shards[101].channel.aclose()
        await wait_for(lambda: joined.lost_fanout == [True])
        joined.shard._stopping = True
        made.shards.pop(101)
        await joined.stack.aclose()


async def test_shards_join_with_counts_in_the_log(tmp_path: Path) -> None:
    async with server(tmp_path) as made:
        with capture_logs() as logs:
            await made.join(101, 0)
            await made.join(102, 1)
        joined = [
            (e["pid"], e["connected"], e["expected"]) for e in logs if e["event"] == "shard.joined"
        ]
        assert joined == [(101, 1, 2), (102, 2, 2)]


async def test_restore_refuses_when_any_shard_has_served(tmp_path: Path) -> None:
    async with server(tmp_path) as made:
        await made.join(101, 0)
        served = await made.join(102, 1)
        served.fake.start(EpisodeId(rollout_id="r1"))
        await wait_for(lambda: made.fanout.shards[102].served)
        restore = RestoreRequest(
            checkpoint_id="c9",
            deadline_ts=time.time() + 10,
            checkpoint_dir=str(tmp_path / "none"),
            episode_ids=[],
        )
        with pytest.raises(CheckpointError, match="served"):
            await made.plane.restore(restore)


async def test_a_restored_episode_is_claimed_by_exactly_one_shard(tmp_path: Path) -> None:
    async with server(tmp_path, placement="claim") as made:
        a = await made.join(101, 0)
        b = await made.join(102, 1)
        episode = EpisodeId(rollout_id="r1")
        record = {"episode_id": episode.model_dump(), "step": 3}
        await made.fanout.install([record], [episode])
        key = episode.next_attempt().capture_key
        assert key in a.fake.restored and key in b.fake.restored
        wins: list[bool] = []
        async with anyio.create_task_group() as group:
            for joined in (a, b):

                async def claim(shard: FanoutShard = joined.shard) -> None:
                    wins.append(await shard.claim(key))

                group.start_soon(claim)
        assert sorted(wins) == [False, True]
        assert [key in w.fake.restored for w in (a, b)].count(True) == 1
        winner, loser = (a, b) if key in a.fake.restored else (b, a)
        assert not await loser.shard.claim(key)  # another shard's later claim never wins
        # The winner asking again (its answer lost, or its run refused) is answered yes (D401).
        assert await winner.shard.claim(key)
        assert key not in loser.fake.restored


async def test_slot_placement_puts_each_record_on_one_shard(tmp_path: Path) -> None:
    async with server(tmp_path) as made:
        a = await made.join(101, 0)
        b = await made.join(102, 1)
        episodes = [EpisodeId(rollout_id=f"r{n}") for n in range(8)]
        records = [{"episode_id": e.model_dump(), "step": 1} for e in episodes]
        await made.fanout.install(records, episodes)
        held = sorted([*a.fake.restored, *b.fake.restored])
        assert held == sorted(e.next_attempt().capture_key for e in episodes)
        assert a.fake.restored and b.fake.restored


async def test_an_unclaimed_record_is_exported_once(tmp_path: Path) -> None:
    async with server(tmp_path, placement="claim") as made:
        await made.join(101, 0)
        await made.join(102, 1)
        episode = EpisodeId(rollout_id="r1")
        await made.fanout.install([{"episode_id": episode.model_dump(), "step": 2}], [episode])
        await made.fanout.close_admission(request())
        records = await made.fanout.export(None)
        assert [r["episode_id"]["attempt"] for r in records] == [1]


async def test_reports_of_an_older_generation_or_sequence_are_ignored(tmp_path: Path) -> None:
    async with server(tmp_path) as made:
        await made.join(101, 0)
        await made.join(102, 1)
        await made.fanout.close_admission(request())
        state = made.fanout.shards[101]
        blocked = PrepareReport(
            ready=False, blockers=["r9"], blocker_count=1, counts={}, restarts=[]
        )
        stale = Readiness(
            generation=made.fanout.generation - 1,
            seq=state.seq + 100,
            report=blocked,
            served=False,
            restored_pending=[],
            extra={},
        )
        made.fanout._take_report(state, stale)
        assert made.fanout.readiness().ready
        made.fanout._take_report(
            state, stale.model_copy(update={"generation": made.fanout.generation, "seq": 0})
        )
        assert made.fanout.readiness().ready
        made.fanout._take_report(
            state, stale.model_copy(update={"generation": made.fanout.generation})
        )
        assert made.fanout.readiness().blockers == ["r9"]


def restore_request(seconds: float) -> RestoreRequest:
    return RestoreRequest(
        checkpoint_id="r1",
        deadline_ts=time.time() + seconds,
        checkpoint_dir="/unused",
        episode_ids=[],
    )


async def test_health_is_ready_only_once_every_slot_has_a_shard(tmp_path: Path) -> None:
    async with server(tmp_path) as made:
        await made.join(101, 0)
        assert made.fanout.health().model_dump() == {
            "ready": False,
            "workers": 1,
            "expected": 2,
            "missing_slots": [1],
        }
        await made.join(102, 1)
        assert made.fanout.health().ready is True


async def test_a_restore_waits_for_shards_still_joining(tmp_path: Path) -> None:
    async with server(tmp_path) as made:
        a = await made.join(101, 1)
        episode = EpisodeId(rollout_id="r1")
        records = [{"episode_id": episode.model_dump(), "step": 1}]
        await made.fanout.close_admission(restore_request(10))
        installed = anyio.Event()

        async def install() -> None:
            await made.fanout.install(records, [episode])
            installed.set()

        made.plane.task_group.start_soon(install)  # outlives the join below (LIFO scopes)
        await anyio.sleep(0.3)
        assert not installed.is_set()  # slot 0 has no shard yet: waiting, not refused
        b = await made.join(102, 0)
        with anyio.fail_after(5):
            await installed.wait()
        key = episode.next_attempt().capture_key
        assert key in a.fake.restored or key in b.fake.restored


async def test_a_restore_still_missing_a_shard_at_its_deadline_is_retryable(
    tmp_path: Path,
) -> None:
    async with server(tmp_path) as made:
        await made.join(101, 1)
        await made.fanout.close_admission(restore_request(0.5))
        with pytest.raises(CheckpointCoordinatorUnavailableError, match=r"slot \[0\]") as caught:
            await made.fanout.install([], [])
        assert caught.value.retryable


async def test_two_records_of_one_episode_are_both_exported(tmp_path: Path) -> None:
    async with server(tmp_path) as made:
        a = await made.join(101, 0)
        await made.join(102, 1)
        episode = EpisodeId(rollout_id="r1", attempt=1)
        held = [
            {"episode_id": episode.model_dump(), "session_id": "s-restored", "step": 0},
            {"episode_id": episode.model_dump(), "session_id": "s-seeded", "step": 1},
        ]

        async def export(episode_ids: Any) -> list[dict[str, Any]]:
            return [dict(record) for record in held]

        a.fake.export = export  # type: ignore[method-assign]
        await made.fanout.close_admission(request())
        records = await made.fanout.export(None)
        assert sorted(r["session_id"] for r in records) == ["s-restored", "s-seeded"]


async def test_a_shard_relays_control_calls_and_gathers_every_process_metrics(
    tmp_path: Path,
) -> None:
    async with server(tmp_path) as made:
        a = await made.join(101, 0)
        await made.join(102, 1)
        status = await a.shard.relay_control("status", b"")
        assert status["phase"] == "idle" and status["report"]["counts"]["workers"] == 2
        with pytest.raises(InvalidRequestError, match="unknown control operation 'nope'"):
            await a.shard.relay_control("nope", b"")
        with pytest.raises(InvalidRequestError, match="checkpoint_id"):
            await a.shard.relay_control("prepare", b'{"deadline_ts": 1.0}')
        metrics = await a.shard.gather_metrics()
        assert "midflight_checkpoint_phase" in metrics.main and len(metrics.shards) == 2
        assert (await a.shard.health()).ready
