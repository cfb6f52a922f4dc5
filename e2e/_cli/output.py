"""How commands speak: a rich rendering for people, one JSON object for scripts (``--json``)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Annotated, Any, Final, NoReturn

import typer
from rich.console import Console, RenderableType
from rich.markup import escape

JsonOption = Annotated[
    bool, typer.Option("--json", help="Print one JSON object instead of the readable summary.")
]

WIDEST_TABLE: Final = 1_000
"""The most columns a table printed to a file or a pipe may take (``print_whole``)."""

EXIT_USAGE: Final = 2
"""A command given what it cannot act on (a missing directory, options that can never pass)."""

console = Console(highlight=False)
error_console = Console(stderr=True, highlight=False)


def print_whole(renderable: RenderableType) -> None:
    """Print a table with no figure cut short.

    To a terminal it prints at the terminal's width, where a column too narrow wraps its cells
    (the tables fold their cells rather than end them in an ellipsis). To a file or a pipe, where
    rich would assume 80 columns, it prints as wide as the table needs: a saved bench run keeps
    every digit.
    """
    if console.is_terminal:
        console.print(renderable)
        return
    natural = console.measure(renderable, options=console.options.update_width(WIDEST_TABLE))
    Console(highlight=False, width=max(console.width, natural.maximum)).print(renderable)


def emit(payload: dict[str, Any], *, as_json: bool, render: Callable[[], None]) -> None:
    """Print ``payload`` as JSON for scripts, or call ``render`` for people."""
    if as_json:
        sys.stdout.write(json.dumps(payload, sort_keys=True) + "\n")
        sys.stdout.flush()
    else:
        render()


def counted(count: int, noun: str) -> str:
    """``1 attempt``, ``3 attempts``: a count and its noun, plural when it is not one."""
    return f"{count:,} {noun}" if count == 1 else f"{count:,} {noun}s"


def usage_error(message: str) -> NoReturn:
    """Print ``error: <message>`` as one line on stderr and exit 2.

    Raises:
        typer.Exit: Always, with exit code 2.
    """
    # soft_wrap: one line whatever the terminal width, so scripts can read it whole.
    error_console.print(f"[red]error[/red]: {escape(message)}", soft_wrap=True)
    raise typer.Exit(EXIT_USAGE)
