"""One captured call through both ledgers: admission before the worker, custody after it."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from participants import FileCaptureLedger, MemoryCaptureLedger, record_custody, resolve_admission
from protocols import CaptureAdmission, CommitCoords, StaleAttemptError

pytestmark = pytest.mark.anyio

Ledger = FileCaptureLedger | MemoryCaptureLedger
START = [{"role": "system", "content": "counter"}, {"role": "user", "content": "r1 0"}]


@pytest.fixture(params=["file", "memory"])
def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Ledger]:
    made: Ledger = (
        FileCaptureLedger(tmp_path / "ledger") if request.param == "file" else MemoryCaptureLedger()
    )
    yield made
    made.close()


def _hex(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def staged(admission: CaptureAdmission, delta: int = 10, **changes: Any) -> CommitCoords:
    """What a worker answers for ``admission`` once it staged ``delta`` tokens."""
    call = admission.model_call_id
    fields: dict[str, Any] = {
        "rollout_id": admission.rollout_id,
        "model_call_id": call,
        "parent_call_id": admission.parent_call_id,
        "prev_len": admission.prev_len,
        "delta_len": delta,
        "cum_len": admission.prev_len + delta,
        "weight_version": 0,
        "digest": _hex("digest", call),
        "extras_digest": _hex("extras"),
        "staging_key": f"{admission.rollout_id}/{call}",
        "chain_hash": _hex("chain", call),
        "cumulative_hash": _hex("cum", call),
    }
    fields.update(changes)
    return CommitCoords(**fields)


async def capture(
    ledger: Ledger, call: str, items: list[dict[str, str]], output: str
) -> CaptureAdmission:
    """Admit ``call``, have a worker stage it, record its custody; the admission it ran under."""
    admission = await resolve_admission(ledger, "r1", call, items)
    assert admission is not None
    commit = await record_custody(
        ledger,
        admission,
        staged(admission),
        request_items=items,
        response_items=[{"role": "assistant", "content": output}],
        response_id=f"resp-{call}",
        admitted_at=1.5,
    )
    assert commit is not None
    return admission


async def test_a_chain_of_calls_is_admitted_and_recorded_parent_by_parent(ledger: Ledger) -> None:
    root = await capture(ledger, "c0", START, "out 0")
    assert (root.mode, root.parent_call_id) == ("text", None)
    second = [*START, {"role": "assistant", "content": "out 0"}, {"role": "tool", "content": "t"}]
    child = await capture(ledger, "c1", second, "out 1")
    assert (child.mode, child.parent_call_id, child.prev_len) == ("token_in", "c0", 10)
    assert child.staging_chain == ["r1/c0"]
    assert child.parent_chain_hash == _hex("chain", "c0")
    manifest = await ledger.manifest("r1")
    assert [(r.model_call_id, r.parent_call_id) for r in manifest.records] == [
        ("c0", None),
        ("c1", "c0"),
    ]
    assert [r.response_id for r in manifest.records] == ["resp-c0", "resp-c1"]
    assert manifest.records[1].admitted_at == 1.5 and manifest.failures == []
    assert ledger.export_rows("r1")[1]["staging_chain"] == ["r1/c0", "r1/c1"]


async def test_an_unresolved_parent_is_served_uncaptured_and_poisons_the_manifest(
    ledger: Ledger,
) -> None:
    await capture(ledger, "c0", START, "out 0")
    rewritten = [*START, {"role": "assistant", "content": "never said"}]
    assert await resolve_admission(ledger, "r1", "c1", rewritten) is None
    manifest = await ledger.manifest("r1")
    assert [(f.model_call_id, f.reason) for f in manifest.failures] == [("c1", "unresolved_parent")]


async def test_a_root_admission_records_nothing_until_custody(ledger: Ledger) -> None:
    assert await resolve_admission(ledger, "r1", "c0", START) is not None
    assert ledger.export_rows("r1") == []


async def test_a_call_of_a_retired_ledger_is_a_stale_attempt(ledger: Ledger) -> None:
    await capture(ledger, "c0", START, "out 0")
    await ledger.retire(["r1"])
    with pytest.raises(StaleAttemptError, match="retired"):
        await resolve_admission(ledger, "r1", "c1", START)
    assert ledger.export_rows("r1") == []


@pytest.mark.parametrize(
    ("coords_of", "reason"),
    [
        (lambda a: None, "worker_response_missing_commit_coordinates"),
        (
            lambda a: CommitCoords(
                rollout_id="r1",
                model_call_id="c0",
                prev_len=0,
                delta_len=0,
                cum_len=0,
                weight_version=0,
                disposition="capture_failed",
            ),
            "worker_capture_failed",
        ),
        (lambda a: staged(a, model_call_id="c7"), "invalid_worker_commit_coordinates"),
    ],
)
async def test_coordinates_that_cannot_be_custody_become_a_failure_row(
    ledger: Ledger, coords_of: Any, reason: str
) -> None:
    admission = await resolve_admission(ledger, "r1", "c0", START)
    assert admission is not None
    recorded = await record_custody(
        ledger,
        admission,
        coords_of(admission),
        request_items=START,
        response_items=[{"role": "assistant", "content": "out 0"}],
        response_id="resp-c0",
    )
    assert recorded is None
    manifest = await ledger.manifest("r1")
    assert manifest.records == []
    assert [(f.model_call_id, f.reason) for f in manifest.failures] == [("c0", reason)]
