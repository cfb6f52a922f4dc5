"""The ``midflight`` command line."""

from __future__ import annotations

import importlib
import sys

import typer

from ._commands import COMMAND_MODULES
from ._lifeline import hold_lifeline, terminate_as_interrupt


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
    """Entry point of the ``midflight`` script.

    A process the harness started dies with its parent (its lifeline, D242). Every command but
    ``serve`` cleans up on SIGTERM and SIGHUP as on Ctrl-C; a server keeps its own handlers
    (uvicorn's, or the several-worker coordinator's).
    """
    hold_lifeline()
    app = build_app()
    if sys.argv[1:2] == ["serve"]:
        app()
        return
    with terminate_as_interrupt():
        app()
