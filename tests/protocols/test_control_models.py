"""The control-route wire models, pinned by golden JSON and by their refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from protocols import (
    CheckpointRequest,
    CommitReply,
    CommitRequest,
    ErrorEnvelope,
    ForgetReply,
    ForgetRequest,
    PrepareReply,
    PrepareReport,
    RenewReply,
    RestoreReply,
    RestoreRequest,
    ResumeReply,
    RetireReply,
    RetireRequest,
    StatusReply,
    dump_wire,
    encode_wire,
)
from protocols._control import CONTROL_ROUTES

GOLDEN = Path(__file__).parent.parent / "golden" / "control"

CASES: list[tuple[str, type[BaseModel]]] = [
    ("prepare_request", CheckpointRequest),
    ("commit_request", CommitRequest),
    ("commit_request_null_scope", CommitRequest),
    ("restore_request", RestoreRequest),
    ("retire_request", RetireRequest),
    ("forget_request", ForgetRequest),
    ("prepare_reply", PrepareReply),
    ("renew_reply", RenewReply),
    ("commit_reply", CommitReply),
    ("restore_reply", RestoreReply),
    ("resume_reply", ResumeReply),
    ("retire_reply", RetireReply),
    ("forget_reply", ForgetReply),
    ("status_reply", StatusReply),
    ("error_envelope", ErrorEnvelope),
]


def _golden(name: str) -> Any:
    return json.loads((GOLDEN / f"{name}.json").read_text())


@pytest.mark.parametrize(("name", "model"), CASES)
def test_golden_json_round_trips_exactly(name: str, model: type[BaseModel]) -> None:
    golden = _golden(name)
    parsed = model.model_validate_json(json.dumps(golden))
    assert dump_wire(parsed) == golden
    assert json.loads(encode_wire(parsed)) == golden  # the bytes a client sends (D357)


def test_every_route_is_pinned() -> None:
    assert set(CONTROL_ROUTES) == {
        "status",
        "prepare",
        "renew",
        "commit",
        "restore",
        "resume",
        "retire",
        "forget",
    }
    pinned = {model for _, model in CASES}
    for _method, request, reply in CONTROL_ROUTES.values():
        assert reply in pinned
        assert request is None or request in pinned


REQUESTS: list[tuple[str, type[BaseModel]]] = [c for c in CASES if c[0].endswith("request")]


@pytest.mark.parametrize(("name", "model"), REQUESTS)
def test_requests_refuse_unknown_fields(name: str, model: type[BaseModel]) -> None:
    body = _golden(name) | {"surprise": 1}
    with pytest.raises(ValidationError, match="surprise"):
        model.model_validate_json(json.dumps(body))


@pytest.mark.parametrize(("name", "model"), REQUESTS)
@pytest.mark.parametrize(
    "change",
    [
        {"deadline_ts": "1767225600"},
        {"deadline_ts": None},
        {"checkpoint_id": ""},
        {"checkpoint_id": "../up"},
        {"checkpoint_id": "c" * 129},
        {"checkpoint_id": 7},
    ],
)
def test_requests_refuse_bad_ids_and_deadlines(
    name: str, model: type[BaseModel], change: dict[str, Any]
) -> None:
    with pytest.raises(ValidationError):
        model.model_validate_json(json.dumps(_golden(name) | change))


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_deadlines_are_refused(token: str) -> None:
    with pytest.raises(ValidationError, match="finite"):
        CheckpointRequest.model_validate_json(f'{{"checkpoint_id": "c", "deadline_ts": {token}}}')


def test_missing_deadline_is_refused() -> None:
    with pytest.raises(ValidationError, match="deadline_ts"):
        CheckpointRequest.model_validate_json('{"checkpoint_id": "c"}')


def test_an_integer_deadline_is_a_float() -> None:
    request = CheckpointRequest.model_validate_json('{"checkpoint_id": "c", "deadline_ts": 17}')
    assert request.deadline_ts == 17.0


@pytest.mark.parametrize(
    ("model", "body"),
    [
        (RetireRequest, {"episode_ids": []}),
        (ForgetRequest, {"rollout_ids": []}),
        (ForgetRequest, {"rollout_ids": ["ok", "bad id"]}),
        (ForgetRequest, {"rollout_ids": "r-001"}),
        (RetireRequest, {"episode_ids": [{"rollout_id": "r-a1"}]}),
        (RetireRequest, {"episode_ids": [{"rollout_id": "r", "attempt": -1}]}),
        (RetireRequest, {"episode_ids": [{"rollout_id": "r", "attempt": "1"}]}),
        (RetireRequest, {"episode_ids": [{"rollout_id": "r", "attempt": True}]}),
        (CommitRequest, {"checkpoint_dir": "", "episode_ids": None}),
        (CommitRequest, {"checkpoint_dir": "/d", "stop": "yes"}),
        (RestoreRequest, {"checkpoint_dir": "/d"}),
    ],
)
def test_request_specific_refusals(model: type[BaseModel], body: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        model.model_validate_json(json.dumps({"checkpoint_id": "c", "deadline_ts": 1.0} | body))


def test_a_restore_scope_may_not_name_the_last_attempt_but_retire_may() -> None:
    # A restore installs attempt N + 1; attempt 9,999 has none, so its scope is refused (D361).
    def body(attempt: int) -> dict[str, Any]:
        episodes = [{"rollout_id": "q"}, {"rollout_id": "r", "attempt": attempt}]
        return {"checkpoint_id": "c", "deadline_ts": 1.0, "episode_ids": episodes}

    restore = RestoreRequest.model_validate(body(9998) | {"checkpoint_dir": "/d"})
    assert restore.episode_ids[1].attempt == 9998
    with pytest.raises(ValidationError, match="r-a9999 is attempt 9999"):
        RestoreRequest.model_validate(body(9999) | {"checkpoint_dir": "/d"})
    assert RetireRequest.model_validate(body(9999)).episode_ids[1].attempt == 9999


def test_a_restore_scope_may_not_name_two_attempts_of_one_rollout() -> None:
    # The later attempt's fence would refuse what the earlier one installs (D365).
    def scope(*episodes: dict[str, Any]) -> dict[str, Any]:
        return {
            "checkpoint_id": "c",
            "deadline_ts": 1.0,
            "checkpoint_dir": "/d",
            "episode_ids": [{"rollout_id": "q"}, *episodes],
        }

    with pytest.raises(ValidationError, match=r"two attempts of rollout 'r' \(r-a2 and r\)"):
        RestoreRequest.model_validate(scope({"rollout_id": "r", "attempt": 2}, {"rollout_id": "r"}))
    repeated = RestoreRequest.model_validate(scope({"rollout_id": "r"}, {"rollout_id": "r"}))
    assert len(repeated.episode_ids) == 3  # the same attempt twice is one episode, kept as sent


def test_commit_defaults() -> None:
    request = CommitRequest.model_validate_json(
        '{"checkpoint_id": "c", "deadline_ts": 1, "checkpoint_dir": "/d"}'
    )
    assert request.episode_ids is None
    assert request.stop is False


def test_reports_cap_listed_blockers_at_100() -> None:
    PrepareReport(ready=False, blockers=[f"r{i}" for i in range(100)], blocker_count=5000)
    with pytest.raises(ValidationError):
        PrepareReport(ready=False, blockers=[f"r{i}" for i in range(101)], blocker_count=101)


def test_strict_replies_refuse_extras_but_status_and_commit_carry_them() -> None:
    with pytest.raises(ValidationError):
        ResumeReply.model_validate({"phase": "idle", "idempotent": True, "more": 1})
    status = StatusReply.model_validate(_golden("status_reply"))
    assert dump_wire(status)["restored_pending"] == []
    commit = CommitReply.model_validate(_golden("commit_reply"))
    assert dump_wire(commit)["staging_keys_by_episode"] == {"r-001": ["s1"], "r-002-a3": ["s2"]}
