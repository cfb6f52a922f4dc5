"""The capture protocol's pure steps: a lineage resolution becomes an admission, the worker's
coordinates become a custody commit (or a failure reason)."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from protocols import (
    CaptureAdmission,
    CommitCoords,
    LineageResolution,
    RequestItem,
    admission_from_resolution,
    commit_coords_problem,
    conversation_digest,
    custody_commit,
    custody_row,
)
from protocols._ledger import POISON_REASONS
from protocols._lineage import FINGERPRINT_VERSION, LineageMatch


def _hex(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()


ROOT = LineageResolution(status="root")
PARENT = LineageMatch(
    model_call_id="c1",
    prev_len=30,
    digest=_hex("digest", "c1"),
    chain_hash=_hex("chain", "c1"),
    staging_chain=("r1/c0", "r1/c1"),
)
RESOLVED = LineageResolution(status="resolved", match=PARENT)
REQUEST = [{"role": "user", "content": "r1 0"}, {"role": "assistant", "content": "out"}]
RESPONSE = [{"role": "assistant", "content": "more"}]


def _coords(admission: CaptureAdmission, **changes: Any) -> CommitCoords:
    fields: dict[str, Any] = {
        "rollout_id": admission.rollout_id,
        "model_call_id": admission.model_call_id,
        "parent_call_id": admission.parent_call_id,
        "prev_len": admission.prev_len,
        "delta_len": 12,
        "cum_len": admission.prev_len + 12,
        "weight_version": 3,
        "digest": _hex("digest", admission.model_call_id),
        "extras_digest": _hex("extras"),
        "staging_key": f"{admission.rollout_id}/{admission.model_call_id}",
        "chain_hash": _hex("chain", admission.model_call_id),
        "cumulative_hash": _hex("cum", admission.model_call_id),
    }
    fields.update(changes)
    return CommitCoords(**fields)


def _child() -> CaptureAdmission:
    admission = admission_from_resolution("r1", "c2", RESOLVED)
    assert admission is not None
    return admission


def test_a_root_request_gets_a_bare_text_admission() -> None:
    assert admission_from_resolution("r1-a2", "c9", ROOT) == CaptureAdmission(
        rollout_id="r1-a2", model_call_id="c9", mode="text"
    )


def test_a_resolved_parent_gets_a_token_in_admission_with_its_chain() -> None:
    admission = _child()
    assert (admission.rollout_id, admission.model_call_id, admission.mode) == (
        "r1",
        "c2",
        "token_in",
    )
    assert (admission.parent_call_id, admission.prev_len) == ("c1", 30)
    assert admission.parent_chain_hash == PARENT.chain_hash
    assert admission.staging_chain == ["r1/c0", "r1/c1"]
    assert admission.required_prefix_token_ids == []  # the worker fetches it through the chain


@pytest.mark.parametrize(
    "resolution",
    [
        LineageResolution(status="unresolved", reason="no_match"),
        LineageResolution(status="unresolved", reason="ambiguous"),
        LineageResolution(status="unresolved", reason="rollout_retired"),
        # A parent whose tokens are nowhere staged (a lineage-only row) cannot be chained.
        LineageResolution(status="resolved", match=PARENT.model_copy(update={"staging_chain": ()})),
        LineageResolution(status="resolved"),
    ],
)
def test_an_unresolvable_parent_gets_no_admission(resolution: LineageResolution) -> None:
    assert admission_from_resolution("r1", "c2", resolution) is None


def test_coordinates_of_the_admitted_call_have_no_problem() -> None:
    admission = _child()
    assert commit_coords_problem(_coords(admission), admission) is None


@pytest.mark.parametrize(
    ("coords_of", "reason"),
    [
        (lambda a: None, "worker_response_missing_commit_coordinates"),
        (
            lambda a: CommitCoords(
                rollout_id="r1",
                model_call_id="c2",
                parent_call_id="c1",
                prev_len=30,
                delta_len=0,
                cum_len=30,
                weight_version=3,
                disposition="capture_failed",
            ),
            "worker_capture_failed",
        ),
        (lambda a: _coords(a, rollout_id="r2"), "invalid_worker_commit_coordinates"),
        (lambda a: _coords(a, model_call_id="c3"), "invalid_worker_commit_coordinates"),
        (lambda a: _coords(a, parent_call_id="c0"), "invalid_worker_commit_coordinates"),
        (
            lambda a: _coords(a, prev_len=29, cum_len=41),
            "invalid_worker_commit_coordinates",
        ),
    ],
)
def test_coordinates_that_cannot_be_custody_name_their_reason(coords_of: Any, reason: str) -> None:
    admission = _child()
    coords = coords_of(admission)
    assert commit_coords_problem(coords, admission) == reason
    assert reason in POISON_REASONS
    if coords is not None:
        with pytest.raises(ValueError, match=reason):
            custody_commit(
                admission, coords, request_items=REQUEST, response_items=RESPONSE, response_id="x"
            )


def test_a_custody_commit_is_the_coordinates_without_tokens_and_the_whole_chain() -> None:
    admission = _child()
    coords = _coords(admission)
    commit = custody_commit(
        admission,
        coords,
        request_items=REQUEST,
        response_items=RESPONSE,
        response_id="chatcmpl-c2",
        admitted_at=12.5,
    )
    assert commit.rollout_id == "r1"
    assert commit.staging_chain == ("r1/c0", "r1/c1", "r1/c2")
    assert commit.request_items == tuple(RequestItem.model_validate(i) for i in REQUEST)
    assert commit.response_items == (RequestItem(role="assistant", content="more"),)
    record = commit.record
    for name in (
        "parent_call_id",
        "staging_key",
        "weight_version",
        "prev_len",
        "delta_len",
        "cum_len",
        "digest",
        "extras_digest",
        "chain_hash",
        "cumulative_hash",
    ):
        assert getattr(record, name) == getattr(coords, name), name
    assert (record.model_call_id, record.mode, record.response_id) == (
        "c2",
        "token_in",
        "chatcmpl-c2",
    )
    assert record.admitted_at == 12.5
    assert record.fingerprint_version == FINGERPRINT_VERSION


def test_a_root_custody_commit_chains_only_its_own_key() -> None:
    admission = admission_from_resolution("r1", "c0", ROOT)
    assert admission is not None
    commit = custody_commit(
        admission,
        _coords(admission),
        request_items=REQUEST[:1],
        response_items=RESPONSE,
        response_id="chatcmpl-c0",
    )
    assert commit.staging_chain == ("r1/c0",)
    assert (commit.record.mode, commit.record.parent_call_id) == ("text", None)
    assert commit.record.admitted_at is None


def test_a_context_digest_from_admission_is_the_row_s_and_spares_hashing_again(
    ledger_hashes: list[int],
) -> None:
    """D429: the digest the policy server computed at admission becomes the row's context
    digest as it is; the row is the one hashing the request would give, and it never goes on
    the wire."""
    admission = _child()
    kwargs: dict[str, Any] = {
        "request_items": REQUEST,
        "response_items": RESPONSE,
        "response_id": "chatcmpl-c2",
    }
    hashed = custody_row(custody_commit(admission, _coords(admission), **kwargs))
    digest = conversation_digest(REQUEST)
    assert hashed["context_digest"] == digest
    ledger_hashes.clear()
    commit = custody_commit(admission, _coords(admission), **kwargs, context_digest=digest)
    assert custody_row(commit) == hashed
    assert ledger_hashes == []  # not hashed again
    assert "_context_digest" not in commit.model_dump() and digest not in commit.model_dump_json()
    custody_row(custody_commit(admission, _coords(admission), **kwargs))
    assert ledger_hashes == [len(REQUEST)]  # without it, the row hashes the request itself
    for bad in ("", "ABC", digest.upper(), digest[:-1]):
        with pytest.raises(ValueError, match="context digest"):
            custody_commit(admission, _coords(admission), **kwargs, context_digest=bad)
