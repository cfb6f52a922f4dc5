"""Where sub-commands are registered.

Each area of the project adds its commands in a module of its own that exposes
``register(app: typer.Typer) -> None``, and lists that module here. The order is the order of
``midflight --help``.
"""

from __future__ import annotations

from typing import Final

COMMAND_MODULES: Final[tuple[str, ...]] = (
    "e2e._cmd_version",
    "e2e._cmd_drill",
    "e2e._cmd_demo",
    "e2e._cmd_serve",
    "e2e._cmd_bench",
    "e2e._cmd_control",
    "e2e._cmd_retention",
)
