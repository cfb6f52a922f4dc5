"""A restore's scope as an index, and one validation per list of records."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from participants._runtime.restore_batch import RestoreScope, validate_batch
from protocols import EpisodeId, InvalidCheckpointStateError

R1 = EpisodeId(rollout_id="r1", attempt=1)
R2 = EpisodeId(rollout_id="r2")


def test_a_record_naming_a_scoped_attempt_is_that_attempt_not_a_new_validation() -> None:
    scope = RestoreScope([R1, R2])
    assert scope.episode({"rollout_id": "r1", "attempt": 1}) is R1
    assert scope.episode({"rollout_id": "r2"}) is R2  # the attempt may be left out
    assert scope.episode({"rollout_id": "r2", "attempt": 0}) is R2
    assert scope.in_scope({"rollout_id": "r1", "attempt": 1})


@pytest.mark.parametrize(
    "raw",
    [
        {"rollout_id": "r1", "attempt": True},  # strict: a bool is not an attempt
        {"rollout_id": "r1", "attempt": 1.0},
        {"rollout_id": "r1", "attempt": "1"},
        {"rollout_id": "r1", "attempt": 1, "extra": 0},
        {"rollout_id": "r2", "extra": 0},
        {"attempt": 1},
        {"rollout_id": 1},
        {},
        ["r1", 1],
        None,
    ],
)
def test_what_validation_refuses_is_never_looked_up_and_is_still_refused(raw: Any) -> None:
    scope = RestoreScope([R1, R2])
    assert scope.lookup(raw) is None
    with pytest.raises(ValidationError):
        scope.episode(raw)


def test_an_attempt_outside_the_scope_is_validated_in_full() -> None:
    scope = RestoreScope([R1])
    outside = scope.episode({"rollout_id": "r1", "attempt": 2})
    assert outside == EpisodeId(rollout_id="r1", attempt=2) and outside not in scope
    assert not scope.in_scope({"rollout_id": "r1", "attempt": 0})
    # A capture key that collides with a scoped one does not make an invalid id valid.
    with pytest.raises(ValidationError):
        scope.in_scope({"rollout_id": "r1-a1", "attempt": 0})


def test_next_attempts_are_built_once_and_the_scope_reads_as_its_episodes() -> None:
    scope = RestoreScope([R1, R2, R1])
    assert scope.next_attempt(R1) is scope.next_attempt(EpisodeId(rollout_id="r1", attempt=1))
    assert scope.next_attempt(R1) == EpisodeId(rollout_id="r1", attempt=2)
    assert list(scope) == [R1, R2, R1] and len(scope) == 3 and scope[1] is R2
    assert RestoreScope.of(scope) is scope
    assert list(RestoreScope.of([R2])) == [R2]
    assert "r1" not in scope


def test_a_batch_is_refused_naming_the_first_record_that_failed() -> None:
    adapter = TypeAdapter(list[EpisodeId])
    good = {"rollout_id": "r1"}
    assert validate_batch(adapter, [good, good], "item") == [EpisodeId(rollout_id="r1")] * 2
    with pytest.raises(InvalidCheckpointStateError, match=r"^item 2 is malformed: .*attempt"):
        validate_batch(adapter, [good, good, {"rollout_id": "r2", "attempt": -1}, 7], "item")
