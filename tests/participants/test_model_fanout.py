"""A model server with two shards, in-process on a real Unix socket and a shared ledger directory.

Undelivered calls are left out on every shard, a restored cut is claimed by exactly one shard
and comes back when unused, and a restore imports the shared ledger once.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from participants import (
    ControlPlane,
    FanoutShard,
    FileCaptureLedger,
    MemoryCaptureLedger,
    ModelParticipant,
    ModelProcessFanout,
    ModelTicket,
    listen_private,
)
from protocols import CheckpointRequest, EpisodeId, RolloutRetiredError
from tests.participants.ledger_factory import commit
from tests.participants.test_model_cuts import DIGEST, WORKER, FakeWorker

pytestmark = pytest.mark.anyio
R1 = EpisodeId(rollout_id="r1")
TARGET = R1.next_attempt()


class CountingLedger(FileCaptureLedger):
    """A file ledger that counts the imports of every process sharing ``imports``."""

    def __init__(self, root: Path, imports: list[list[str]]) -> None:
        super().__init__(root)
        self.imports = imports

    def import_rows_many(self, ledgers: Mapping[str, Sequence[Mapping[str, Any]]]) -> None:
        self.imports.append(sorted(ledgers))
        super().import_rows_many(ledgers)


class ModelServer:
    """A ModelProcessFanout and two model shards sharing one ledger directory."""

    def __init__(self, fanout: ModelProcessFanout, root: Path) -> None:
        self.fanout = fanout
        self.root = root
        self.imports: list[list[str]] = []
        self.models: dict[int, ModelParticipant] = {}

    async def join(self, stack: AsyncExitStack, pid: int, slot: int, path: Path) -> None:
        ledger = CountingLedger(self.root / "ledger", self.imports)
        stack.callback(ledger.close)
        model = ModelParticipant(ledger, cut_requester=FakeWorker())
        shard = FanoutShard(ControlPlane(model), slot=slot, socket_path=path, pid=pid)
        await stack.enter_async_context(shard.running())
        self.models[pid] = model
        with anyio.fail_after(10):
            while self.fanout.shards.get(pid) is None:  # noqa: ASYNC110 - another task's state
                await anyio.sleep(0.01)


@asynccontextmanager
async def model_server(tmp_path: Path) -> AsyncIterator[ModelServer]:
    fanout = ModelProcessFanout("policy", expected=2)
    plane = ControlPlane(fanout)
    path = tmp_path / "c.sock"
    listener = await listen_private(path)
    made = ModelServer(fanout, tmp_path)
    async with plane.running(), anyio.create_task_group() as group:
        group.start_soon(fanout.serve, listener, plane)
        async with AsyncExitStack() as stack:
            await made.join(stack, 101, 0, path)
            await made.join(stack, 102, 1, path)
            yield made
        group.cancel_scope.cancel()
    await listener.aclose()


def _close() -> CheckpointRequest:
    return CheckpointRequest(checkpoint_id="c1", deadline_ts=time.time() + 60)


async def _on_worker(model: ModelParticipant, episode: EpisodeId) -> ModelTicket:
    ticket = await model.admit(episode)
    ticket.backend = WORKER
    ticket.request_digest = DIGEST
    return ticket


async def test_undelivered_calls_of_any_shard_are_left_out_and_the_live_cut_kept(
    tmp_path: Path,
) -> None:
    async with model_server(tmp_path) as made:
        owner = made.models[102]  # the other shard (pid 101) reads the same ledger files
        ledger = owner.ledger
        delivered = await owner.admit(R1)
        await ledger.record(commit("r1", 0, call_id=delivered.model_call_id, rollout="r1"))
        await owner.gate.deliver(delivered)
        owner.release(delivered)
        held = await _on_worker(owner, R1)
        await ledger.record(commit("r1", 1, call_id=held.model_call_id, rollout="r1"))
        await made.fanout.close_admission(_close())
        (record,) = await made.fanout.export([R1])
    assert [row["model_call_id"] for row in record["rows"]] == [delivered.model_call_id]
    (cut,) = record["generation_cuts"]
    assert cut["model_call_id"] == held.model_call_id
    reply = made.fanout.commit_reply([record])
    assert reply["generation_cut_episodes"] == ["r1"]
    assert reply["staging_keys"] == sorted(
        [f"stage/r1/{delivered.model_call_id}", *cut["continuation"]["staging_keys"]]
    )


async def _cut_record() -> dict[str, Any]:
    """What a single-process server exported for r1: one cut, no rows."""
    old = ModelParticipant(MemoryCaptureLedger(), cut_requester=FakeWorker())
    await _on_worker(old, R1)
    await old.close_admission(_close())
    (record,) = await old.export([R1])
    return record


async def test_a_restored_cut_is_claimed_by_exactly_one_shard_and_returned_when_unused(
    tmp_path: Path,
) -> None:
    record = await _cut_record()
    async with model_server(tmp_path) as made:
        await made.fanout.install([record], [R1])
        a, b = made.models[101], made.models[102]
        first, second = await _on_worker(a, TARGET), await _on_worker(b, TARGET)
        async with anyio.create_task_group() as group:
            group.start_soon(a.prefetch_restored_cut, first)
            group.start_soon(b.prefetch_restored_cut, second)
        taken = [a.take_restored_cut(first), b.take_restored_cut(second)]
        assert [t is not None for t in taken].count(True) == 1
        winner, ticket = (a, first) if taken[0] is not None else (b, second)
        loser, other = (b, second) if winner is a else (a, first)
        winner.release(ticket)  # left without a response: the cut was not used
        await winner.return_unused_cut(ticket)
        assert made.fanout.status_extra()["restored_generation_cuts"] == [TARGET.capture_key]
        await loser.prefetch_restored_cut(other)  # the returned cut can be claimed again
        assert loser.take_restored_cut(other) is not None
        loser.release(other)
        await loser.return_unused_cut(other)
        late = await a.admit(TARGET)  # not on an inference worker yet: no live cut of its own
        late.request_digest = DIGEST
        await made.fanout.close_admission(_close())
        async with anyio.create_task_group() as group:
            group.start_soon(a.prefetch_restored_cut, late)  # waits: no cut moves while closed
            await anyio.sleep(0.2)  # let the claim reach the fan-out (no time is asserted)
            assert TARGET.capture_key not in a.restored_cuts.records
            (carried,) = await made.fanout.export([TARGET])
            await made.fanout.open_admission()
        assert a.take_restored_cut(late) is not None  # after resume the waiting call claims it
    assert carried["generation_cuts"] == record["generation_cuts"]


async def test_a_restore_imports_the_shared_ledger_once_and_every_shard_reads_it(
    tmp_path: Path,
) -> None:
    source = MemoryCaptureLedger()
    await source.record(commit("r1", 0, rollout="r1"))
    rows = source.export_rows("r1")
    record = {"episode_id": R1.model_dump(), "rows": rows, "generation_cuts": []}
    r2 = EpisodeId(rollout_id="r2")
    async with model_server(tmp_path) as made:
        await made.models[101].ledger.record(commit("r1", 0, rollout="r1"))  # the dead attempt
        await made.fanout.install([record], [R1, r2])
        assert made.imports == [["r1-a1", "r2-a1"]]
        for model in made.models.values():
            carried = model.ledger.export_rows(TARGET.capture_key)
            assert [row.get("capture_key") for row in carried] == ["r1"]
            with pytest.raises(RolloutRetiredError):
                await model.ledger.manifest("r1")
        pending = [e.capture_key for e in made.fanout.restored_pending()]
        assert pending == ["r1-a1", "r2-a1"]


async def test_a_shards_share_reads_its_ledgers_in_batches_not_one_thread_hop_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from participants import MemoryCaptureLedger
    from participants._model import shares

    ledger = MemoryCaptureLedger()
    episodes = [EpisodeId(rollout_id=f"r{i}", attempt=0) for i in range(1100)]
    for episode in episodes[:3]:
        await ledger.record(commit(episode.capture_key, 0))
    hops: list[int] = []
    real = shares.anyio.to_thread.run_sync

    async def counted(func: Any, *args: Any) -> Any:
        hops.append(len(args[-1]))
        return await real(func, *args)

    monkeypatch.setattr(shares.anyio.to_thread, "run_sync", counted)
    shared = await shares.share_episodes(ledger, episodes, set(), {}, {})
    assert hops == [shares.SHARE_BATCH, shares.SHARE_BATCH, 1100 - 2 * shares.SHARE_BATCH]
    assert sorted(shared) == sorted(e.capture_key for e in episodes)
    assert [len(shared[e.capture_key]["rows"]) for e in episodes[:4]] == [1, 1, 1, 0]
