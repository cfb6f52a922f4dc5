"""Generation cuts on the policy side: the cut round at close, commit of cuts, restored cuts."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from participants import (
    ManualClock,
    MemoryCaptureLedger,
    ModelParticipant,
    ModelTicket,
    generation_cut_restart_reason,
)
from participants._runtime.telemetry import GENERATION_CUT_OUTCOMES
from protocols import (
    CheckpointRequest,
    EpisodeId,
    GenerationCutInventory,
    GenerationCutPrefixAck,
    GenerationCutReceipt,
    InvalidCheckpointStateError,
)
from tests.participants.ledger_factory import commit

pytestmark = pytest.mark.anyio
R1 = EpisodeId(rollout_id="r1")
DIGEST = "d" * 64
WORKER = "http://127.0.0.1:1"


class FakeWorker:
    """Answers inventories with a durable prefix for every call, or misbehaves on demand."""

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.budgets: list[float] = []
        self.inventories: list[GenerationCutInventory] = []

    async def __call__(
        self, backend: str, inventory: GenerationCutInventory, budget_seconds: float
    ) -> GenerationCutReceipt:
        self.budgets.append(budget_seconds)
        self.inventories.append(inventory)
        if self.mode == "refuse":
            raise RuntimeError("500 from the worker")
        if self.mode == "hang":
            await anyio.sleep_forever()
        acks = [
            GenerationCutPrefixAck(
                **prefix.model_dump(),
                disposition="durable_prefix",
                cut_kind="active_prefix",
                frozen_buffer_id="buffer",
                staging_keys=[f"__generation_cut__/{prefix.model_call_id}/1"],
                prefix_token_count=3,
                prefix_digest="a" * 64,
                effective_output_limit=16,
            )
            for prefix in inventory.active_prefixes
        ]
        if self.mode == "wrong-call":
            acks = [a.model_copy(update={"model_call_id": "someone-else"}) for a in acks]
        return GenerationCutReceipt(
            checkpoint_id=inventory.checkpoint_id,
            cut_id="cut",
            inventory_digest=inventory.inventory_digest,
            inventory=inventory,
            backend_snapshot_id="snap",
            prefixes=acks,
        )


def _model(worker: FakeWorker | None = None, clock: ManualClock | None = None) -> ModelParticipant:
    return ModelParticipant(MemoryCaptureLedger(), cut_requester=worker, clock=clock)


async def _on_worker(
    model: ModelParticipant, episode: EpisodeId = R1, restart: str | None = None
) -> ModelTicket:
    ticket = await model.admit(episode)
    ticket.backend = WORKER
    ticket.request_digest = DIGEST
    ticket.restart_reason = restart
    return ticket


def _close(clock: ManualClock | None = None, ahead: float = 60.0) -> CheckpointRequest:
    now = clock.time() if clock is not None else 1_800_000_000.0
    return CheckpointRequest(checkpoint_id="c1", deadline_ts=now + ahead)


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({}, None),
        ({"tool_choice": "auto", "response_format": {"type": "text"}}, None),
        ({"tool_choice": "none"}, None),
        ({"tool_choice": "required"}, "tool_choice:required"),
        ({"tool_choice": {"type": "function"}}, "tool_choice:constrained"),
        ({"response_format": {"type": "json_object"}}, "response_format:json_object"),
        ({"response_format": {}}, "response_format:unknown"),
        ({"guided_regex": "a+"}, "guided_regex"),
    ],
)
def test_constrained_decoding_is_named_as_the_reason_never_to_cut(
    body: dict[str, Any], reason: str | None
) -> None:
    assert generation_cut_restart_reason(body) == reason


async def test_close_cuts_calls_on_a_worker_but_never_a_constrained_one() -> None:
    worker = FakeWorker()
    model = _model(worker, ManualClock())
    plain = await _on_worker(model)
    constrained = await _on_worker(model, EpisodeId(rollout_id="r2"), restart="tool_choice:x")
    not_sent = await model.admit(EpisodeId(rollout_id="r3"))  # not on a worker yet
    await model.close_admission(_close())
    (inventory,) = worker.inventories
    assert [p.model_call_id for p in inventory.active_prefixes] == [plain.model_call_id]
    assert plain.cut_record is not None and constrained.cut_record is None
    assert not_sent.cut is None
    counts = model.readiness().counts
    assert (counts["cut"], counts["cut_failed"], counts["cut_skipped"]) == (1, 0, 1)
    records = await model.export([R1, EpisodeId(rollout_id="r2")])
    assert [len(r["generation_cuts"]) for r in records] == [1]
    reply = model.commit_reply(records)
    assert reply["staging_keys"] == [f"__generation_cut__/{plain.model_call_id}/1"]
    assert reply["generation_cut_episodes"] == [R1.capture_key]  # the drill retries without one


async def test_the_cut_gets_half_of_the_remaining_deadline() -> None:
    clock = ManualClock()
    worker = FakeWorker()
    model = _model(worker, clock)
    await _on_worker(model)
    await model.close_admission(_close(clock, ahead=30.0))
    assert worker.budgets == [15.0]


@pytest.mark.parametrize("mode", ["refuse", "hang", "wrong-call"])
async def test_a_failed_hung_or_invalid_cut_regenerates_and_never_blocks(mode: str) -> None:
    clock = ManualClock()  # it never moves: only the cut's own bound can end a hang
    model = _model(FakeWorker(mode), clock)
    ticket = await _on_worker(model)
    with anyio.fail_after(30):  # a bound on the test, not an assertion on speed
        await model.close_admission(_close(clock, ahead=0.2))
    assert ticket.cut is not None and ticket.cut.disposition == "durable_failure"
    assert ticket.cut_record is None
    assert model.readiness().ready
    assert model.readiness().counts["cut_failed"] == 1
    # The later stages still run: the export leaves the call out and carries no cut.
    assert await model.export([R1]) == []


async def test_an_episode_with_a_retried_call_keeps_only_the_latest_cut() -> None:
    model = _model(FakeWorker())
    first = await _on_worker(model)
    retry = await _on_worker(model)
    assert retry.admitted_at >= first.admitted_at
    retry.admitted_at = first.admitted_at + 1.0
    await model.close_admission(_close())
    (record,) = await model.export([R1])
    (cut,) = record["generation_cuts"]
    assert cut["model_call_id"] == retry.model_call_id


async def test_opening_admission_forgets_the_checkpoints_cuts() -> None:
    model = _model(FakeWorker())
    ticket = await _on_worker(model)
    await model.close_admission(_close())
    await model.open_admission()
    assert ticket.cut_record is None
    assert model.readiness().counts["cut"] == 0


async def _restored_with_cut() -> tuple[ModelParticipant, dict[str, Any]]:
    """A fresh model that restored r1 with the cut a previous process exported."""
    old = _model(FakeWorker())
    await _on_worker(old)
    await old.close_admission(_close())
    (record,) = await old.export([R1])
    model = _model(FakeWorker())
    await model.install([record], [R1])
    return model, record


async def test_a_restored_cut_attaches_only_to_a_matching_unconstrained_call() -> None:
    model, record = await _restored_with_cut()
    target = R1.next_attempt()
    assert model.status_extra()["restored_generation_cuts"] == [target.capture_key]
    other = await model.admit(target)
    other.request_digest = "e" * 64
    assert model.take_restored_cut(other) is None
    constrained = await model.admit(target)
    constrained.request_digest = DIGEST
    constrained.restart_reason = "response_format:json_object"
    assert model.take_restored_cut(constrained) is None
    reissued = await model.admit(target)
    reissued.request_digest = DIGEST
    taken = model.take_restored_cut(reissued)
    assert taken is not None
    assert taken.model_dump(mode="json") == record["generation_cuts"][0]


async def test_a_restored_cut_survives_checkpoints_until_its_call_has_delivered() -> None:
    model, record = await _restored_with_cut()
    target = R1.next_attempt()
    cancelled = await model.admit(target)
    cancelled.request_digest = DIGEST
    assert model.take_restored_cut(cancelled) is not None
    model.release(cancelled)  # left without a response: the cut is not consumed
    assert model.status_extra()["restored_generation_cuts"] == [target.capture_key]
    reissued = await model.admit(target)
    reissued.request_digest = DIGEST
    assert model.take_restored_cut(reissued) is not None
    await model.close_admission(_close())
    (kept,) = await model.export([target])
    assert kept["generation_cuts"] == record["generation_cuts"]
    await model.open_admission()
    await model.gate.deliver(reissued)
    model.release(reissued)
    assert model.status_extra()["restored_generation_cuts"] == []
    await model.close_admission(_close())
    assert await model.export([target]) == []


async def test_retire_and_delete_restored_drop_the_restored_cut() -> None:
    model, _ = await _restored_with_cut()
    await model.retire(R1.next_attempt())
    assert model.status_extra()["restored_generation_cuts"] == []
    model, _ = await _restored_with_cut()
    await model.delete_restored(R1.next_attempt())
    assert model.status_extra()["restored_generation_cuts"] == []


async def test_install_refuses_two_cuts_in_one_record_and_changes_nothing() -> None:
    _, record = await _restored_with_cut()
    model = _model()
    await model.ledger.record(commit("r1-a1", 0, rollout="r1"))
    doubled = {**record, "generation_cuts": record["generation_cuts"] * 2}
    with pytest.raises(InvalidCheckpointStateError):
        await model.install([doubled], [R1])
    assert model.restored_pending() == []
    assert model.status_extra()["restored_generation_cuts"] == []
    assert len(model.ledger.export_rows("r1-a1")) == 1


async def test_cuts_checked_as_one_batch_go_to_their_own_records_and_a_bad_one_is_named() -> None:
    _, record = await _restored_with_cut()
    r2, r3 = EpisodeId(rollout_id="r2"), EpisodeId(rollout_id="r3")
    plain = {"episode_id": r2.model_dump(), "rows": [], "generation_cuts": []}
    cut_of_r3 = {**record, "episode_id": r3.model_dump()}
    model = _model()
    await model.install([plain, cut_of_r3, record], [R1, r2, r3])
    assert sorted(model.restored_cuts.records) == ["r1-a1", "r3-a1"]
    broken = {**record, "generation_cuts": [{**record["generation_cuts"][0], "request_digest": 7}]}
    model = _model()
    # The second record with a cut is the bad one; it is record 2 of the batch, not cut 1.
    with pytest.raises(InvalidCheckpointStateError, match="model record 2 holds a malformed"):
        await model.install([plain, cut_of_r3, broken], [R1, r2, r3])
    assert model.restored_pending() == [] and model.restored_cuts.records == {}


async def test_a_started_response_blocks_prepare_until_sent_and_new_calls_wait() -> None:
    model = _model(FakeWorker())
    streaming = await _on_worker(model)
    await model.gate.deliver(streaming)  # its response has started before the close
    await model.close_admission(_close())
    assert not model.readiness().ready
    assert streaming.cut is None  # a delivered call is never cut
    admitted: list[ModelTicket] = []

    async def new_call() -> None:
        admitted.append(await model.admit(EpisodeId(rollout_id="r2")))

    async with anyio.create_task_group() as group:
        group.start_soon(new_call)
        with anyio.fail_after(10):  # a bound on the wait, not an assertion on speed
            while True:
                seen = model.changes.version
                if model.gate.waiting == 1:
                    break
                await model.changes.wait_past(seen)
        model.release(streaming)
        assert model.readiness().ready
        assert admitted == []
        await model.open_admission()
    assert len(admitted) == 1


class SplitWorker(FakeWorker):
    """Cuts on one worker; every other worker's round fails as a refusal would."""

    async def __call__(
        self, backend: str, inventory: GenerationCutInventory, budget_seconds: float
    ) -> GenerationCutReceipt:
        if backend != WORKER:
            raise RuntimeError(f"500 from {backend}")
        return await super().__call__(backend, inventory, budget_seconds)


