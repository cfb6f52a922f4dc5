"""CallRecord: version fields, lineage rules, strict digests, exactly the reference's fields."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from protocols import CallRecord

HEX = "ab" * 32


def fields(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model_call_id": "c1",
        "parent_call_id": "c0",
        "staging_key": "s/c1",
        "weight_version": 3,
        "prev_len": 4,
        "delta_len": 2,
        "cum_len": 6,
        "digest": HEX,
        "extras_digest": HEX,
        "mode": "token_in",
        "admitted_at": 1.0,
        "chain_hash": HEX,
        "cumulative_hash": HEX,
        "response_id": "resp",
        "fingerprint_version": 1,
    }
    base.update(changes)
    return base


def test_a_valid_child_and_root() -> None:
    child = CallRecord(**fields())
    assert (child.schema_version, child.digest_version, child.extras_digest_version) == (2, 2, 1)
    root = CallRecord(**fields(parent_call_id=None, prev_len=0, cum_len=2, mode="text"))
    assert root.parent_call_id is None


@pytest.mark.parametrize(
    "changes",
    [
        {"delta_len": 0, "cum_len": 4},
        {"cum_len": 7},
        {"parent_call_id": None},  # a root must have prev_len 0 and mode text
        {"mode": "text"},
        {"prev_len": 0, "cum_len": 2},
        {"digest": "AB" * 32},
        {"chain_hash": "ab"},
        {"admitted_at": float("nan")},
        {"weight_version": "3"},
        {"model_call_id": ""},
        {"schema_version": 1},
        {"digest_version": 1},
        {"unknown": 1},
    ],
)
def test_invalid_records_fail(changes: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        CallRecord(**fields(**changes))


@pytest.mark.parametrize("extra", [{"rollout_id": "r"}, {"capture_key": "r"}])
def test_neither_the_rollout_id_nor_a_capture_key_is_a_record_field(extra: dict[str, Any]) -> None:
    # The reference's CallRecord has neither (D221, D222): the manifest names the capture key.
    with pytest.raises(ValidationError):
        CallRecord(**fields(**extra))
    assert set(CallRecord(**fields()).model_dump(mode="json")) == set(fields()) | {
        "schema_version",
        "digest_version",
        "extras_digest_version",
        "output_fingerprint",
        "continuation_fingerprint",
    }
