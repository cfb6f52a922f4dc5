"""``midflight bench plot FILE``: a bench's picture drawn again from its saved JSON.

A bench run with ``--out DIR`` draws its picture at once; this command draws it from the JSON
object such a run wrote (or printed with ``--json``), so a picture can be redrawn, or drawn for a
run saved without ``--out``, without measuring again. A file that is not such an object is one
``error:`` line and exit 2, and nothing is written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from .._bench.plots import check_plottable, draw
from .output import JsonOption, console, emit, usage_error


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc)


def add_plot_command(bench: typer.Typer) -> None:
    """Add ``bench plot`` to the ``bench`` group."""

    @bench.command("plot")
    def plot_command(
        source: Annotated[
            Path,
            typer.Argument(
                help="A bench's JSON (checkpoint, restore or scale): what --out wrote, or what "
                "--json printed.",
                show_default=False,
            ),
        ],
        out: Annotated[
            Path | None,
            typer.Option("--out", help="The PNG to write. Default: FILE with the suffix .png."),
        ] = None,
        as_json: JsonOption = False,
    ) -> None:
        """Draw a bench's picture again from its JSON, without measuring anything."""
        target = out if out is not None else source.with_suffix(".png")
        try:
            text = source.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            why = _why(exc) if isinstance(exc, OSError) else "not UTF-8 text"
            usage_error(f"{source}: cannot be read ({why})")
        try:
            payload = json.loads(text)
        except json.JSONDecodeError as exc:
            usage_error(f"{source}: not JSON ({exc.msg}, line {exc.lineno})")
        try:
            suite, rows = check_plottable(payload)
        except ValueError as exc:  # check_plottable says why the payload has no picture
            usage_error(f"{source}: {exc}")
        if target.resolve() == source.resolve():
            usage_error(f"--out {target}: that is the JSON being drawn")
        if target.is_dir():
            usage_error(f"--out {target} is a directory: name the PNG to write")
        try:
            draw(payload, target)
        except OSError as exc:
            usage_error(f"--out {target}: the picture cannot be written there ({_why(exc)})")
        result = {"suite": suite, "rows": len(rows), "written": [str(target)]}
        emit(
            result,
            as_json=as_json,
            render=lambda: console.print(f"wrote {target} ({suite}, {len(rows)} rows drawn)"),
        )
