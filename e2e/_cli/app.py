"""The ``midflight`` command line."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Final

import typer
import typer.rich_utils
from typer.core import TyperOption

from participants import raise_open_file_limit

from .._launch.lifeline import hold_lifeline, terminate_as_interrupt

COMMAND_MODULES: Final[tuple[str, ...]] = (
    "e2e._cli.version",
    "e2e._cli.drill",
    "e2e._cli.drivers",
    "e2e._cli.demo",
    "e2e._cli.serve",
    "e2e._cli.model",
    "e2e._cli.bench",
    "e2e._cli.control",
    "e2e._cli.retention",
    "e2e._cli.trace",
)
"""Modules that each add their commands (``register(app)``), in the order of ``midflight --help``."""

_display_type_rich = TyperOption.display_type_rich


def _flag_display_type(self: TyperOption, ctx: Any) -> str | None:
    # typer's rich help prints a type for every option, flags included (`--json <bool>`), while
    # its plain help prints none for a flag: a flag takes no value, so it shows no placeholder.
    if self.is_flag or self.count:
        return None
    return _display_type_rich(self, ctx)


def _one_line_error(self: Any) -> None:
    # click's own errors (a missing or malformed option, a file that is not there) as one line on
    # stderr, like the commands' usage errors, instead of a usage line, a hint and a boxed panel.
    if type(self).__name__ == "NoArgsIsHelpError":  # the help was printed already
        return
    ctx = getattr(self, "ctx", None)
    hint = f" (see {ctx.command_path} --help)" if ctx is not None else ""
    sys.stderr.write(f"error: {self.format_message()}{hint}\n")


def build_app() -> typer.Typer:
    """The command-line app with every registered sub-command."""
    TyperOption.display_type_rich = _flag_display_type  # type: ignore[method-assign]
    typer.rich_utils.rich_format_error = _one_line_error
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
    (uvicorn's, or the main process's of a server with several processes). Every process may
    open as many files as its hard limit allows, up to what tens of thousands of rollouts in
    flight need (D387); the processes it starts inherit that.
    """
    hold_lifeline()
    raise_open_file_limit()
    app = build_app()
    if sys.argv[1:2] == ["serve"]:
        app()
        return
    with terminate_as_interrupt():
        app()
