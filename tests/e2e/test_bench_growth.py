"""Per-rollout cost and the slope between sizes, as every scale suite reports them."""

from __future__ import annotations

from typing import Any

from e2e._bench.growth import add_growth, slopes, us_per_rollout


def test_per_rollout_cost_and_slope_between_consecutive_sizes() -> None:
    rows: list[dict[str, Any]] = [
        {"rollouts": 4000, "restore_s": 2.0},
        {"rollouts": 1000, "restore_s": 0.4},
        {"rollouts": 16000, "restore_s": 12.0},
    ]
    found = add_growth(rows, "restore_s")
    assert [row["us_per_rollout"] for row in rows] == [500.0, 400.0, 750.0]
    assert [row["slope_us_per_added_rollout"] for row in rows] == [533.3, None, 833.3]
    assert [(s["from"], s["to"], s["per_rollout_ratio"]) for s in found] == [
        (1000, 4000, 1.25),
        (4000, 16000, 1.5),
    ]
    assert {s["figure"] for s in found} == {"restore_s"}


def test_a_linear_figure_has_a_slope_equal_to_its_per_rollout_cost() -> None:
    rows = [{"rollouts": n, "wall_s": n * 250e-6} for n in (10, 20, 40)]
    assert [s["us_per_added_rollout"] for s in slopes(rows, "wall_s")] == [250.0, 250.0]
    assert [s["per_rollout_ratio"] for s in slopes(rows, "wall_s")] == [1.0, 1.0]


def test_rows_without_the_figure_are_left_out_of_the_slopes() -> None:
    rows: list[dict[str, Any]] = [
        {"rollouts": 1000, "restore_s": 1.0},
        {"rollouts": 4000, "error": "MemoryError"},
        {"rollouts": 4000, "restore_s": 2.0},
        {"rollouts": 4000, "restore_s": 3.0},
    ]
    assert [(s["from"], s["to"]) for s in slopes(rows, "restore_s")] == [(1000, 4000)]
    assert us_per_rollout(None, 10) is None and us_per_rollout(1.0, 0) is None
