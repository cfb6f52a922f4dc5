"""The coordinator of a several-worker server, with real workers on a real Unix socket, in-process."""

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
from protocols import (
    CheckpointCoordinatorUnavailableError,
    CheckpointError,
    CheckpointRequest,
    EpisodeId,
    InvalidCheckpointStateError,
    Phase,
    PrepareReport,
    RestoreRequest,
    RetireRequest,
)

from .fakes import FakeParticipant

pytestmark = pytest.mark.anyio


@dataclass
class Worker:
    fake: FakeParticipant
    member: FanoutShard
    stack: AsyncExitStack
    lost_fanout: list[bool]


class Server:
    """A coordinator with its plane, and workers that join and leave on demand."""

    def __init__(self, coordinator: ProcessFanout, plane: ControlPlane, path: Path) -> None:
        self.coordinator = coordinator
        self.plane = plane
        self.path = path
        self.workers: dict[int, Worker] = {}

    async def join(self, pid: int, slot: int) -> Worker:
        fake = FakeParticipant()
        local = ControlPlane(fake)
        lost: list[bool] = []
        member = FanoutShard(
            local,
            slot=slot,
            socket_path=self.path,
            pid=pid,
            on_fanout_lost=lambda: lost.append(True),
        )
        stack = AsyncExitStack()
        await stack.enter_async_context(member.running())
        worker = Worker(fake, member, stack, lost)
        self.workers[pid] = worker
        await wait_for(
            lambda: (
                pid in self.coordinator.workers and self.coordinator.workers[pid].report is not None
            )
        )
        return worker

    async def stop(self, pid: int) -> None:
        await self.workers.pop(pid).stack.aclose()

    async def lose(self, pid: int) -> None:
        """The worker vanishes without a word (as under SIGKILL)."""
        worker = self.workers.pop(pid)
        await worker.member.channel.aclose()
        await wait_for(lambda: pid not in self.coordinator.workers)
        worker.member._stopping = True  # the test owns it now; let its context exit quietly
        await worker.stack.aclose()


async def wait_for(condition: object, within: float = 10.0) -> None:
    with anyio.fail_after(within):
        while not condition():  # type: ignore[operator]  # noqa: ASYNC110 - polls another task's state
            await anyio.sleep(0.01)


@asynccontextmanager
async def server(
    tmp_path: Path, expected: int = 2, placement: Placement = "slot"
) -> AsyncIterator[Server]:
    coordinator = ProcessFanout("environment", "fake", expected=expected, placement=placement)
    plane = ControlPlane(coordinator)
    path = tmp_path / "c.sock"
    listener = await listen_private(path)
    async with plane.running(), anyio.create_task_group() as group:
        group.start_soon(coordinator.serve, listener, plane)
        made = Server(coordinator, plane, path)
        try:
            yield made
        finally:
            for pid in reversed(list(made.workers)):  # LIFO: their task groups nest
                await made.stop(pid)
            group.cancel_scope.cancel()
    await listener.aclose()


def request(checkpoint_id: str = "c1", seconds: float = 20.0) -> CheckpointRequest:
    return CheckpointRequest(checkpoint_id=checkpoint_id, deadline_ts=time.time() + seconds)


async def test_the_socket_is_private_to_its_owner(tmp_path: Path) -> None:
    async with server(tmp_path) as made:
        assert made.path.stat().st_mode & 0o777 == 0o600


async def test_prepare_closes_every_worker_and_waits_for_all(tmp_path: Path) -> None:
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
            await anyio.sleep(0.6)  # past a report poll: still waiting for worker b's episode
            assert not replies
            b.fake.end_step("r1")
        assert replies[0].phase is Phase.PREPARED
        assert replies[0].report.counts["workers"] == 2
        assert replies[0].report.counts["episodes"] == 1


async def test_unreported_workers_block_and_a_late_joiner_closes_at_once(tmp_path: Path) -> None:
    async with server(tmp_path) as made:
        await made.join(101, 0)
        reply = await made.plane.prepare(request(seconds=0.5))
        assert reply.phase is Phase.PREPARING
        assert "environment-workers-unreported:1" in reply.report.blockers
        late = await made.join(102, 1)
        assert not late.fake.admission_open  # closed at once: a checkpoint is open
        reply = await made.plane.prepare(request())
        assert reply.phase is Phase.PREPARED


