"""A retire request reaches a participant as one batch, and each pays its I/O once (D389).

After a crash the controller retires every logged attempt it does not continue: hundreds or
thousands in one request. Sent one attempt at a time, each paid a pass over everything its
server tracks, a ledger transaction with its fsync, and (behind a fan-out) a round trip to every
shard: 653 retires against 3,165 restored keys took 21 s in one environment server, and the
policy server ran out of the retire's 30 s. These tests pin the batch, not a time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

from participants import ControlPlane, MemoryCaptureLedger, ModelParticipant, ModelTicket
from protocols import MAX_LEDGER_BATCH, EpisodeId, RetireRequest, RolloutRemoval
from tests.participants.fakes import FakeParticipant
from tests.participants.ledger_factory import commit
from tests.participants.test_fanout_group import server

pytestmark = pytest.mark.anyio


class _CountingLedger(MemoryCaptureLedger):
    """A real in-memory ledger that counts its retire calls (one transaction each on disk)."""

    def __init__(self) -> None:
        super().__init__()
        self.retire_calls = 0

    async def retire(self, rollout_ids: Sequence[str]) -> RolloutRemoval:
        self.retire_calls += 1
        return await super().retire(rollout_ids)


class _Recording(FakeParticipant):
    """The fake participant, noting each ``retire_many`` the runtime makes."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[list[str]] = []

    async def retire_many(self, episode_ids: Sequence[EpisodeId]) -> None:
        self.batches.append([episode.capture_key for episode in episode_ids])
        await super().retire_many(episode_ids)


def _retire(episodes: list[EpisodeId], seconds: float = 30.0) -> RetireRequest:
    return RetireRequest(
        checkpoint_id="retire-x", deadline_ts=time.time() + seconds, episode_ids=episodes
    )


async def test_the_runtime_hands_the_participant_the_whole_request_at_once() -> None:
    fake = _Recording()
    episodes = [EpisodeId(rollout_id=f"r{i}", attempt=i % 3) for i in range(40)]
    plane = ControlPlane(fake)
    async with plane.running():
        reply = await plane.retire(_retire(episodes))
    assert fake.batches == [[episode.capture_key for episode in episodes]]
    assert reply.retired == [episode.capture_key for episode in episodes]


async def test_the_model_retires_every_ledger_of_a_batch_in_a_few_transactions() -> None:
    ledger = _CountingLedger()
    aborted: list[tuple[str, list[str]]] = []

    async def aborter(backend: str, call_ids: list[str]) -> None:
        aborted.append((backend, call_ids))

    model = ModelParticipant(ledger, call_aborter=aborter)
    retired = [EpisodeId(rollout_id=f"r{i}", attempt=1) for i in range(300)]
    kept = EpisodeId(rollout_id="kept", attempt=1)
    for episode in [*retired[:5], kept]:
        await ledger.record(commit(episode.capture_key, 0, rollout=episode.rollout_id))
    # Restored attempts the batch covers and one it does not.
    model.restored_targets.update({"r7-a2", "r8-a1", "kept-a2"})
    tickets = [await model.admit(episode) for episode in (retired[3], retired[250], kept)]
    for ticket in tickets:
        ticket.backend = "http://worker/v1"

    async def generating(ticket: ModelTicket) -> None:
        with ticket.scope:
            await anyio.sleep_forever()
        model.gate.release(ticket)

    async with anyio.create_task_group() as group:
        for ticket in tickets:
            group.start_soon(generating, ticket)
        await anyio.lowlevel.checkpoint()
        await model.retire_many(retired)
        assert list(model.gate.tickets.values()) == [tickets[2]]  # only kept's call is left
        tickets[2].scope.cancel()
    # Keys 0..1 of each of 300 rollouts: one ledger transaction per MAX_LEDGER_BATCH keys.
    assert ledger.retire_calls == -(-600 // MAX_LEDGER_BATCH)
    # One abort per worker for the whole batch.
    assert aborted == [("http://worker/v1", [tickets[0].model_call_id, tickets[1].model_call_id])]
    assert model.restored_targets == {"r7-a2", "kept-a2"}
    assert (await ledger.manifest("kept-a1")).records


async def test_a_fanned_out_retire_is_one_message_to_each_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    batches: list[list[str]] = []
    retire_many = FakeParticipant.retire_many

    async def recording(self: FakeParticipant, episode_ids: Sequence[EpisodeId]) -> None:
        batches.append([episode.capture_key for episode in episode_ids])
        await retire_many(self, episode_ids)

    monkeypatch.setattr(FakeParticipant, "retire_many", recording)
    episodes = [EpisodeId(rollout_id=f"r{i}", attempt=1) for i in range(50)]
    async with server(tmp_path) as made:
        await made.join(101, 0)
        await made.join(102, 1)
        await made.plane.retire(_retire(episodes))
    keys = [episode.capture_key for episode in episodes]
    assert batches == [keys, keys]  # each shard got the whole batch once
