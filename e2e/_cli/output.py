"""How commands speak: a rich rendering for people, one JSON object for scripts (``--json``)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Annotated, Any, Final, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

JsonOption = Annotated[
    bool, typer.Option("--json", help="Print one JSON object instead of the readable summary.")
]

EXIT_USAGE: Final = 2
"""A command given what it cannot act on (a missing directory, options that can never pass)."""

console = Console(highlight=False)
error_console = Console(stderr=True, highlight=False)


def emit(payload: dict[str, Any], *, as_json: bool, render: Callable[[], None]) -> None:
    """Print ``payload`` as JSON for scripts, or call ``render`` for people."""
    if as_json:
        sys.stdout.write(json.dumps(payload, sort_keys=True) + "\n")
        sys.stdout.flush()
    else:
        render()


def usage_error(message: str) -> NoReturn:
    """Print ``error: <message>`` as one line on stderr and exit 2.

    Raises:
        typer.Exit: Always, with exit code 2.
    """
    # soft_wrap: one line whatever the terminal width, so scripts can read it whole.
    error_console.print(f"[red]error[/red]: {escape(message)}", soft_wrap=True)
    raise typer.Exit(EXIT_USAGE)
