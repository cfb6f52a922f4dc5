"""The error table of e2e-contract §5, pinned code by code."""

from __future__ import annotations

import pytest

import protocols
from protocols import (
    ERROR_TABLE,
    ERRORS_BY_CODE,
    InternalError,
    MidflightError,
    error_from_envelope,
)
from protocols._errors import ERROR_CLASSES

# (code, HTTP status, retryable), copied from the contract, not from the code under test.
CONTRACT = [
    ("unauthorized", 401, False),
    ("invalid_request", 422, False),
    ("invalid_checkpoint_state", 422, False),
    ("rollout_id_required", 400, False),
    ("invalid_rollout_id", 400, False),
    ("stale_checkpoint", 409, False),
    ("checkpoint_conflict", 409, False),
    ("invalid_phase", 409, False),
    ("deadline_exceeded", 409, True),
    ("admission_closed", 409, True),
    ("stale_attempt", 409, False),
    ("restart_in_scope", 409, False),
    ("retire_incomplete", 409, True),
    ("activation_out_of_order", 409, False),
    ("checkpoint_open", 409, True),
    ("checkpoint_error", 409, False),
    ("rollout_retired", 410, False),
    ("request_too_large", 413, False),  # ours, not the contract's: bodies are bounded (D241)
    ("checkpoint_coordinator_unavailable", 503, True),
    ("internal_error", 500, True),
]


def test_table_lists_exactly_the_contract_codes_in_order() -> None:
    assert [(s.code, s.http_status, s.retryable) for s in ERROR_TABLE] == CONTRACT


@pytest.mark.parametrize(("code", "status", "retryable"), CONTRACT)
def test_each_code_has_one_class_with_its_status_and_flag(
    code: str, status: int, retryable: bool
) -> None:
    cls = ERROR_CLASSES[code]
    error = cls("why it failed")
    assert isinstance(error, MidflightError)
    assert (error.code, error.http_status, error.retryable) == (code, status, retryable)
    assert error.envelope() == {"error": {"code": code, "detail": "why it failed"}}
    assert ERRORS_BY_CODE[code].meaning
    assert getattr(protocols, cls.__name__) is cls


@pytest.mark.parametrize(("code", "status", "retryable"), CONTRACT)
def test_an_envelope_turns_back_into_its_class(code: str, status: int, retryable: bool) -> None:
    error = error_from_envelope(status, {"error": {"code": code, "detail": "d"}})
    assert type(error) is ERROR_CLASSES[code]
    assert error.detail == "d"


def test_classes_are_one_per_code() -> None:
    assert len(ERROR_CLASSES) == len(CONTRACT)
    assert len(set(ERROR_CLASSES.values())) == len(CONTRACT)


@pytest.mark.parametrize(
    "body",
    [None, "text", {"error": "flat"}, {"error": {"code": "no_such_code", "detail": "x"}}, {}],
)
def test_an_unknown_reply_becomes_an_internal_error_naming_the_status(body: object) -> None:
    error = error_from_envelope(502, body)
    assert isinstance(error, InternalError)
    assert "502" in error.detail
