"""What a restore does once per record and no more: next keys, the read's selection, installs.

A restore of thousands of rollouts spends its time on per-record steps on each participant
(D432); each test below pins one step that is no longer done twice, and that the result is the
one the longer way gave.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from participants._agent.session import AgentSession, AgentSessionState
from participants._environment.models import EnvironmentRecord, restored_records
from participants._runtime.restore import _restored_keys, _ScopeSelection
from participants._runtime.restore_batch import RestoreScope
from protocols import MAX_ATTEMPT, EpisodeId, InvalidCheckpointStateError

R1 = EpisodeId(rollout_id="r1", attempt=3)
R2 = EpisodeId(rollout_id="r2")


def _no_next_attempts(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: EpisodeId) -> EpisodeId:
        raise AssertionError("a next attempt was built")

    monkeypatch.setattr(EpisodeId, "next_attempt", refuse)


def test_a_next_key_is_the_next_attempt_s_key_without_building_the_attempt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scope = RestoreScope([R1, R2])
    expected = {e: e.next_attempt().capture_key for e in (R1, R2)}
    assert expected == {R1: "r1-a4", R2: "r2-a1"}
    _no_next_attempts(monkeypatch)
    assert {e: scope.next_key(e) for e in (R1, R2)} == expected
    assert scope.next_key(EpisodeId(rollout_id="r1", attempt=3)) is scope.next_key(R1)


def test_the_last_attempt_has_no_next_key() -> None:
    last = EpisodeId(rollout_id="r1", attempt=MAX_ATTEMPT)
    with pytest.raises(ValidationError):
        RestoreScope([last]).next_key(last)


def _record(raw: Any) -> dict[str, Any]:
    return {"episode_id": raw, "payload": 1}


def test_the_read_s_selection_remembers_whom_each_kept_record_names() -> None:
    scope = RestoreScope([R1, R2])
    selection = _ScopeSelection(scope)
    records = [
        _record({"rollout_id": "r2"}),
        _record({"rollout_id": "r9"}),  # valid, outside the scope: dropped
        _record({"rollout_id": "r1", "attempt": 3}),
        _record({"rollout_id": "r1", "attempt": "3"}),  # malformed: kept, to be refused
        {"payload": 1},  # no episode id: kept, to be refused
    ]
    kept = [record for record in records if selection(record)]
    assert kept == [records[0], records[2], records[3], records[4]]
    assert selection.named == [R2, R1, None, None]
    assert selection.named[0] is R2 and selection.named[1] is R1


def _both_selected() -> tuple[RestoreScope, list[dict[str, Any]], _ScopeSelection]:
    """The scope of R1 and R2, a record naming each, and the read's selection of both."""
    scope = RestoreScope([R1, R2])
    records = [_record({"rollout_id": "r2"}), _record({"rollout_id": "r1", "attempt": 3})]
    selection = _ScopeSelection(scope)
    assert all(selection(record) for record in records)
    return scope, records, selection


def _counting(monkeypatch: pytest.MonkeyPatch, method: str) -> list[Any]:
    """Every argument ``RestoreScope.<method>`` is called with, from now on."""
    called: list[Any] = []
    real = getattr(RestoreScope, method)

    def counted(self: RestoreScope, argument: Any) -> Any:
        called.append(argument)
        return real(self, argument)

    monkeypatch.setattr(RestoreScope, method, counted)
    return called


def test_restored_keys_use_the_selection_and_refuse_what_it_could_not_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scope, records, selection = _both_selected()
    looked_up = _counting(monkeypatch, "lookup")
    assert _restored_keys(records, scope, selection.named) == ["r1-a4", "r2-a1"]
    assert looked_up == []  # each record was looked up once, by the read
    # Without the read's names (a read that kept other records), each is looked up again.
    assert _restored_keys(records, scope, []) == ["r1-a4", "r2-a1"]
    assert len(looked_up) == 2
    with pytest.raises(InvalidCheckpointStateError, match="1"):
        _restored_keys([records[0], {"payload": 1}], scope, [R2, None])


def test_restored_keys_of_a_whole_selection_are_formatted_in_one_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scope, records, selection = _both_selected()
    per_record = _counting(monkeypatch, "next_key")
    _no_next_attempts(monkeypatch)
    # D439: every record named a scoped attempt, so no key is made record by record.
    assert _restored_keys(records, scope, selection.named) == ["r1-a4", "r2-a1"]
    assert per_record == []
    # One record the read could not name: the keys are made one by one, with the same result.
    assert _restored_keys(records, scope, [R2, None]) == ["r1-a4", "r2-a1"]
    assert per_record == [R2, R1]


def test_a_whole_selection_holding_the_last_attempt_is_refused() -> None:
    last = EpisodeId(rollout_id="r1", attempt=MAX_ATTEMPT)
    scope = RestoreScope([R2, last])
    assert scope.next_keys([R2]) == ["r2-a1"]
    with pytest.raises(ValidationError):
        scope.next_keys([R2, last])
    with pytest.raises(ValidationError):
        _restored_keys(
            [_record({"rollout_id": "r2"}), _record({"rollout_id": "r1"})], scope, [R2, last]
        )