async def test_retire_marks_reach_workers_that_join_later(tmp_path: Path) -> None:
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


async def test_a_worker_lost_while_closed_blocks_until_resume_with_a_warning(
    tmp_path: Path,
) -> None:
    async with server(tmp_path) as made:
        await made.join(101, 0)
        await made.join(102, 1)
        assert (await made.plane.prepare(request())).phase is Phase.PREPARED
        with capture_logs() as logs:
            await made.lose(102)
        lost = [e for e in logs if e["event"] == "worker.lost"]
        assert lost and lost[0]["log_level"] == "warning" and lost[0]["pid"] == 102
        assert lost[0]["open_checkpoint_can_commit"] is False
        report = made.coordinator.readiness()
        assert "environment-worker-lost" in report.blockers and not report.ready
        await made.join(103, 1)  # a replacement does not make the lost share come back
        assert "environment-worker-lost" in made.coordinator.readiness().blockers
        with pytest.raises(InvalidCheckpointStateError, match="102"):
            await made.coordinator.export(None)
        await made.plane.resume(request())
        assert "environment-worker-lost" not in made.coordinator.readiness().blockers


async def test_a_clean_stop_is_not_reported_as_lost(tmp_path: Path) -> None:
    async with server(tmp_path) as made:
        await made.join(101, 0)
        with capture_logs() as logs:
            await made.stop(101)
            await wait_for(lambda: 101 not in made.coordinator.workers)
        events = [e["event"] for e in logs]
        assert "worker.stopped" in events and "worker.lost" not in events
        assert made.coordinator.lost_since_start == 0


async def test_a_worker_that_loses_its_coordinator_stops_itself(tmp_path: Path) -> None:
    async with server(tmp_path) as made:
        worker = await made.join(101, 0)
        await made.coordinator.workers[101].channel.aclose()
        await wait_for(lambda: worker.lost_fanout == [True])
        worker.member._stopping = True
        made.workers.pop(101)
        await worker.stack.aclose()


async def test_workers_join_with_counts_in_the_log(tmp_path: Path) -> None:
    async with server(tmp_path) as made:
        with capture_logs() as logs:
            await made.join(101, 0)
            await made.join(102, 1)
        joined = [
            (e["pid"], e["connected"], e["expected"]) for e in logs if e["event"] == "worker.joined"
        ]
        assert joined == [(101, 1, 2), (102, 2, 2)]


async def test_restore_refuses_when_any_worker_has_served(tmp_path: Path) -> None:
    async with server(tmp_path) as made:
        await made.join(101, 0)
        served = await made.join(102, 1)
        served.fake.start(EpisodeId(rollout_id="r1"))
        await wait_for(lambda: made.coordinator.workers[102].served)
        restore = RestoreRequest(
            checkpoint_id="c9",
            deadline_ts=time.time() + 10,
            checkpoint_dir=str(tmp_path / "none"),
            episode_ids=[],
        )
        with pytest.raises(CheckpointError, match="served"):
            await made.plane.restore(restore)


async def test_a_restored_episode_is_claimed_by_exactly_one_worker(tmp_path: Path) -> None:
    async with server(tmp_path, placement="claim") as made:
        a = await made.join(101, 0)
        b = await made.join(102, 1)
        episode = EpisodeId(rollout_id="r1")
        record = {"episode_id": episode.model_dump(), "step": 3}
        await made.coordinator.install([record], [episode])
        key = episode.next_attempt().capture_key
        assert key in a.fake.restored and key in b.fake.restored
        wins: list[bool] = []
        async with anyio.create_task_group() as group:
            for worker in (a, b):

                async def claim(member: FanoutShard = worker.member) -> None:
                    wins.append(await member.claim(key))

                group.start_soon(claim)
        assert sorted(wins) == [False, True]
        assert [key in w.fake.restored for w in (a, b)].count(True) == 1
        assert not await a.member.claim(key)  # a later claim never wins again


