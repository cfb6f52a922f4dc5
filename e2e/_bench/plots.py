"""The pictures of a bench's figures: checkpoint, restore and scale, each against rollouts.

``--out DIR`` draws ``<suite>.png`` beside ``<suite>.json``, and ``midflight bench plot FILE``
draws it again from a saved JSON object, so a half-hour ``bench scale`` need not run twice for its
picture. Every drawing checks the whole payload first (:func:`check_plottable`): a file that is
not a bench's JSON, or a row without a figure the picture needs, is refused before anything is
drawn or written.

The axes are logarithmic in rollouts, as the benches' sizes are (100 to 50,000), and each
picture marks the goals of issue 20 where it has one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from .restore_servers import RESTORED_INTO, RestoreServers

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

ROWS_KEY = {"checkpoint": "rows", "restore": "rows", "scale": "rungs"}
"""Where each plotted suite keeps its rows; a suite not here has no picture."""

NEEDED = {
    "checkpoint": ("rollouts", "pause_s", "overhead_s", "floor_s"),
    "restore": ("rollouts", "restore_s", "floor_s", "us_per_rollout"),
    "scale": ("rollouts", "pause_s", "restore_s", "floor_s", "us_per_rollout", "peak_rss_mb"),
}
"""The figures each suite's picture reads from every row it draws."""

PER_ROLLOUT_GROWTH_GOAL = 1.3
"""Issue 20: restore per rollout at 16,000 within 1.3 times that at 4,000."""


def plot_file(suite: str) -> str:
    """The picture's file name for ``suite``: ``checkpoint.png``."""
    return f"{suite}.png"


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_positive(value: object) -> bool:
    """A finite number above zero: what a log axis can draw (every bench figure is one)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < math.inf


def check_plottable(payload: object) -> tuple[str, list[dict[str, Any]]]:
    """The suite and the rows to draw: every measured row, by rollouts.

    A ``bench scale`` rung that was skipped or failed is not a measured row; at least one row
    must be measured, and every figure it draws is a finite number above zero (the axes are
    logarithmic).

    Raises:
        ValueError: ``payload`` is not a bench's JSON object, its suite has no picture,
            or a measured row lacks a figure (or holds one that is not a positive number).
    """
    if not isinstance(payload, Mapping):
        raise ValueError("not a bench's JSON object")
    suite = payload.get("suite")
    if suite not in ROWS_KEY:
        known = ", ".join(sorted(ROWS_KEY))
        raise ValueError(f"suite {suite!r} has no picture (pictures exist for {known})")
    rows = payload.get(ROWS_KEY[suite])
    if not isinstance(rows, list) or not all(isinstance(row, Mapping) for row in rows):
        raise ValueError(f"{ROWS_KEY[suite]!r} is not a list of rows")
    measured = [dict(row) for row in rows if "skipped" not in row and "error" not in row]
    if not measured:
        raise ValueError(f"no measured row in {ROWS_KEY[suite]!r}")
    for index, row in enumerate(measured):
        for field in NEEDED[suite]:
            if not _is_positive(row.get(field)):
                raise ValueError(f"measured row {index} has no positive number in {field!r}")
    measured.sort(key=lambda row: row["rollouts"])
    return suite, measured


def _unmeasured(payload: Mapping[str, Any], suite: str) -> list[str]:
    """``50,000 (memory)``: each row of ``payload`` not drawn, with why."""
    notes = []
    for row in payload.get(ROWS_KEY[suite], []):
        why = row.get("skipped") or row.get("error")
        if why is not None:
            rollouts = row.get("rollouts")
            size = f"{rollouts:,}" if _is_number(rollouts) else "?"
            notes.append(f"{size} ({str(why)[:60]})")
    return notes


def _figure(panels: int) -> tuple[Figure, list[Axes]]:
    import matplotlib

    matplotlib.use("Agg")  # no display on a server; the Agg backend only writes files
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.5), dpi=120, squeeze=False)
    return figure, list(axes[0])


def _rollouts_axis(axes: Axes, counts: Sequence[float], *, log_y: bool, ylabel: str) -> None:
    """Rollouts on a log scale, ticked at the sizes measured and written out (``16,000``)."""
    from matplotlib.ticker import NullFormatter

    axes.set_xscale("log")
    axes.set_xticks(list(counts), [f"{count:,.0f}" for count in counts])
    axes.xaxis.set_minor_formatter(NullFormatter())
    if log_y:
        axes.set_yscale("log")
    axes.set_xlabel("rollouts in flight")
    axes.set_ylabel(ylabel)
    axes.grid(True, which="both", linewidth=0.3)
    axes.legend(fontsize=8)


def _column(rows: Sequence[Mapping[str, Any]], field: str) -> list[float]:
    return [float(row[field]) for row in rows]


def _lines(
    axes: Axes, rows: Sequence[Mapping[str, Any]], series: Sequence[tuple[str, str, str]]
) -> list[float]:
    """One line per ``(field, label, style)`` against rollouts; the rollouts."""
    counts = _column(rows, "rollouts")
    for field, label, style in series:
        axes.plot(counts, _column(rows, field), style, label=label)
    return counts


def _draw_checkpoint(
    payload: Mapping[str, Any], rows: list[dict[str, Any]], axes: list[Axes]
) -> str:
    counts = _lines(
        axes[0],
        rows,
        (
            ("pause_s", "admission closed (prepare → resume)", "o-"),
            ("overhead_s", "control-plane overhead (no boundary wait)", "s--"),
            ("floor_s", "floor: same bytes, one fsync per file", "^:"),
        ),
    )
    floors = _column(rows, "floor_s")
    axes[0].plot(
        counts, [3 * floor for floor in floors], "--", color="grey", label="3 times the floor"
    )
    axes[0].plot(
        [4000, 16_000], [2.0, 5.0], "x", color="grey", label="goals: 2 s at 4,000; 5 s at 16,000"
    )
    _rollouts_axis(axes[0], counts, log_y=True, ylabel="seconds (median)")
    return "midflight bench checkpoint"


def _floor_range(rows: Sequence[Mapping[str, Any]]) -> tuple[list[float], list[float]] | None:
    """How far each row's floor samples reach below and above its median (D445), if listed."""
    below, above = [], []
    for row in rows:
        samples = row.get("floor_samples_s")
        if not isinstance(samples, list) or not samples or not all(map(_is_positive, samples)):
            return None
        below.append(float(row["floor_s"]) - min(samples))
        above.append(max(samples) - float(row["floor_s"]))
    return below, above


