"""``midflight version``."""

from __future__ import annotations

import platform
from importlib.metadata import version as package_version

import typer

from .output import JsonOption, console, emit


def register(app: typer.Typer) -> None:
    """Add ``version`` to the app."""

    @app.command("version")
    def version_command(as_json: JsonOption = False) -> None:
        """Print the midflight version."""
        payload = {"midflight": package_version("midflight"), "python": platform.python_version()}
        emit(
            payload,
            as_json=as_json,
            render=lambda: console.print(
                f"midflight {payload['midflight']} (python {payload['python']})"
            ),
        )
