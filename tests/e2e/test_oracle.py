"""The drill oracle's notion of a deliberate rerun, and of calls counted per incarnation.

A straggler retired at prepare, or an attempt the controller retires of its own accord, runs again
from its input, so its calls repeat by design; a restored rollout calling the model again does
not. A restore of an older checkpoint brings back capture keys that already ran: each
incarnation of the deployment counts its own calls.
"""

from __future__ import annotations

import math
from typing import Any

from e2e._drill.oracle import (
    RepeatedCalls,
    RerunWindow,
    calls_by_incarnation,
    count_repeats,
    reruns_from_input,
)


def _dispatch(rollout: str, attempt: int, t: float) -> dict[str, Any]:
    return {"event": "dispatch", "rollout": rollout, "attempt": attempt, "t": t}


def _admit(key: str, t: float) -> dict[str, Any]:
    return {
        "event": "admit",
        "capture_key": key,
        "t": t,
        "request_digest": "d",
        "model_call_id": key,
    }


def test_only_the_attempt_after_a_blocking_one_is_a_deliberate_rerun() -> None:
    driver = [
        _dispatch("r1", 0, 1),
        _dispatch("r2", 0, 2),
        {"event": "crash", "phase": 0, "t": 3},
        {"event": "restore", "restored": ["r1-a1", "r2-a1"], "t": 4},
        _dispatch("r1", 1, 5),  # restored: continues, its repeats count
        _dispatch("r2", 1, 6),
        {"event": "prepare_blocked", "blockers": ["r2-a1"], "t": 7},
        _dispatch("r2", 2, 8),  # the straggler, run again from its input
        _dispatch("r1", 2, 9),  # r1-a1 never blocked: a repeat of r1-a2 still counts
    ]
    assert reruns_from_input(driver) == [RerunWindow("r2-a2", 8, math.inf)]


def test_a_retire_the_controller_chose_makes_the_next_attempt_a_rerun() -> None:
    driver = [
        _dispatch("r", 0, 1),
        {"event": "retire", "key": "r", "t": 2},
        _dispatch("r", 1, 3),
    ]
    assert reruns_from_input(driver) == [RerunWindow("r-a1", 3, math.inf)]


def test_a_rerun_ends_at_the_next_crash_and_a_restored_key_counts_again() -> None:
    # The issue-18 interleaving: r0-a2 restored, blocked a prepare, reran as r0-a3; then a crash
    # restored the same checkpoint, and later a checkpoint of r0-a2 restored r0-a3 as a
    # continuation: that incarnation of r0-a3 is no rerun.
    driver = [
        {"event": "restore", "restored": ["r0-a2"], "t": 10},
        _dispatch("r0", 2, 11),
        {"event": "prepare_blocked", "blockers": ["r0-a2"], "t": 12},
        _dispatch("r0", 3, 13),
        {"event": "crash", "phase": 1, "t": 14},
        {"event": "restore", "restored": ["r0-a2"], "t": 15},
        _dispatch("r0", 2, 16),
        {"event": "crash", "phase": 2, "t": 17},
        {"event": "restore", "restored": ["r0-a3"], "t": 18},
        _dispatch("r0", 3, 19),
    ]
    (window,) = reruns_from_input(driver)
    assert window == RerunWindow("r0-a3", 13, 14)
    assert window.covers("r0-a3", 13.5)
    assert not window.covers("r0-a3", 19.5)  # the restored continuation's repeats count
    assert not window.covers("r0-a2", 13.5)


def test_calls_are_counted_per_incarnation() -> None:
    driver = [
        {"event": "restore", "t": 10},
        {"event": "restore", "t": 20},
    ]
    policy = [
        _admit("r4", 1),
        _admit("r4", 2),
        _admit("r4-a1", 11),
        _admit("r4-a1", 12),  # lost with the second crash
        *(_admit("r4-a1", 21 + i) for i in range(4)),  # the same key, restored again
        {"event": "egress", "capture_key": "r4-a1", "t": 30},
    ]
    assert calls_by_incarnation(driver, policy) == {"r4": [2, 0, 0], "r4-a1": [0, 2, 4]}


def _call(key: str, digest: str, t: float) -> dict[str, Any]:
    return {"event": "admit", "capture_key": key, "t": t, "request_digest": digest}


def test_a_call_a_restored_checkpoint_delivered_repeats_unless_a_rerun_came_in_between() -> None:
    # Seed 108 of the hunt: restore 1 delivered r1's call "c"; r1-a1 is retired and r1-a2 reruns
    # from input; its checkpoint (before it made "c") is restored as r1-a3, which makes "c":
    # no repeat. Without the rerun, r1-a3 making "c" after restore 1 is one.
    rerun = [
        {"event": "restore", "t": 10},
        _dispatch("r1", 1, 11),
        {"event": "retire", "key": "r1-a1", "t": 12},
        _dispatch("r1", 2, 13),
        {"event": "crash", "phase": 1, "t": 14},
        {"event": "restore", "t": 15},
        _dispatch("r1", 3, 16),
    ]
    policy = [_call("r1-a2", "c", 13.5), _call("r1-a3", "c", 17)]
    delivered = [{("r1", "c")}, set()]
    assert count_repeats(rerun, policy, delivered) == RepeatedCalls(
        repeated=0, by_rerun=2, delivered=1
    )
    continued = [e for e in rerun if e.get("event") != "retire" and e.get("attempt") != 2]
    policy = [_call("r1-a3", "c", 17)]
    assert count_repeats(continued, policy, delivered) == RepeatedCalls(
        repeated=1, by_rerun=0, delivered=1
    )
