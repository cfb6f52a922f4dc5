"""``midflight verify``, ``gc`` and ``pin``: thin wrappers over ``coordinator``'s retention.

Each takes a directory or an ``s3://`` URL (see ``locations``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from coordinator import (
    CHECKPOINT_FILE,
    CHECKPOINTS_SUBDIR,
    LATEST_FILE,
    collect_garbage,
    is_pinned,
    pin_checkpoint,
    unpin_checkpoint,
    verify_checkpoint,
)

from .locations import (
    SHARES_SUBDIR,
    as_location,
    check_store_checkpoint,
    check_store_root,
    store_failed,
)
from .output import JsonOption, console, emit, error_console, usage_error


def _latest_hint(checkpoints: Path) -> str:
    try:
        latest = (checkpoints / LATEST_FILE).read_text(encoding="utf-8").strip()
    except OSError:
        return "nothing is published there yet"
    return f"LATEST is {checkpoints / latest}" if latest else "nothing is published there yet"


def check_checkpoint_argument(directory: Path) -> None:
    """Refuse, as a usage error, a ``verify`` argument that is not a checkpoint directory at all.

    A directory holding participant shares but no ``checkpoint.json`` is a checkpoint that was
    never published (or lost its manifest): that is a bad checkpoint, left to verify (exit 1).

    Raises:
        typer.Exit: With exit code 2, after one line naming what the argument is instead.
    """
    if not directory.exists():
        usage_error(f"{directory}: no such directory (name a checkpoint: <root>/checkpoints/<id>)")
    if not directory.is_dir():
        usage_error(f"{directory}: not a directory (name a checkpoint: <root>/checkpoints/<id>)")
    if (directory / CHECKPOINT_FILE).exists() or (directory / SHARES_SUBDIR).is_dir():
        return
    if (directory / CHECKPOINTS_SUBDIR).is_dir():
        checkpoints = directory / CHECKPOINTS_SUBDIR
        usage_error(
            f"{directory} is a run root, not a checkpoint: name one under {checkpoints}/ "
            f"({_latest_hint(checkpoints)})"
        )
    if (directory / LATEST_FILE).exists() or directory.name == CHECKPOINTS_SUBDIR:
        usage_error(
            f"{directory} holds the checkpoints, it is not one: name one under it "
            f"({_latest_hint(directory)})"
        )
    usage_error(f"{directory} is not a checkpoint: it has no {CHECKPOINT_FILE} and no shares")


def check_root_argument(root: Path) -> None:
    """Refuse, as a usage error, a run root that does not exist or is a checkpoint directory.

    Raises:
        typer.Exit: With exit code 2, after one line.
    """
    if not root.exists():
        usage_error(f"{root}: no such directory (name the run root, which holds checkpoints/)")
    if not root.is_dir():
        usage_error(f"{root}: not a directory (name the run root, which holds checkpoints/)")
    if (root / CHECKPOINTS_SUBDIR).is_dir():
        return
    if (root / LATEST_FILE).exists() or root.name == CHECKPOINTS_SUBDIR:
        usage_error(f"{root} holds the checkpoints: name the run root above it, {root.parent}")
    if (root / CHECKPOINT_FILE).exists() or (root / SHARES_SUBDIR).is_dir():
        usage_error(f"{root} is one checkpoint: name the run root, {root.parent.parent}")


def register(app: typer.Typer) -> None:
    """Add ``verify``, ``gc`` and ``pin`` to the app."""

    @app.command("verify")
    def verify_command(
        directory: Annotated[
            str,
            typer.Argument(help="A checkpoint: <root>/checkpoints/<id>, a directory or s3:// URL."),
        ],
        as_json: JsonOption = False,
    ) -> None:
        """Check checkpoint.json, every participant manifest and every records file."""
        location = as_location(directory)
        try:
            if isinstance(location, Path):
                check_checkpoint_argument(location)
                published = (location / CHECKPOINT_FILE).exists()
            else:
                published = check_store_checkpoint(location).exists(CHECKPOINT_FILE)
            with error_console.status(f"verifying {location}…") if not as_json else _Quiet():
                if published:
                    problems = verify_checkpoint(location)
                else:
                    problems = [
                        f"{location}: participant shares but no {CHECKPOINT_FILE}: a partial "
                        "commit, never published"
                    ]
        except OSError as exc:
            store_failed(exc)
        payload = {"checkpoint_dir": str(location), "ok": not problems, "problems": problems}

        def render() -> None:
            if not problems:
                console.print(f"[green]OK[/green] {location}")
            for problem in problems:
                error_console.print(f"[red]MISMATCH[/red] {escape(problem)}", soft_wrap=True)

        emit(payload, as_json=as_json, render=render)
        raise typer.Exit(0 if not problems else 1)

    @app.command("gc")
    def gc_command(
        root: Annotated[
            str, typer.Argument(help="The run root (holds checkpoints/): a directory or s3:// URL.")
        ],
        keep: Annotated[int, typer.Option(min=1, help="Published checkpoints to keep.")] = 3,
        dry_run: Annotated[bool, typer.Option("--dry-run", help="Only report.")] = False,
        as_json: JsonOption = False,
    ) -> None:
        """Remove partial commits and checkpoints beyond the newest N (never LATEST or pinned)."""
        location = as_location(root)
        if isinstance(location, Path):
            check_root_argument(location)
        else:
            check_store_root(location)
        try:
            report = collect_garbage(location, keep, dry_run=dry_run)
        except OSError as exc:
            store_failed(exc)
        payload = {
            "removed": report.removed,
            "partial": report.partial,
            "kept": report.kept,
            "protected": report.protected,
            "bytes_reclaimed": report.bytes_reclaimed,
            "dry_run": report.dry_run,
        }

        def render() -> None:
            table = Table(title="midflight gc" + (" (dry run)" if dry_run else ""))
            table.add_column("checkpoint")
            table.add_column("action")
            for name in report.removed:
                what = "partial commit" if name in report.partial else "checkpoint"
                action = "would remove" if dry_run else "removed"
                table.add_row(name, f"{action} ({what})")
            for name in report.kept:
                table.add_row(name, "kept" + (" (protected)" if name in report.protected else ""))
            console.print(table)
            verb = "would reclaim" if dry_run else "reclaimed"
            console.print(f"{verb} {report.bytes_reclaimed} bytes")

        emit(payload, as_json=as_json, render=render)

    @app.command("pin")
    def pin_command(
        root: Annotated[str, typer.Argument(help="The run root: a directory or s3:// URL.")],
        checkpoint_id: Annotated[str, typer.Argument(help="The checkpoint to protect.")],
        remove: Annotated[bool, typer.Option("--remove", help="Unpin instead.")] = False,
        as_json: JsonOption = False,
    ) -> None:
        """Protect a published checkpoint from gc (or lift the protection)."""
        location = as_location(root)
        # The root is checked as gc checks it: an unpin under a mistyped root did nothing and
        # said "unpinned" (D367).
        if isinstance(location, Path):
            check_root_argument(location)
        else:
            check_store_root(location)
        try:
            if remove:
                changed = unpin_checkpoint(location, checkpoint_id)
            else:
                changed = not is_pinned(location, checkpoint_id)
                pin_checkpoint(location, checkpoint_id)
        except ValueError as exc:
            usage_error(str(exc))
        except OSError as exc:
            store_failed(exc)
        payload = {"checkpoint_id": checkpoint_id, "pinned": not remove, "changed": changed}
        state = "unpinned" if remove else "pinned"
        if changed:
            said = f"{checkpoint_id}: {state}"
        else:
            said = f"{checkpoint_id}: " + ("was not pinned" if remove else "already pinned")
        emit(payload, as_json=as_json, render=lambda: console.print(said, markup=False))


class _Quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None
