"""The policy-model participant alone: gate, export minus undelivered calls, install, retire."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import pytest

from participants import MemoryCaptureLedger, ModelParticipant, ModelTicket
from protocols import (
    CheckpointError,
    CheckpointRequest,
    EpisodeId,
    InvalidCheckpointStateError,
    RolloutRetiredError,
    StaleAttemptError,
)
from tests.participants.ledger_factory import commit

pytestmark = pytest.mark.anyio
R1 = EpisodeId(rollout_id="r1")
CLOSE = CheckpointRequest(checkpoint_id="c1", deadline_ts=4e9)


async def _until(model: ModelParticipant, condition: Callable[[], bool]) -> None:
    with anyio.fail_after(10):  # a bound on the wait, not an assertion on speed
        while True:
            seen = model.changes.version
            if condition():
                return
            await model.changes.wait_past(seen)


async def _participant() -> tuple[ModelParticipant, MemoryCaptureLedger]:
    ledger = MemoryCaptureLedger()
    return ModelParticipant(ledger), ledger


async def test_a_call_arriving_while_closed_waits_without_a_ticket_until_open() -> None:
    model, _ = await _participant()
    await model.close_admission(CLOSE)
    admitted: list[object] = []
    async with anyio.create_task_group() as group:
        group.start_soon(lambda: _admit_into(model, R1, admitted))
        await _until(model, lambda: model.gate.waiting == 1)
        assert admitted == []
        assert model.gate.tickets == {}
        assert model.readiness().ready  # a waiting call never blocks prepare
        await model.open_admission()
    assert len(admitted) == 1


async def _admit_into(model: ModelParticipant, episode: EpisodeId, out: list[object]) -> None:
    out.append(await model.admit(episode))


async def test_a_retire_wakes_a_waiting_call_which_is_then_refused() -> None:
    model, _ = await _participant()
    await model.close_admission(CLOSE)
    outcome: list[BaseException] = []

    async def call() -> None:
        try:
            await model.admit(R1)
        except StaleAttemptError as exc:
            outcome.append(exc)

    async with anyio.create_task_group() as group:
        group.start_soon(call)
        await _until(model, lambda: model.gate.waiting == 1)
        model.marks.raise_to([R1])
        await model.retire(R1)
    assert len(outcome) == 1


async def test_export_needs_a_scope_and_leaves_out_undelivered_calls() -> None:
    model, ledger = await _participant()
    delivered = await model.admit(R1)
    await ledger.record(commit("r1", 0, call_id=delivered.model_call_id, rollout="r1"))
    await model.gate.deliver(delivered)
    model.gate.release(delivered)
    pending = await model.admit(R1)
    await ledger.record(commit("r1", 1, call_id=pending.model_call_id, rollout="r1"))
    await model.close_admission(CLOSE)
    with pytest.raises(CheckpointError):
        await model.export(None)
    records = await model.export([R1, EpisodeId(rollout_id="empty")])
    assert [r["episode_id"] for r in records] == [R1.model_dump()]
    assert [row["model_call_id"] for row in records[0]["rows"]] == [delivered.model_call_id]
    assert records[0]["generation_cuts"] == []
    reply = model.commit_reply(records)
    key = f"stage/r1/{delivered.model_call_id}"
    assert reply == {
        "staging_keys": [key],
        "staging_keys_by_episode": {"r1": [key]},
        "generation_cut_episodes": [],
    }


async def test_install_imports_under_the_next_attempt_stamped_and_retires_the_old_ones() -> None:
    model, ledger = await _participant()
    source = MemoryCaptureLedger()
    await source.record(commit("r1", 0, rollout="r1"))
    await source.record(commit("r1", 1, rollout="r1"))
    first, second = source.export_rows("r1")
    exported = [first, dict(second, capture_key="r0")]  # carried over by an earlier restore
    r2 = EpisodeId(rollout_id="r2", attempt=1)
    await ledger.record(commit("r1", 0, rollout="r1"))  # the crashed attempt's own ledger
    await model.install(
        [{"episode_id": R1.model_dump(), "rows": exported, "generation_cuts": []}], [R1, r2]
    )
    carried = ledger.export_rows("r1-a1")
    assert [row.get("capture_key") for row in carried] == ["r1", "r0"]
    assert [EpisodeId.from_capture_key(k) for k in ("r1-a1", "r2-a2")] == model.restored_pending()
    with pytest.raises(RolloutRetiredError):
        await ledger.manifest("r1")
    for key in ("r2", "r2-a1"):
        with pytest.raises(RolloutRetiredError):
            await ledger.manifest(key)


async def test_install_refuses_a_bad_record_and_changes_nothing() -> None:
    model, ledger = await _participant()
    await ledger.record(commit("r1", 0, rollout="r1"))
    bad = {"episode_id": R1.model_dump(), "rows": [], "generation_cuts": [{"x": 1}]}
    with pytest.raises(InvalidCheckpointStateError):
        await model.install([bad], [R1])
    assert len(ledger.export_rows("r1")) == 1
    assert model.restored_pending() == []


async def test_install_imports_and_fences_at_once_and_a_refused_import_is_typed() -> None:
    model, ledger = await _participant()
    started: list[str] = []
    both = anyio.Event()
    real_import, real_retire = ledger.import_rows_many, ledger.retire

    def importing(ledgers: Any) -> None:
        started.append("import")
        anyio.from_thread.run(both.wait)  # returns only once the retire has started too
        real_import(ledgers)

    async def retiring(keys: Any) -> Any:
        started.append("retire")
        both.set()
        return await real_retire(keys)

    ledger.import_rows_many = importing  # type: ignore[method-assign]
    ledger.retire = retiring  # type: ignore[method-assign]
    with anyio.fail_after(10):  # one after the other, the import would wait for ever
        await model.install([], [R1])
    assert sorted(started) == ["import", "retire"]

    refusing, refusing_ledger = await _participant()

    def refuse(ledgers: Any) -> None:
        raise ValueError("a row is malformed")

    refusing_ledger.import_rows_many = refuse  # type: ignore[method-assign]
    with pytest.raises(CheckpointError, match="refused the restore"):  # itself, not a group
        await refusing.install([], [R1])


async def test_install_is_refused_once_a_call_was_served() -> None:
    model, _ = await _participant()
    model.gate.release(await model.admit(R1))
    with pytest.raises(CheckpointError):
        await model.install([], [R1])


async def test_retire_cancels_a_covered_call_and_retires_the_ledgers_through_its_attempt() -> None:
    model, ledger = await _participant()
    a1 = EpisodeId(rollout_id="r1", attempt=1)
    await ledger.record(commit("r1-a1", 0, rollout="r1"))
    ticket = await model.admit(a1)
    stopped = anyio.Event()

    async def generating() -> None:
        with ticket.scope:
            await anyio.sleep_forever()
        model.gate.release(ticket)
        stopped.set()

    async with anyio.create_task_group() as group:
        group.start_soon(generating)
        await anyio.lowlevel.checkpoint()
        await model.retire(a1)
        assert stopped.is_set()
    for key in ("r1", "r1-a1"):
        with pytest.raises(RolloutRetiredError):
            await ledger.manifest(key)
    assert model.gate.tickets == {}


async def test_retire_aborts_its_cancelled_calls_on_their_worker_before_it_returns() -> None:
    aborted: list[tuple[str, list[str]]] = []

    async def aborter(backend: str, call_ids: list[str]) -> None:
        aborted.append((backend, call_ids))

    model = ModelParticipant(MemoryCaptureLedger(), call_aborter=aborter)
    sent, waiting = await model.admit(R1), await model.admit(EpisodeId(rollout_id="r1"))
    sent.backend = "http://worker/v1"  # this one reached its worker; the other did not

    async def generating(ticket: ModelTicket) -> None:
        with ticket.scope:
            await anyio.sleep_forever()
        model.gate.release(ticket)

    async with anyio.create_task_group() as group:
        group.start_soon(generating, sent)
        group.start_soon(generating, waiting)
        await anyio.lowlevel.checkpoint()
        await model.retire(R1)
        assert aborted == [("http://worker/v1", [sent.model_call_id])]
