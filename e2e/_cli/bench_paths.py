"""Where a bench measures and writes: ``--dir``, ``--out`` and ``--profile``, checked up front.

A bench may measure for half an hour (``bench scale``), so every place it will write is tried
before it measures anything: a file named as ``--dir``, an ``--out`` that cannot be a directory,
or a ``--profile`` that cannot be written is one ``error:`` line and exit 2, never a traceback
after the run (D370).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated

import typer

from .output import usage_error

DirOption = Annotated[
    Path | None,
    typer.Option("--dir", help="Where to measure (a scratch directory is made in it)."),
]
OutOption = Annotated[
    Path | None,
    typer.Option(
        "--out",
        help="Also write <suite>.json into this directory, and <suite>.png for checkpoint, "
        "restore and scale.",
    ),
]
ProfileOption = Annotated[
    Path | None,
    typer.Option("--profile", help="Write a pyinstrument profile (HTML, and .txt beside it)."),
]


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc)


def _not_a_directory(path: Path) -> Path | None:
    """The nearest of ``path`` and its parents that exists, when it is not a directory."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return None if candidate.is_dir() else candidate
    return None


def _try_writing_in(directory: Path) -> None:
    """Create and remove a scratch directory in ``directory`` (raises what that raises)."""
    tempfile.TemporaryDirectory(prefix=".midflight-probe-", dir=directory).cleanup()


def refuse_unusable_paths(
    directory: Path | None, out: Path | None = None, profile: Path | None = None
) -> None:
    """Refuse, before anything is measured, a ``--dir``, ``--out`` or ``--profile`` that
    cannot be written. ``--out`` and ``--profile``'s folder are created, as the bench would.

    Raises:
        typer.Exit: With exit code 2, after one line naming the option.
    """
    if directory is not None:
        try:
            _try_writing_in(directory)
        except OSError as exc:
            usage_error(f"--dir {directory}: no scratch directory can be made there ({_why(exc)})")
    if out is not None:
        if (blocking := _not_a_directory(out)) is not None:
            usage_error(f"--out {out}: {blocking} is not a directory")
        try:
            out.mkdir(parents=True, exist_ok=True)
            _try_writing_in(out)
        except OSError as exc:
            usage_error(f"--out {out}: the results cannot be written there ({_why(exc)})")
    if profile is not None:
        if profile.suffix == ".txt":
            usage_error(f"--profile {profile}: name the HTML file; its text goes beside it as .txt")
        if profile.is_dir():
            usage_error(f"--profile {profile} is a directory: name the HTML file to write")
        if (blocking := _not_a_directory(profile.parent)) is not None:
            usage_error(f"--profile {profile}: {blocking} is not a directory")
        try:
            profile.parent.mkdir(parents=True, exist_ok=True)
            _try_writing_in(profile.parent)
        except OSError as exc:
            usage_error(f"--profile {profile}: the profile cannot be written there ({_why(exc)})")
