"""One checkpoint drawn as a timeline (a PNG): one lane per process, one bar per span.

Top to bottom: the coordinator (its stages as labelled bars), each participant server (main
process, then its shards), each inference worker. A participant's operations (prepare, commit,
resume, …) are full-height bars coloured by operation; the work inside them (wait_ready, the
generation cut, export, write, manifest, read, install) is drawn as thinner bars over them. A
prepare that reported blockers is hatched red and annotated with the count; the cut round is
annotated with its counts. The pause (admission closed) is the shaded band behind every lane.

matplotlib is imported when a picture is drawn, not when this module is: reading a trace
directory and printing its figures need no plotting library.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Final

from protocols import (
    EXPORT_SPAN,
    GENERATION_CUT_SPAN,
    INSTALL_SPAN,
    MANIFEST_SPAN,
    READ_SPAN,
    WAIT_READY_SPAN,
    WORKER_CUT_SPAN,
    WRITE_SPAN,
    operation_span,
    shard_span,
)

from .checkpoints import Checkpoint, CutRound
from .spans import Span, attribute_of, int_attribute_of

if TYPE_CHECKING:
    from matplotlib.axes import Axes

OPERATION_COLOURS: Final = {
    "prepare": "#4C72B0",
    "renew": "#937860",
    "commit": "#55A868",
    "restore": "#DD8452",
    "resume": "#8172B2",
    "retire": "#DA8BC3",
    "forget": "#8C8C8C",
}
"""A participant's operation (and the coordinator stage driving it) → its bar's colour."""

WORK_COLOURS: Final = {
    WAIT_READY_SPAN: ("wait_ready", "#A6CEE3"),
    GENERATION_CUT_SPAN: ("generation cut", "#E6AB02"),
    WORKER_CUT_SPAN: ("generation cut", "#E6AB02"),
    EXPORT_SPAN: ("export", "#B2DF8A"),
    WRITE_SPAN: ("write", "#1B7837"),
    MANIFEST_SPAN: ("manifest", "#66C2A5"),
    READ_SPAN: ("read", "#FDBF6F"),
    INSTALL_SPAN: ("install", "#B15928"),
}
"""The work inside an operation (a thinner bar) → its legend label and colour."""

PUBLISH_COLOUR: Final = "#CCB974"
BLOCKER_COLOUR: Final = "#D62728"
PAUSE_COLOUR: Final = "#FFF6DB"
REFUSED_COLOUR: Final = "#8B0000"
OTHER_COLOUR: Final = "#BBBBBB"

# Lane i spans y in [i - 0.5, i + 0.5] (the axis is inverted: lane 0 on top). The upper strip is
# kept for text (blocker counts, cut counts, narrow stage names), the bars sit below it.
_TEXT_Y: Final = -0.3
_BAR_Y: Final = 0.12
_BAR_HEIGHT: Final = 0.58
_WORK_HEIGHT: Final = 0.26
_FONT: Final = 7.5
_NOT_DRAWN: Final = (
    "gym.checkpoint.call.",
    "gym.checkpoint.coordinate.",
    "gym.checkpoint.collection.",
)
"""Drawn otherwise: the coordinator's calls (its participants' spans show them), stages, root."""


def _seconds_text(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 0.1 else f"{seconds:.2f} s"


def _published_text(published: bool | None) -> str:
    return {True: "published", False: "not published", None: "publication unknown"}[published]


def title_of(checkpoint: Checkpoint) -> str:
    """``checkpoint ck-0003 — pause 0.42 s, 4 participants, published``."""
    count = len(checkpoint.participants)
    # Without a participant prepare and resume the pause is only bounded by the spans there.
    about = "" if checkpoint.pause_basis == "prepare_to_resume" else "~"
    return (
        f"checkpoint {checkpoint.checkpoint_id} — pause {about}{_seconds_text(checkpoint.pause_s)}, "
        f"{count} participant{'s' if count != 1 else ''}, {_published_text(checkpoint.published)}"
    )


def _subtitle(checkpoint: Checkpoint) -> str:
    started = datetime.fromtimestamp(checkpoint.start_ns / 1e9, tz=UTC)
    basis = {
        "prepare_to_resume": "pause: first participant prepare → last resume",
        "root": "pause: the coordinator's whole checkpoint (no participant prepare/resume pair)",
        "spans": "pause: every span's extent (no root, no resume)",
    }[checkpoint.pause_basis]
    parts = [f"trace {checkpoint.trace_id}", f"started {started:%Y-%m-%d %H:%M:%S.%f}"[:-3], basis]
    if not checkpoint.root_seen:
        parts.append("root span missing")
    if checkpoint.blockers:
        parts.append(f"{sum(checkpoint.blockers.values())} blockers")
    if checkpoint.restores:
        parts.append(f"restores: {len(checkpoint.restores)}")
    return " · ".join(parts)


def _cut_text(cut: CutRound) -> str:
    counts = {name: "?" if value is None else value for name, value in cut.counts.items()}
    text = f"cut {counts['cut']} of {counts['calls']} calls"
    for name, label in (("cut_skipped", "skipped"), ("cut_failed", "failed")):
        if counts[name] not in (0, "?"):
            text += f", {counts[name]} {label}"
    if counts["workers"] != "?":
        text += f" · {counts['workers']} worker{'s' if counts['workers'] != 1 else ''}"
    return text


def _operation_of(span: Span) -> str | None:
    for operation in OPERATION_COLOURS:
        if span.name in (operation_span(operation), shard_span(operation)):
            return operation
    return None


def _stage_colour(stage_name: str) -> str:
    operation = stage_name.split("/", 1)[0]
    return (
        PUBLISH_COLOUR if operation == "publish" else OPERATION_COLOURS.get(operation, OTHER_COLOUR)
    )


class _Labels:
    """Places text without overlaps: each label takes the first row (or lane slot) that is free."""

    def __init__(self, axes: Axes) -> None:
        self.axes = axes
        self.taken: dict[float, list[tuple[float, float]]] = {}

    def width(self, text: str, size: float) -> float:
        """The text's width in data units (x) at this font size."""
        probe = self.axes.text(0, 0, text, fontsize=size)
        box = probe.get_window_extent()  # the figure's own renderer
        probe.remove()
        inverse = self.axes.transData.inverted()
        return float(inverse.transform((box.x1, 0))[0] - inverse.transform((box.x0, 0))[0])

    def place(self, x: float, rows: Sequence[float], text: str, colour: str) -> None:
        """Left-align ``text`` at ``x`` on the first of ``rows`` where it overlaps nothing."""
        width = self.width(text, _FONT)
        pad = width * 0.08
        for y in rows:
            spans = self.taken.setdefault(y, [])
            if all(x + width + pad <= left or x >= right + pad for left, right in spans):
                spans.append((x, x + width))
                self.axes.text(x, y, text, fontsize=_FONT, color=colour, va="center")
                return
        # Every row is taken: shift right after the last label of the first row.
        y = rows[0]
        x = max(right for _, right in self.taken[y]) + pad
        self.taken[y].append((x, x + width))
        self.axes.text(x, y, text, fontsize=_FONT, color=colour, va="center")


