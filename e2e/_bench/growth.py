"""How a suite's cost grows with the number of rollouts: per-rollout cost and the slope.

A figure that is linear in the rollout count has a constant cost per rollout and a slope between
two sizes equal to it; a figure that grows faster shows it in both. Each suite adds, to every row,
``us_per_rollout`` (the figure divided by its rollouts, in microseconds) and, between each pair of
consecutive sizes, the slope: microseconds per *added* rollout, and how the per-rollout cost of
the larger size compares with the smaller (``per_rollout_ratio``; 1.0 is linear).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any


def us_per_rollout(seconds: float | None, rollouts: int) -> float | None:
    """``seconds`` per rollout in microseconds (rounded), or ``None`` without a figure."""
    if seconds is None or rollouts <= 0:
        return None
    return round(seconds / rollouts * 1e6, 1)


def slopes(rows: Sequence[Mapping[str, Any]], figure: str) -> list[dict[str, Any]]:
    """The slope of ``figure`` between each pair of consecutive sizes (rows sorted by size).

    Rows without the figure (a failed rung) are left out. Each entry: ``from`` and ``to`` (the
    rollout counts), ``us_per_added_rollout`` (the difference of the figure over the difference
    of the counts) and ``per_rollout_ratio`` (per-rollout cost at ``to`` over that at ``from``).
    """
    measured = sorted(
        (row for row in rows if isinstance(row.get(figure), int | float) and row["rollouts"] > 0),
        key=lambda row: row["rollouts"],
    )
    found = []
    for small, large in itertools.pairwise(measured):
        added = large["rollouts"] - small["rollouts"]
        if added <= 0:
            continue  # the same size twice: no slope between them
        small_each = small[figure] / small["rollouts"]
        large_each = large[figure] / large["rollouts"]
        found.append(
            {
                "figure": figure,
                "from": small["rollouts"],
                "to": large["rollouts"],
                "us_per_added_rollout": round((large[figure] - small[figure]) / added * 1e6, 1),
                "per_rollout_ratio": round(large_each / small_each, 3) if small_each > 0 else None,
            }
        )
    return found


def add_growth(rows: list[dict[str, Any]], figure: str) -> list[dict[str, Any]]:
    """Put ``us_per_rollout`` on every row and ``slope_us_per_added_rollout`` on every row
    after the smallest (from the next smaller size); the slopes, for the suite's top level."""
    for row in rows:
        row["us_per_rollout"] = us_per_rollout(row.get(figure), row["rollouts"])
    found = slopes(rows, figure)
    by_size = {entry["to"]: entry for entry in found}
    for row in rows:
        entry = by_size.get(row["rollouts"])
        row["slope_us_per_added_rollout"] = None if entry is None else entry["us_per_added_rollout"]
    return found