def _environment_record(raw: Any, boundary: Any = None) -> dict[str, Any]:
    return {"episode_id": raw, "task_digest": "a" * 64, "boundary": boundary}


def test_environment_records_are_validated_under_their_next_attempt_without_a_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    outside = EpisodeId(rollout_id="r7", attempt=1)  # not in the scope: validated, then moved
    scope = RestoreScope([R1, R2])
    copies: list[Any] = []
    copy = EnvironmentRecord.model_copy

    def counted(self: EnvironmentRecord, **kwargs: Any) -> EnvironmentRecord:
        copies.append(self)
        return copy(self, **kwargs)

    monkeypatch.setattr(EnvironmentRecord, "model_copy", counted)
    records = [
        _environment_record({"rollout_id": "r1", "attempt": 3}),
        _environment_record({"rollout_id": "r2"}),
        _environment_record(outside.model_dump()),
    ]
    moved = restored_records(records, scope)
    assert sorted(moved) == ["r1-a4", "r2-a1", "r7-a2"]
    assert moved["r1-a4"].episode_id is scope.next_attempt(R1)
    assert moved["r2-a1"].episode_id is scope.next_attempt(R2)
    assert moved["r7-a2"].episode_id == outside.next_attempt()
    assert len(copies) == 1  # only the record outside the scope was copied
    assert records[0]["episode_id"] == {"rollout_id": "r1", "attempt": 3}  # left as read
    assert moved["r1-a4"].model_dump(mode="json")["episode_id"] == {
        "rollout_id": "r1",
        "attempt": 4,
    }


def test_a_malformed_environment_record_is_refused_by_its_index() -> None:
    scope = RestoreScope([R1, R2])
    records = [
        _environment_record({"rollout_id": "r1", "attempt": 3}),
        _environment_record({"rollout_id": "r2"}, boundary={"next": "fly"}),
    ]
    with pytest.raises(InvalidCheckpointStateError, match=r"^environment record 1 is malformed"):
        restored_records(records, scope)
    # A record refused whole shows the episode id it was read with, not its next attempt.
    del records[1]["task_digest"]
    with pytest.raises(InvalidCheckpointStateError) as refused:
        restored_records(records, scope)
    assert "'rollout_id': 'r2'" in str(refused.value) and "attempt=1" not in str(refused.value)


def test_a_restored_agent_session_holds_its_messages_as_the_dumps_of_its_state() -> None:
    state = AgentSessionState.model_validate(
        {
            "conversation": [
                {"role": "system", "content": "counter"},
                {"content": "r1 0", "role": "user"},
            ],
            "resources_session_id": "s1",
            "task_input": {"activations": 2, "turns": 1, "max_tokens": 8, "seed": 0},
            "completed_activation": 0,
            "turn_in_activation": 0,
            "stored_reply": None,
        }
    )
    session = AgentSession.restored(EpisodeId(rollout_id="r1", attempt=1), state)
    assert session.conversation == [message.model_dump() for message in state.conversation]
    session.conversation[0]["content"] = "changed"  # a copy: the validated state is untouched
    assert state.conversation[0].content == "counter"


def test_a_model_restore_checks_its_records_and_keys_them_in_one_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from participants._model.records import checked_restore

    cut = {
        "model_call_id": "c1",
        "request_digest": "a" * 64,
        "continuation": {
            "source_capture_key": "r1-a3",
            "source_model_call_id": "c1",
            "staging_keys": ["__generation_cut__/c1/1"],
            "prefix_token_count": 4,
            "prefix_digest": "b" * 64,
            "effective_output_limit": 32,
        },
    }
    row = {"model_call_id": "c0", "staging_key": "k0"}
    records = [
        {"episode_id": {"rollout_id": "r1", "attempt": 3}, "rows": [row], "generation_cuts": [cut]},
    ]
    third = EpisodeId(rollout_id="r3")  # scoped, without a record: an empty ledger
    scope = RestoreScope([R1, R2, third])
    monkeypatch.setattr(RestoreScope, "next_key", _refuse_next_key)  # D442: no key per record
    _no_next_attempts(monkeypatch)
    ledgers, cuts = checked_restore(records, scope)
    assert ledgers == {"r1-a4": [{**row, "capture_key": "r1-a3"}], "r2-a1": [], "r3-a1": []}
    assert list(cuts) == ["r1-a4"] and cuts["r1-a4"].model_call_id == "c1"
    outside = [{"episode_id": {"rollout_id": "r9"}, "rows": [], "generation_cuts": []}]
    with pytest.raises(InvalidCheckpointStateError, match="outside the restore scope"):
        checked_restore(outside, scope)
    not_rows = [{"episode_id": {"rollout_id": "r2"}, "rows": [1], "generation_cuts": []}]
    with pytest.raises(InvalidCheckpointStateError, match="rows must be a list of objects"):
        checked_restore(not_rows, scope)


def _refuse_next_key(self: RestoreScope, episode: EpisodeId) -> str:
    raise AssertionError(f"the next key of {episode} was made alone")
