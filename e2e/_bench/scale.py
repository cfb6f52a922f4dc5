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

from .common import PARKING
from .growth import add_growth, us_per_rollout
from .growth import slopes as slopes_of
from .restore import crash_restore_cycle

LADDER: Final = (1000, 4000, 16_000, 50_000)
GROWTH_MARGIN: Final = 1.5
"""A rung is skipped when the previous rung's time or peak memory, scaled by size and this
margin, would not fit in what is left of the budget or of the machine's available memory."""


def peak_rss_mb() -> float:
    """The peak resident memory of this process or of the largest child it waited for, the
    parked cluster of a crash-restore cycle (D376), whichever is larger (Linux reports KiB)."""
    peaks = (
        resource.getrusage(who).ru_maxrss
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return round(max(peaks) / 1024, 1)


def available_memory_mb() -> float | None:
    """Memory the kernel could give this process now (``MemAvailable``), or ``None`` off Linux."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def _would_not_fit(
    previous: dict[str, Any], rollouts: int, left_s: float, budget_s: float
) -> tuple[str, str] | None:
    """(resource, why) when a rung of ``rollouts`` would outlast the budget or the memory."""
    scale = rollouts / previous["rollouts"] * GROWTH_MARGIN
    expected = previous["wall_s"] * scale
    if expected > left_s:
        return "time", (
            f"time budget: {rollouts} rollouts would take about {expected:.0f} s "
            f"and {left_s:.0f} s of the {budget_s:.0f} s budget are left"
        )
    available = available_memory_mb()
    if available is not None:
        # The process's peak so far is the previous (largest) rung's; what it holds beyond the
        # memory it has now is what the next rung would have to find.
        needed = previous["peak_rss_mb"] * scale - current_rss_mb()
        if needed > available:
            return "memory", (
                f"memory: {rollouts} rollouts would need about {needed / 1024:.1f} GiB more "
                f"(peak {previous['peak_rss_mb'] / 1024:.1f} GiB at {previous['rollouts']}) and "
                f"{available / 1024:.1f} GiB are available"
            )
    return None


def current_rss_mb() -> float:
    """This process's resident memory now (0 when it cannot be read)."""
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0.0
    return round(pages * resource.getpagesize() / 2**20, 1)


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
    limited_resource: str | None = None
    for index, rollouts in enumerate(ladder):
        if rungs:
            left = budget_s - (time.monotonic() - started)
            refusal = _would_not_fit(rungs[-1], rollouts, left, budget_s)
            if refusal is not None:
                limited_resource, limited_by = refusal
                # Every size not tried still gets its row, saying what ran out.
                rungs.append({"rollouts": rollouts, "skipped": limited_by, "resource": refusal[0]})
                rungs += [
                    {"rollouts": later, "skipped": f"not tried: the climb stopped at {rollouts}"}
                    for later in ladder[index + 1 :]
                ]
                break
        rung_started = time.monotonic()
        try:
            row = anyio.run(_cycle, directory / f"n{rollouts}", rollouts)
        except Exception as exc:  # the report says what broke, whatever it was
            limited_by = f"{rollouts} rollouts failed: {type(exc).__name__}: {exc}"[:2000]
            limited_resource = "memory" if isinstance(exc, MemoryError) else "error"
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
            limited_resource = "lost"
            break
    measured = [r for r in rungs if "error" not in r and "skipped" not in r]
    clean = [r["rollouts"] for r in measured if r.get("lost") == 0]
    slopes = add_growth(measured, "restore_s")
    for rung in measured:
        rung["wall_us_per_rollout"] = us_per_rollout(rung["wall_s"], rung["rollouts"])
    return {
        "suite": "scale",
        "parking": PARKING,
        "largest_clean": max(clean, default=0),
        "limited_by": limited_by,
        "limited_resource": limited_resource,
        "budget_s": budget_s,
        "rungs": rungs,
        "slopes": slopes + slopes_of(measured, "wall_s"),
    }