@dataclass
class _Frame:
    """The axes being drawn on, the time scale, the labels placed so far and the legend."""

    axes: Axes
    origin_ns: int
    scale: float
    shortest: float
    labels: _Labels
    legend: dict[str, str]

    def x(self, ns: int) -> float:
        """A time on the axis (``ns`` since the epoch)."""
        return (ns - self.origin_ns) / self.scale

    def width(self, seconds: float) -> float:
        """A duration on the axis, at least a sliver wide."""
        return max(seconds * 1e9 / self.scale, self.shortest)

    def bar(self, y: float, left: float, width: float, height: float, colour: str) -> None:
        """One span's bar."""
        self.axes.barh(
            y, width, left=left, height=height, color=colour, edgecolor="white", linewidth=0.5
        )


def _draw_stages(frame: _Frame, checkpoint: Checkpoint, coordinator: int | None) -> None:
    for stage in checkpoint.stages:
        left = stage.start_s * 1e9 / frame.scale
        width = frame.width(stage.seconds)
        frame.axes.axvline(left, color="#999999", linewidth=0.5, linestyle=":")
        if coordinator is None:
            continue  # the coordinator's process wrote no span: only the boundaries are known
        colour = _stage_colour(stage.name)
        frame.legend.setdefault(
            "publish" if colour == PUBLISH_COLOUR else stage.name.split("/")[0], colour
        )
        frame.bar(coordinator + _BAR_Y, left, width, _BAR_HEIGHT, colour)
        if frame.labels.width(stage.name, _FONT) < width * 0.92:
            frame.axes.text(
                left + width / 2, coordinator + _BAR_Y, stage.name, fontsize=_FONT,
                color="white", ha="center", va="center", fontweight="bold",
            )  # fmt: skip
        else:
            rows = (coordinator + _TEXT_Y, coordinator - 0.75)
            frame.labels.place(left, rows, stage.name, "#333333")


