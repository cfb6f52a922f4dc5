"""The drill oracle's notion of a deliberate rerun: a straggler retired at prepare runs again from
its input, so its calls repeat by design; a restored rollout calling the model again does not."""

from __future__ import annotations

from typing import Any

from e2e._oracle import straggler_reruns


def _dispatch(rollout: str, attempt: int) -> dict[str, Any]:
    return {"event": "dispatch", "rollout": rollout, "attempt": attempt}


def test_only_the_attempt_after_a_blocking_one_is_a_deliberate_rerun() -> None:
    driver = [
        _dispatch("r1", 0),
        _dispatch("r2", 0),
        {"event": "restore", "restored": ["r1-a1", "r2-a1"]},
        _dispatch("r1", 1),  # restored: continues, its repeats count
        _dispatch("r2", 1),
        {"event": "prepare_blocked", "blockers": ["r2-a1"]},
        _dispatch("r2", 2),  # the straggler, run again from its input
        _dispatch("r1", 2),  # r1-a1 never blocked: a repeat of r1-a2 still counts
    ]
    assert straggler_reruns(driver) == {"r2-a2"}


def test_a_blocker_of_attempt_zero_makes_attempt_one_a_rerun() -> None:
    driver = [_dispatch("r", 0), {"event": "prepare_blocked", "blockers": ["r"]}, _dispatch("r", 1)]
    assert straggler_reruns(driver) == {"r-a1"}
