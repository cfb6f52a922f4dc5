"""CallRecord: the ledger row's rules, strict types and the optional capture key."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from protocols import CallRecord

DIGEST = "cd" * 32


def _row(**changes: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "model_call_id": "c2",
        "parent_call_id": "c1",
        "prev_len": 5,
        "delta_len": 3,
        "cum_len": 8,
        "weight_version": 0,
        "digest": DIGEST,
        "extras_digest": DIGEST,
        "staging_key": "r1/c2",
        "mode": "token_in",
        "chain_hash": DIGEST,
        "cumulative_hash": DIGEST,
        "response_id": "resp-2",
        "admitted_at": 1700000000.5,
    }
    fields.update(changes)
    return fields


def test_a_child_and_a_root_validate_with_their_versions() -> None:
    child = CallRecord.model_validate(_row())
    assert (child.schema_version, child.digest_version, child.extras_digest_version) == (2, 2, 1)
    root = CallRecord.model_validate(_row(parent_call_id=None, prev_len=0, cum_len=3, mode="text"))
    assert root.fingerprint_version == 0 and root.output_fingerprint is None


def test_capture_key_is_emitted_only_when_set() -> None:
    plain = CallRecord.model_validate(_row())
    assert "capture_key" not in plain.model_dump()
    assert "capture_key" not in json.loads(plain.model_dump_json())
    carried = CallRecord.model_validate(_row(capture_key="r1"))
    assert carried.model_dump()["capture_key"] == "r1"
    assert CallRecord.model_validate_json(carried.model_dump_json()) == carried
    assert CallRecord.model_validate_json(plain.model_dump_json()) == plain


@pytest.mark.parametrize(
    "changes",
    [
        {"delta_len": 0, "cum_len": 5},
        {"cum_len": 9},
        {"parent_call_id": None},
        {"prev_len": 0, "cum_len": 3},
        {"mode": "text"},
        {"parent_call_id": None, "prev_len": 0, "cum_len": 3},
        {"digest": "AB" * 32},
        {"chain_hash": "ab"},
        {"staging_key": ""},
        {"response_id": ""},
        {"admitted_at": 1700000000},
        {"prev_len": 5.0},
        {"capture_key": ""},
        {"schema_version": 1},
        {"digest_version": 1},
        {"other": 1},
    ],
)
def test_rules_and_strict_types(changes: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        CallRecord.model_validate_json(json.dumps(_row(**changes)))
