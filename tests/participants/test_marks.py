"""Retire marks and restore fences: refused alike, counted apart, ended differently (D223, D224)."""

from __future__ import annotations

import pytest

from participants._runtime.marks import RetireMarks
from protocols import EpisodeId, StaleAttemptError


def ep(rollout_id: str, attempt: int = 0) -> EpisodeId:
    return EpisodeId(rollout_id=rollout_id, attempt=attempt)


def test_a_fence_refuses_like_a_mark_but_is_counted_apart() -> None:
    marks = RetireMarks()
    marks.fence([ep("r", 1)])
    marks.raise_to([ep("s", 0)])
    assert (marks.retired_rollouts, marks.fenced_rollouts) == (1, 1)
    assert marks.is_retired(ep("r", 0)) and marks.is_retired(ep("r", 1))
    assert not marks.is_retired(ep("r", 2))
    with pytest.raises(StaleAttemptError, match="fenced by a restore"):
        marks.check(ep("r", 1))
    with pytest.raises(StaleAttemptError, match="was retired"):
        marks.check(ep("s", 0))
    assert marks.snapshot() == {"r": 1, "s": 0}  # what a shard process must refuse


def test_a_retire_that_reaches_the_fence_takes_it_over() -> None:
    marks = RetireMarks()
    marks.fence([ep("r", 1)])
    marks.raise_to([ep("r", 0)])  # below the fence: both stay
    assert (marks.retire_marks(), marks.restore_fences()) == ({"r": 0}, {"r": 1})
    marks.raise_to([ep("r", 2)])  # attempt N+1 retired: the mark refuses all the fence did
    assert (marks.retire_marks(), marks.restore_fences()) == ({"r": 2}, {})
    marks.fence([ep("r", 1)])  # a fence under a mark adds nothing
    assert marks.restore_fences() == {}
    assert marks.snapshot() == {"r": 2}


def test_forget_removes_both_and_nothing_else_lowers_a_refusal() -> None:
    marks = RetireMarks()
    marks.fence([ep("r", 3)])
    marks.fence([ep("r", 1)])
    marks.raise_to([ep("s", 4)])
    marks.raise_to([ep("s", 2)])
    assert marks.snapshot() == {"r": 3, "s": 4}
    marks.forget(["r", "s", "unknown"])
    assert marks.snapshot() == {} and (marks.retired_rollouts, marks.fenced_rollouts) == (0, 0)
    marks.check(ep("r", 0))
