"""The ``midflight`` command line."""

from __future__ import annotations

import importlib
from typing import Any

import typer
from typer.core import TyperOption

from ._commands import COMMAND_MODULES

_display_type_rich = TyperOption.display_type_rich


def _flag_display_type(self: TyperOption, ctx: Any) -> str | None:
    # typer's rich help prints a type for every option, flags included (`--json <bool>`), while
    # its plain help prints none for a flag: a flag takes no value, so it shows no placeholder.
    if self.is_flag or self.count:
        return None
    return _display_type_rich(self, ctx)


def build_app() -> typer.Typer:
    """The command-line app with every registered sub-command."""
    TyperOption.display_type_rich = _flag_display_type  # type: ignore[method-assign]
    app = typer.Typer(
        name="midflight",
        help="Checkpoint reinforcement-learning rollouts in flight; restore them after a crash.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(app)
    return app


def main() -> None:
    """Entry point of the ``midflight`` script."""
    build_app()()