@asynccontextmanager
async def _one_of_each() -> AsyncIterator[tuple[ModelParticipant, CollectorRegistry]]:
    """Calls that are cut, failed, skipped, held and not on a worker, after a close."""
    registry = CollectorRegistry()
    model = ModelParticipant(MemoryCaptureLedger(), cut_requester=SplitWorker(), registry=registry)
    await _on_worker(model)
    failing = await _on_worker(model, EpisodeId(rollout_id="r2"))
    failing.backend = "http://127.0.0.1:2"
    await _on_worker(model, EpisodeId(rollout_id="r3"), restart="tool_choice:required")
    held = await model.admit(EpisodeId(rollout_id="r4"))  # finished, response not started
    await model.admit(EpisodeId(rollout_id="r5"))  # not on a worker yet
    await model.close_admission(_close())
    async with anyio.create_task_group() as group:
        group.start_soon(model.gate.deliver, held)
        await anyio.wait_all_tasks_blocked()  # the response waits at egress
        yield model, registry
        group.cancel_scope.cancel()


async def test_readiness_counts_inflight_held_cut_failed_and_skipped_calls() -> None:
    async with _one_of_each() as (model, _):
        report = model.readiness()
    assert report.ready
    assert report.counts == {"inflight": 5, "held": 1, "cut": 1, "cut_failed": 1, "cut_skipped": 1}


