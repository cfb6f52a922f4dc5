"""The ``midflight`` command line."""

from __future__ import annotations

import importlib

import typer

from ._commands import COMMAND_MODULES


def build_app() -> typer.Typer:
    """The command-line app with every registered sub-command."""
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
