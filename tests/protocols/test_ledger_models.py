"""Ledger keys, rows and manifests."""

from __future__ import annotations

import pytest

from protocols import (
    InvalidRolloutIdError,
    LedgerBatchRequest,
    RolloutManifest,
    custody_row,
    failure_row,
    manifest_from_rows,
    validate_ledger_key,
    validate_ledger_keys,
    validate_row,
)
from protocols._ledger import (
    LEDGER_ROW_MISSING_CHAIN_HASH_REASON,
    LEDGER_ROW_MISSING_RESPONSE_ID_REASON,
)
from tests.participants.ledger_factory import commit


@pytest.mark.parametrize("key", ["r", "r-a1", "r-a0", "a.b_c-d", "9", "-x", "_x"])
def test_capture_keys_are_valid_ledger_keys(key: str) -> None:
    assert validate_ledger_key(key) == key


@pytest.mark.parametrize("key", ["", ".", "..", ".hidden", "a/b", "a b", "é", "a\n", 3, None])
def test_unsafe_or_malformed_keys_are_refused(key: object) -> None:
    with pytest.raises(InvalidRolloutIdError):
        validate_ledger_key(key)


def test_batches_refuse_bare_strings_and_dedupe_keeping_the_first() -> None:
    with pytest.raises(TypeError, match="sequence of rollout ids"):
        validate_ledger_keys("abc")
    assert validate_ledger_keys(["b", "a", "b", "c", "a"]) == ["b", "a", "c"]
    with pytest.raises(InvalidRolloutIdError):
        validate_ledger_keys(["a", "b", "../c"])


REFERENCE_CALL_RECORD_FIELDS = {
    "schema_version",
    "digest_version",
    "extras_digest_version",
    "model_call_id",
    "parent_call_id",
    "staging_key",
    "weight_version",
    "prev_len",
    "delta_len",
    "cum_len",
    "digest",
    "extras_digest",
    "mode",
    "admitted_at",
    "chain_hash",
    "cumulative_hash",
    "response_id",
    "output_fingerprint",
    "continuation_fingerprint",
    "fingerprint_version",
}
"""The reference's ``CallRecord`` (policy-model-and-ledger §2.4/§2.5, errata 7.1), field for field."""


def test_custody_rows_round_trip_to_call_records() -> None:
    work = commit("r", 1)
    row = custody_row(work)
    assert "cumulative_token_ids" not in row and row["staging_digest"] == work.record.digest
    assert validate_row(row) == row
    manifest = manifest_from_rows("r", [row])
    assert manifest.records == [work.record]


def test_manifest_records_have_exactly_the_reference_fields_carried_rows_too() -> None:
    plain = custody_row(commit("r-a1", 1))
    carried = dict(custody_row(commit("r", 0)), capture_key="r")  # stamped by a restore
    assert validate_row(carried) == carried  # the ledger and the checkpoint keep the stamp
    manifest = manifest_from_rows("r-a1", [carried, plain])
    for record in manifest.model_dump(mode="json")["records"]:
        assert set(record) == REFERENCE_CALL_RECORD_FIELDS
    # ...and a record shaped as the reference's parses back as ours (coordinator.LedgerClient).
    assert RolloutManifest.model_validate_json(manifest.model_dump_json()) == manifest


def test_manifest_reports_failures_and_skips_lineage_only_rows() -> None:
    good = custody_row(commit("r", 0))
    no_response = dict(custody_row(commit("r", 1)), response_id=None)
    no_chain = dict(custody_row(commit("r", 2)))
    del no_chain["chain_hash"]
    lineage_only = {
        "model_call_id": "local",
        "fingerprint_version": 1,
        "fingerprint": "f",
        "context_len": 0,
        "context_digest": "d",
        "cumulative_token_ids": [1, 2],
        "digest": "x",
    }
    manifest = manifest_from_rows(
        "r", [good, failure_row("c9", "worker_capture_failed"), no_response, no_chain, lineage_only]
    )
    assert [r.model_call_id for r in manifest.records] == ["call-0"]
    assert [(f.model_call_id, f.reason) for f in manifest.failures] == [
        ("c9", "worker_capture_failed"),
        ("call-1", LEDGER_ROW_MISSING_RESPONSE_ID_REASON),
        ("call-2", LEDGER_ROW_MISSING_CHAIN_HASH_REASON),
    ]
    assert validate_row(lineage_only) == lineage_only


def test_batch_request_bounds() -> None:
    assert LedgerBatchRequest(rollout_ids=["a"]).rollout_ids == ["a"]
    with pytest.raises(ValueError):
        LedgerBatchRequest(rollout_ids=[])
    with pytest.raises(ValueError):
        LedgerBatchRequest(rollout_ids=["a"] * 4097)


def test_a_batch_of_keys_is_checked_at_once_exactly_as_key_by_key() -> None:
    # D441: every list of up to two keys of up to three characters, and of three of up to two, drawn from the characters
    # the rule turns on is accepted by the one-pass check exactly when each key is valid.
    import itertools

    from protocols._ledger_keys import MAX_LEDGER_KEY_LENGTH, _all_ledger_keys

    def valid(key: str) -> bool:
        try:
            validate_ledger_key(key)
        except InvalidRolloutIdError:
            return False
        return True

    keys = ["".join(p) for n in range(4) for p in itertools.product("a.-\né", repeat=n)]
    for size in range(4):
        short = keys if size < 3 else [key for key in keys if len(key) < 3]
        for batch in itertools.product(short, repeat=size):
            assert _all_ledger_keys(list(batch)) == all(map(valid, batch)), batch
    longest = "k" * MAX_LEDGER_KEY_LENGTH
    assert _all_ledger_keys([longest, "a"]) and not _all_ledger_keys(["a", longest + "k"])
    assert not _all_ledger_keys(["a", 3])  # type: ignore[list-item]
    with pytest.raises(InvalidRolloutIdError, match="'a b'"):
        validate_ledger_keys(["a", "a b", ".c"])  # the first bad key is the one named