async def test_a_cut_round_counts_each_outcome_and_logs_one_event() -> None:
    with capture_logs() as logs:
        async with _one_of_each() as (_, registry):
            pass
    values = {
        outcome: registry.get_sample_value("midflight_generation_cuts_total", {"outcome": outcome})
        for outcome in GENERATION_CUT_OUTCOMES
    }
    assert values == {"cut": 1, "failed": 1, "skipped": 1, "continued": 0, "refused": 0}
    (event,) = [e for e in logs if e["event"] == "generation_cut.round"]
    assert event["log_level"] == "warning"  # a worker failed: its calls regenerate
    assert (event["calls"], event["cut"], event["cut_failed"], event["cut_skipped"]) == (3, 1, 1, 1)
    assert list(event["failed_workers"]) == ["http://127.0.0.1:2"]
    assert event["participant"] == "model/policy" and event["checkpoint_id"] == "c1"


async def test_an_untagged_call_is_never_cut_nor_cancelled_by_a_retire() -> None:
    worker = FakeWorker()
    model = _model(worker)
    untagged = await model.admit(None)
    untagged.backend = WORKER
    untagged.request_digest = DIGEST
    tagged = await _on_worker(model, EpisodeId(rollout_id="r2"))
    await model.close_admission(_close())
    (inventory,) = worker.inventories
    assert [p.model_call_id for p in inventory.active_prefixes] == [tagged.model_call_id]
    assert untagged.model_call_id not in {p.model_call_id for p in inventory.active_prefixes}
    assert untagged.cut is None and model.readiness().counts["inflight"] == 2
    await model.open_admission()
    await model.retire(R1)
    assert set(model.gate.tickets) == {untagged.model_call_id, tagged.model_call_id}
    assert not untagged.scope.cancel_called


async def test_an_untagged_response_being_sent_blocks_prepare_under_a_synthetic_name() -> None:
    model = _model(FakeWorker())
    untagged = await model.admit(None)
    await model.gate.deliver(untagged)  # its response started before the close
    await model.close_admission(_close())
    report = model.readiness()
    assert (report.ready, report.blockers) == (False, [f"untagged:{untagged.model_call_id}"])
    model.release(untagged)
    assert model.readiness().ready