def _per_rollout_panel(axes: Axes, rows: Sequence[Mapping[str, Any]], label: str) -> None:
    counts = _column(rows, "rollouts")
    axes.plot(counts, _column(rows, "us_per_rollout"), "o-", label=label)
    by_size = {row["rollouts"]: float(row["us_per_rollout"]) for row in rows}
    if 4000 in by_size:
        limit = by_size[4000] * PER_ROLLOUT_GROWTH_GOAL
        axes.axhline(
            limit, color="grey", linestyle=":", label="goal: 1.3 times the figure at 4,000"
        )
        # A horizontal line does not stretch the axis: leave room to see it above the figures.
        axes.set_ylim(top=max(limit, *by_size.values()) * 1.15)
    axes.set_ylim(bottom=0)
    _rollouts_axis(axes, counts, log_y=False, ylabel="µs per rollout")


def _floor_line(axes: Axes, rows: Sequence[Mapping[str, Any]], label: str) -> list[float]:
    """The restore's floor against rollouts, each with the spread of its samples when listed;
    the floors."""
    counts, floors = _column(rows, "rollouts"), _column(rows, "floor_s")
    spread = _floor_range(rows)
    if spread is None:
        axes.plot(counts, floors, "^:", label=label)
    else:
        axes.errorbar(counts, floors, yerr=spread, fmt="^:", capsize=3, label=label)
    return floors


def _draw_restore(payload: Mapping[str, Any], rows: list[dict[str, Any]], axes: list[Axes]) -> str:
    counts = _column(rows, "rollouts")
    axes[0].plot(counts, _column(rows, "restore_s"), "o-", label="restore (request → every reply)")
    floors = _floor_line(
        axes[0], rows, "floor: read the records, write them again (median of its samples)"
    )
    axes[0].plot(
        counts, [10 * floor for floor in floors], "--", color="grey", label="10 times the floor"
    )
    axes[0].plot([16_000], [5.0], "x", color="grey", label="goal: 5 s at 16,000")
    _rollouts_axis(axes[0], counts, log_y=True, ylabel="seconds (median)")
    _per_rollout_panel(axes[1], rows, "restore per rollout")
    servers = str(payload.get("servers", RestoreServers.in_process))
    where = RESTORED_INTO.get(servers, RESTORED_INTO[RestoreServers.in_process])
    return f"midflight bench restore: restored into {where}"


def _draw_scale(payload: Mapping[str, Any], rows: list[dict[str, Any]], axes: list[Axes]) -> str:
    counts = _lines(
        axes[0], rows, (("pause_s", "checkpoint pause", "o-"), ("restore_s", "restore", "s-"))
    )
    _floor_line(axes[0], rows, "restore's floor (median of its samples)")
    _rollouts_axis(axes[0], counts, log_y=True, ylabel="seconds")
    _per_rollout_panel(axes[1], rows, "restore per rollout")
    memory = axes[1].twinx()
    memory.plot(counts, _column(rows, "peak_rss_mb"), "d--", color="tab:red", label="peak RSS")
    memory.set_ylabel("peak RSS, MB", color="tab:red")
    memory.set_ylim(bottom=0)
    # Away from the memory line, which climbs to the upper right corner.
    axes[1].legend(fontsize=8, loc="upper left")
    memory.legend(fontsize=8, loc="center left")
    return "midflight bench scale: checkpoint → crash → restore, none lost"


_Drawing: TypeAlias = "Callable[[Mapping[str, Any], list[dict[str, Any]], list[Axes]], str]"
"""Draws a payload's rows into the panels; returns the picture's title."""

_DRAW: dict[str, tuple[int, _Drawing]] = {
    "checkpoint": (1, _draw_checkpoint),
    "restore": (2, _draw_restore),
    "scale": (2, _draw_scale),
}


def draw(payload: Mapping[str, Any], path: Path) -> Path:
    """Draw ``payload``'s picture into ``path`` (a PNG); the path.

    Raises:
        ValueError: As :func:`check_plottable`; nothing is written.
        OSError: ``path`` cannot be written.
    """
    suite, rows = check_plottable(payload)
    panels, draw_panels = _DRAW[suite]
    figure, axes = _figure(panels)
    title = draw_panels(payload, rows, axes)
    if notes := _unmeasured(payload, suite):
        title += "\nnot drawn: " + "; ".join(notes)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    import matplotlib.pyplot as plt

    plt.close(figure)
    return path
