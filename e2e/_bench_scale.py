"""The scale benchmark: the largest number of rollouts in flight carried through a checkpoint, a
crash and a restore with nothing lost.

It climbs a ladder of sizes; at each one it runs the whole crash-restore cycle with
``finish=True`` (every restored rollout runs to its end) and stops at the first size that loses
anything, fails, or would outlast the time budget judged from the previous rung. The report names
the largest clean size and what stopped the climb. Every rung carries the restore's cost per
rollout (``us_per_rollout``) and the whole cycle's (``wall_us_per_rollout``); ``slopes`` gives both
between consecutive rungs (microseconds per added rollout).
"""

from __future__ import annotations

import resource
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import anyio

from ._bench_common import PARKING
from ._bench_growth import add_growth, us_per_rollout
from ._bench_growth import slopes as slopes_of
from ._bench_restore import crash_restore_cycle

LADDER: Final = (1000, 4000, 16_000, 50_000)
GROWTH_MARGIN: Final = 1.5
"""A rung is skipped when the previous rung's time, scaled by size and this margin, would not
fit in what is left of the budget (the cycle's cost grows a little faster than linearly)."""


def peak_rss_mb() -> float:
    """This process's peak resident memory (Linux reports KiB)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


async def _cycle(root: Path, rollouts: int) -> dict[str, Any]:
    return await crash_restore_cycle(root, rollouts, finish=True)


def run_scale_bench(
    directory: Path, *, ladder: Sequence[int] = LADDER, budget_s: float = 3600.0
) -> dict[str, Any]:
    """Climb ``ladder``; one JSON-ready object with every rung and the largest clean size.

    Args:
        directory: An empty scratch directory on the disk to measure.
        ladder: Sizes to try, smallest first.
        budget_s: Wall time allowed for the whole climb.
    """
    started = time.monotonic()
    rungs: list[dict[str, Any]] = []
    limited_by = f"none: every size of the ladder {list(ladder)} passed"
    for rollouts in ladder:
        if rungs:
            previous = rungs[-1]
            expected = previous["wall_s"] * rollouts / previous["rollouts"] * GROWTH_MARGIN
            left = budget_s - (time.monotonic() - started)
            if expected > left:
                limited_by = (
                    f"time budget: {rollouts} rollouts would take about {expected:.0f} s "
                    f"and {left:.0f} s of the {budget_s:.0f} s budget are left"
                )
                break
        rung_started = time.monotonic()
        try:
            row = anyio.run(_cycle, directory / f"n{rollouts}", rollouts)
        except Exception as exc:  # the report says what broke, whatever it was
            limited_by = f"{rollouts} rollouts failed: {type(exc).__name__}: {exc}"[:2000]
            rungs.append(
                {
                    "rollouts": rollouts,
                    "error": traceback.format_exception_only(exc)[-1].strip()[:500],
                    "wall_s": round(time.monotonic() - rung_started, 3),
                    "peak_rss_mb": peak_rss_mb(),
                }
            )
            break
        row["wall_s"] = round(time.monotonic() - rung_started, 3)
        row["peak_rss_mb"] = peak_rss_mb()
        rungs.append(row)
        if row["lost"]:
            limited_by = f"{rollouts} rollouts lost {row['lost']}"
            break
    clean = [r["rollouts"] for r in rungs if "error" not in r and r.get("lost") == 0]
    measured = [r for r in rungs if "error" not in r]
    slopes = add_growth(measured, "restore_s")
    for rung in measured:
        rung["wall_us_per_rollout"] = us_per_rollout(rung["wall_s"], rung["rollouts"])
    return {
        "suite": "scale",
        "parking": PARKING,
        "largest_clean": max(clean, default=0),
        "limited_by": limited_by,
        "budget_s": budget_s,
        "rungs": rungs,
        "slopes": slopes + slopes_of(measured, "wall_s"),
    }