async def test_slot_placement_puts_each_record_on_one_worker(tmp_path: Path) -> None:
    async with server(tmp_path) as made:
        a = await made.join(101, 0)
        b = await made.join(102, 1)
        episodes = [EpisodeId(rollout_id=f"r{n}") for n in range(8)]
        records = [{"episode_id": e.model_dump(), "step": 1} for e in episodes]
        await made.coordinator.install(records, episodes)
        held = sorted([*a.fake.restored, *b.fake.restored])
        assert held == sorted(e.next_attempt().capture_key for e in episodes)
        assert a.fake.restored and b.fake.restored


async def test_an_unclaimed_record_is_exported_once(tmp_path: Path) -> None:
    async with server(tmp_path, placement="claim") as made:
        await made.join(101, 0)
        await made.join(102, 1)
        episode = EpisodeId(rollout_id="r1")
        await made.coordinator.install([{"episode_id": episode.model_dump(), "step": 2}], [episode])
        await made.coordinator.close_admission(request())
        records = await made.coordinator.export(None)
        assert [r["episode_id"]["attempt"] for r in records] == [1]


async def test_reports_of_an_older_generation_or_sequence_are_ignored(tmp_path: Path) -> None:
    async with server(tmp_path) as made:
        await made.join(101, 0)
        await made.join(102, 1)
        await made.coordinator.close_admission(request())
        state = made.coordinator.workers[101]
        blocked = PrepareReport(
            ready=False, blockers=["r9"], blocker_count=1, counts={}, restarts=[]
        )
        stale = {
            "generation": made.coordinator.generation - 1,
            "seq": state.seq + 100,
            "report": blocked.model_dump_json(),
            "served": False,
            "restored_pending": [],
            "extra": {},
        }
        made.coordinator._take_report(state, stale)
        assert made.coordinator.readiness().ready
        made.coordinator._take_report(
            state, {**stale, "generation": made.coordinator.generation, "seq": 0}
        )
        assert made.coordinator.readiness().ready
        made.coordinator._take_report(state, {**stale, "generation": made.coordinator.generation})
        assert made.coordinator.readiness().blockers == ["r9"]


def restore_request(seconds: float) -> RestoreRequest:
    return RestoreRequest(
        checkpoint_id="r1",
        deadline_ts=time.time() + seconds,
        checkpoint_dir="/unused",
        episode_ids=[],
    )


async def test_health_is_ready_only_once_every_slot_has_a_worker(tmp_path: Path) -> None:
    async with server(tmp_path) as made:
        await made.join(101, 0)
        assert made.coordinator.health() == {
            "ready": False,
            "workers": 1,
            "expected": 2,
            "missing_slots": [1],
        }
        await made.join(102, 1)
        assert made.coordinator.health()["ready"] is True


async def test_a_restore_waits_for_workers_still_joining(tmp_path: Path) -> None:
    async with server(tmp_path) as made:
        a = await made.join(101, 1)
        episode = EpisodeId(rollout_id="r1")
        records = [{"episode_id": episode.model_dump(), "step": 1}]
        await made.coordinator.close_admission(restore_request(10))
        installed = anyio.Event()

        async def install() -> None:
            await made.coordinator.install(records, [episode])
            installed.set()

        made.plane.task_group.start_soon(install)  # outlives the join below (LIFO scopes)
        await anyio.sleep(0.3)
        assert not installed.is_set()  # slot 0 has no worker yet: waiting, not refused
        b = await made.join(102, 0)
        with anyio.fail_after(5):
            await installed.wait()
        key = episode.next_attempt().capture_key
        assert key in a.fake.restored or key in b.fake.restored


async def test_a_restore_still_missing_a_worker_at_its_deadline_is_retryable(
    tmp_path: Path,
) -> None:
    async with server(tmp_path) as made:
        await made.join(101, 1)
        await made.coordinator.close_admission(restore_request(0.5))
        with pytest.raises(CheckpointCoordinatorUnavailableError, match=r"slot \[0\]") as caught:
            await made.coordinator.install([], [])
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
        await made.coordinator.close_admission(request())
        records = await made.coordinator.export(None)
        assert sorted(r["session_id"] for r in records) == ["s-restored", "s-seeded"]