def _draw_span(frame: _Frame, span: Span, row: int) -> None:
    left, width = frame.x(span.start_ns), frame.width(span.seconds)
    operation = _operation_of(span)
    if operation is not None:
        colour = OPERATION_COLOURS[operation]
        frame.legend.setdefault(operation, colour)
        frame.bar(row + _BAR_Y, left, width, _BAR_HEIGHT, colour)
        blockers = int_attribute_of(span, "blockers")
        if operation == "prepare" and blockers:
            frame.axes.barh(
                row + _BAR_Y, width, left=left, height=_BAR_HEIGHT, fill=False,
                hatch="////", edgecolor=BLOCKER_COLOUR, linewidth=1.2,
            )  # fmt: skip
            frame.labels.place(left, (row + _TEXT_Y,), f"{blockers} blockers", BLOCKER_COLOUR)
        outcome, code = attribute_of(span, "outcome"), attribute_of(span, "code")
        if isinstance(outcome, str) and outcome != "ok":
            frame.axes.barh(
                row + _BAR_Y, width, left=left, height=_BAR_HEIGHT, fill=False,
                edgecolor=REFUSED_COLOUR, linewidth=1.5, linestyle="--",
            )  # fmt: skip
            text = f"{operation} {outcome}" + (f": {code}" if isinstance(code, str) else "")
            frame.labels.place(left, (row + _TEXT_Y,), text, REFUSED_COLOUR)
    elif span.name in WORK_COLOURS:
        label, colour = WORK_COLOURS[span.name]
        frame.legend.setdefault(label, colour)
        frame.bar(row + _BAR_Y, left, width, _WORK_HEIGHT, colour)
    elif not span.name.startswith(_NOT_DRAWN):
        frame.legend.setdefault("other span", OTHER_COLOUR)
        frame.bar(row + _BAR_Y, left, width, _WORK_HEIGHT, OTHER_COLOUR)


def draw_timeline(checkpoint: Checkpoint, path: Path) -> Path:
    """Draw ``checkpoint`` as a PNG at ``path`` (its folder is created) and return the path.

    Raises:
        ImportError: matplotlib is not installed.
        OSError: The file could not be written.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display on a server; the Agg backend only writes files
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    lanes = checkpoint.lanes
    spans = checkpoint.spans
    # At least a millisecond wide, so a checkpoint of zero-length spans still has an axis.
    extent = max(max(span.end_ns for span in spans) - checkpoint.start_ns, 1_000_000)
    scale, unit = (1e6, "milliseconds") if extent < 2e9 else (1e9, "seconds")
    top = 0.5 if checkpoint.stages else 0.0  # a row above the lanes for narrow stages' names
    # Margins fixed in inches, so the axes' size is known before anything is measured on it.
    height = 0.55 * (len(lanes) + top) + 2.0
    left = 0.35 + 0.075 * max(len(lane.label) for lane in lanes)
    figure = plt.figure(figsize=(12, height), dpi=120)
    figure.subplots_adjust(
        left=left / 12, right=1 - 0.3 / 12, top=1 - 0.62 / height, bottom=1.15 / height
    )
    axes = figure.add_subplot()
    axes.set_xlim(
        min(0.0, (min(s.start_ns for s in spans) - checkpoint.start_ns) / scale),
        extent / scale * 1.03,
    )
    axes.set_ylim(len(lanes) - 0.5, -0.5 - top)
    frame = _Frame(
        axes,
        checkpoint.start_ns,
        scale,
        extent / scale * 0.003,
        _Labels(axes),
        {},
    )

    pause_from = checkpoint.pause_start_s * 1e9 / scale
    axes.axvspan(pause_from, pause_from + checkpoint.pause_s * 1e9 / scale, color=PAUSE_COLOUR)
    for index in range(1, len(lanes)):
        axes.axhline(index - 0.5, color="#DDDDDD", linewidth=0.6)
    coordinator = next((i for i, lane in enumerate(lanes) if lane.role == "coordinator"), None)
    _draw_stages(frame, checkpoint, coordinator)
    row_of = {lane.process: index for index, lane in enumerate(lanes)}
    for span in spans:
        _draw_span(frame, span, row_of[span.process])
    for cut in checkpoint.cuts:
        rows = [row_of[lane.process] for lane in lanes if lane.process.server == cut.participant]
        frame.labels.place(
            cut.start_s * 1e9 / scale, (rows[0] + _TEXT_Y,), _cut_text(cut), "#7A5C00"
        )

    axes.set_yticks(range(len(lanes)), [lane.label for lane in lanes], fontsize=9)
    axes.tick_params(axis="y", length=0)
    axes.set_xlabel(f"{unit} since the checkpoint started", fontsize=9)
    axes.grid(axis="x", linewidth=0.3, color="#CCCCCC")
    axes.set_axisbelow(True)
    for side in ("top", "right"):
        axes.spines[side].set_visible(False)
    figure.suptitle(title_of(checkpoint), fontsize=12, fontweight="bold", y=1 - 0.08 / height)
    axes.set_title(_subtitle(checkpoint), fontsize=8, color="#555555", pad=8)

    order = [*OPERATION_COLOURS, "publish", *(label for label, _ in WORK_COLOURS.values())]
    drawn = sorted(
        frame.legend.items(), key=lambda item: order.index(item[0]) if item[0] in order else 99
    )
    handles = [Patch(facecolor=colour, label=label) for label, colour in drawn]
    if checkpoint.blockers:
        handles.append(
            Patch(facecolor="white", edgecolor=BLOCKER_COLOUR, hatch="////", label="blockers")
        )
    handles.append(Patch(facecolor=PAUSE_COLOUR, label="admission closed (pause)"))
    figure.legend(
        handles=handles, loc="lower center", bbox_to_anchor=(0.5, 0.0), ncol=min(len(handles), 8),
        fontsize=8, frameon=False,
    )  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path
