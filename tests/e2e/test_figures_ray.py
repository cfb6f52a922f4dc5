"""The drill's verdict from its figures: on Ray hosting (a process left running, a crash that
killed nothing), and a run too idle to prove that no delivered call was repeated."""

from __future__ import annotations

from typing import Any

from e2e._drill.oracle import ERROR_FIGURES, Figures


def green_on_ray(**changes: Any) -> Figures:
    """The figures of a passing two-crash run on Ray (every other check satisfied)."""
    values: dict[str, Any] = {
        **dict.fromkeys(ERROR_FIGURES, 0),
        "checkpoints": 3,
        "crashes": 2,
        "restored_per_crash": [3, 3],
        "held_delivered": 2,
        "stale_probes_per_crash": [12, 12],
        "restored": 6,
        "restored_delivered": 5,
        "cut_continued": 4,
        "on": "ray",
        "ray_processes_killed": [7, 7],
        "ray_left_running": 0,
    }
    return Figures({**values, **changes})


def test_a_green_run_on_ray_passes() -> None:
    assert green_on_ray().failed_checks(require_cuts=True) == []


def test_a_process_of_the_head_left_running_fails_the_drill() -> None:
    assert green_on_ray(ray_left_running=2).failed_checks() == ["ray_left_running = 2"]


def test_a_crash_that_killed_no_process_fails_the_drill() -> None:
    for killed in ([7, 0], [7], [], None):
        reasons = green_on_ray(ray_processes_killed=killed).failed_checks()
        assert reasons == [f"a crash on Ray killed no process (killed per crash: {killed})"]


def test_a_local_run_needs_no_ray_figures() -> None:
    figures = green_on_ray(on="local")
    del figures.values["ray_processes_killed"]
    assert figures.failed_checks() == []


def test_a_run_whose_restored_checkpoints_recorded_no_delivered_call_proves_nothing() -> None:
    reasons = green_on_ray(restored_delivered=0).failed_checks()
    assert reasons == ["no restored checkpoint recorded a delivered call"]
    # Restart-only rollouts restore nothing, so there is nothing a repeat could be checked against.
    restarts = green_on_ray(
        restored_delivered=0, restored=0, restored_per_crash=[0, 0], restarted_per_crash=[2, 2]
    )
    assert restarts.failed_checks() == []


def test_a_crash_that_brought_nothing_back_fails_the_drill_and_is_named() -> None:
    reasons = green_on_ray(restored_per_crash=[3, 0], restored=3).failed_checks()
    assert reasons == ["a crash restored nothing (crash 2 of 2)"]
    both = green_on_ray(restored_per_crash=[0, 0], restored=0, restored_delivered=0)
    assert both.failed_checks() == ["a crash restored nothing (crash 1, 2 of 2)"]
    # Rollouts run again from their input (restart-only resources) are brought back too.
    restarted = green_on_ray(restored_per_crash=[3, 0], restarted_per_crash=[0, 4])
    assert restarted.failed_checks() == []
