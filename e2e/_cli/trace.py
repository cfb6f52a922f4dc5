"""``midflight trace DIR``: the checkpoints of a trace directory, and one drawn as a timeline."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from .._trace.checkpoints import Checkpoint, TraceDirectory, read_trace_directory, timeline_file
from .._trace.restores import Restore
from .._trace.spans_file import SPANS_FILE_GLOB
from .output import JsonOption, console, emit, error_console, usage_error


def _read(directory: Path) -> TraceDirectory:
    """The trace directory's checkpoints, or a usage error naming what is wrong with it."""
    if not directory.exists():
        usage_error(f"{directory}: no such directory (name a trace directory: --trace-dir DIR)")
    if not directory.is_dir():
        usage_error(f"{directory}: not a directory (name a trace directory: --trace-dir DIR)")
    if not any(directory.glob(SPANS_FILE_GLOB)):
        usage_error(f"{directory}: no spans files ({SPANS_FILE_GLOB}): was tracing on?")
    try:
        traces = read_trace_directory(directory)
    except OSError as exc:
        usage_error(f"{directory}: cannot read the spans files ({exc.strerror or exc})")
    if not traces.checkpoints:
        usage_error(f"{directory}: no checkpoint in its {traces.span_count} spans")
    return traces


def _published(published: bool | None) -> str:
    return {True: "yes", False: "[red]no[/red]", None: "?"}[published]


def _render(
    checkpoints: list[Checkpoint], restores: list[Restore], drawn: Checkpoint, out: Path | None
) -> None:
    table = Table(title="checkpoints in the trace directory", title_justify="left")
    # Eighty columns wide at most; the restores are listed below the table, one line each.
    for column in ("checkpoint", "pause", "participants", "published", "blockers"):
        table.add_column(column, justify="left" if column == "checkpoint" else "right")
    table.add_column("root")
    for checkpoint in checkpoints:
        blockers = ", ".join(f"{name} {count}" for name, count in checkpoint.blockers.items())
        table.add_row(
            escape(checkpoint.checkpoint_id),
            f"{checkpoint.pause_s:.3f} s",
            str(len(checkpoint.participants)),
            _published(checkpoint.published),
            escape(blockers) if blockers else "0",
            "seen" if checkpoint.root_seen else "[yellow]missing[/yellow]",
        )
    console.print(table)
    for restore in restores:
        of = escape(restore.checkpoint_id or "an unknown checkpoint")
        where = "" if restore.checkpoint_in_directory else " (its checkpoint is not in DIR)"
        named = escape(restore.restore_id or restore.trace_id[:8] + "…")
        console.print(
            f"restore {named} continued {of}: {restore.seconds:.3f} s{where}",
            soft_wrap=True,
        )
    if out is not None:
        console.print(
            f"timeline of {escape(drawn.checkpoint_id)}: {escape(str(out))}", soft_wrap=True
        )


def _draw(checkpoint: Checkpoint, out: Path) -> Path | None:
    """Draw the timeline; ``None``, after one line on stderr, when matplotlib is missing."""
    try:
        from .._trace.timeline import draw_timeline

        return draw_timeline(checkpoint, out)
    except ImportError as exc:
        # The figures are still worth printing: the picture alone needs the plotting library.
        error_console.print(
            f"no timeline drawn: matplotlib is missing ({exc.name or exc}): pip install matplotlib",
            soft_wrap=True,
        )
        return None
    except OSError as exc:
        usage_error(f"{out}: cannot write the timeline ({exc.strerror or exc})")


def register(app: typer.Typer) -> None:
    """Add ``trace`` to the app."""

    @app.command("trace")
    def trace_command(
        directory: Annotated[
            Path, typer.Argument(help="The trace directory (its spans-*.jsonl files).")
        ],
        checkpoint_id: Annotated[
            str | None,
            typer.Option(
                "--checkpoint",
                metavar="ID",
                help="The checkpoint to draw (id or trace id); only it is listed. "
                "Default: the last one to start.",
            ),
        ] = None,
        out: Annotated[
            Path | None,
            typer.Option(
                "--out",
                metavar="PATH",
                help="Where to write the PNG. Default: DIR/timeline-<id>.png.",
                dir_okay=False,
            ),
        ] = None,
        as_json: JsonOption = False,
    ) -> None:
        """Summarize the checkpoints a traced run wrote and draw one as a timeline (PNG)."""
        traces = _read(directory)
        drawn = traces.find(checkpoint_id)
        if drawn is None:
            known = ", ".join(checkpoint.checkpoint_id for checkpoint in traces.checkpoints)
            usage_error(f"no checkpoint {checkpoint_id!r} in {directory} (there: {known})")
        listed = [drawn] if checkpoint_id is not None else list(traces.checkpoints)
        shown = {checkpoint.trace_id for checkpoint in listed}
        restores = [
            restore
            for restore in traces.restores
            if checkpoint_id is None or restore.checkpoint_trace_id in shown
        ]
        written = _draw(drawn, out if out is not None else timeline_file(directory, drawn))
        payload: dict[str, Any] = {
            "checkpoints": [checkpoint.to_json() for checkpoint in listed],
            "restores": [restore.to_json() for restore in restores],
            "drawn": drawn.checkpoint_id,
            "out": None if written is None else str(written),
        }
        emit(payload, as_json=as_json, render=lambda: _render(listed, restores, drawn, written))
