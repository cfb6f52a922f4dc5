"""docs/commands.md lists every command and every option that ``midflight --help`` shows.

The command tree is walked from the app itself, so a new command or option fails this test until
the page has it, and an option the page names that no longer exists fails it too.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import typer

from e2e import build_app

PAGE = Path(__file__).resolve().parents[2] / "docs" / "commands.md"
HEADING = re.compile(r"^#{2,3} `midflight ([a-z][a-z -]*)`$", re.M)
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def visible_commands(command: Any, path: tuple[str, ...] = ()) -> dict[str, set[str]]:
    """``"serve model"`` → its option names, for every command ``--help`` shows (leaves only)."""
    if hasattr(command, "commands"):  # a group: walk its visible sub-commands
        found: dict[str, set[str]] = {}
        for name, sub in command.commands.items():
            if not sub.hidden:
                found.update(visible_commands(sub, (*path, name)))
        return found
    options = {
        name
        for param in command.params
        if type(param).__name__.endswith("Option") and not getattr(param, "hidden", False)
        for name in (*param.opts, *param.secondary_opts)
    }
    return {" ".join(path): options}


def documented_commands(text: str) -> dict[str, set[str]]:
    """Each ``midflight <command>`` heading → the options named in its section's table rows."""
    headings = list(HEADING.finditer(text))
    documented: dict[str, set[str]] = {}
    for heading, following in zip(headings, [*headings[1:], None], strict=True):
        section = text[heading.end() : following.start() if following else len(text)]
        options: set[str] = set()
        for line in section.splitlines():
            if line.startswith("| `-"):
                first_cell = re.split(r"(?<!\\)\|", line)[1]
                options.update(OPTION.findall(first_cell))
        documented[heading.group(1)] = options
    return documented


def test_the_walk_finds_the_nested_commands_and_both_names_of_a_flag_pair() -> None:
    commands = visible_commands(typer.main.get_command(build_app()))
    assert {"drill", "serve model", "serve environment", "bench hotpath"} <= set(commands)
    assert "drill-driver" not in commands, "hidden commands are not part of --help"
    assert {"--resume", "--no-resume"} <= commands["restore"]


def test_the_command_page_lists_every_command_and_option_of_the_help() -> None:
    commands = visible_commands(typer.main.get_command(build_app()))
    documented = documented_commands(PAGE.read_text())
    groups = {name for name in documented if name not in commands}
    assert groups == {"serve", "bench"}, f"headings that name no command: {sorted(groups)}"
    missing_commands = sorted(set(commands) - set(documented))
    assert not missing_commands, (
        f"commands without a section in docs/commands.md: {missing_commands}"
    )
    problems = []
    for name, options in sorted(commands.items()):
        if missing := sorted(options - documented[name]):
            problems.append(f"midflight {name}: options not in its table: {missing}")
        if unknown := sorted(documented[name] - options):
            problems.append(
                f"midflight {name}: the table names options it does not have: {unknown}"
            )
    assert not problems, "\n".join(problems)
