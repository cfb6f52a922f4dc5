"""How commands speak: a rich rendering for people, one JSON object for scripts (``--json``)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Annotated, Any

import typer
from rich.console import Console

JsonOption = Annotated[
    bool, typer.Option("--json", help="Print one JSON object instead of the readable summary.")
]

console = Console(highlight=False)
error_console = Console(stderr=True, highlight=False)


def emit(payload: dict[str, Any], *, as_json: bool, render: Callable[[], None]) -> None:
    """Print ``payload`` as JSON for scripts, or call ``render`` for people."""
    if as_json:
        sys.stdout.write(json.dumps(payload, sort_keys=True) + "\n")
        sys.stdout.flush()
    else:
        render()
