"""``midflight verify``, ``gc`` and ``pin``: thin wrappers over ``coordinator``'s retention."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from coordinator import collect_garbage, pin_checkpoint, unpin_checkpoint, verify_checkpoint

from ._output import JsonOption, console, emit, error_console


def register(app: typer.Typer) -> None:
    """Add ``verify``, ``gc`` and ``pin`` to the app."""

    @app.command("verify")
    def verify_command(
        directory: Annotated[Path, typer.Argument(help="A checkpoint: <root>/checkpoints/<id>.")],
        as_json: JsonOption = False,
    ) -> None:
        """Check checkpoint.json, every participant manifest and every records file."""
        with error_console.status(f"verifying {directory}…") if not as_json else _Quiet():
            problems = verify_checkpoint(directory)
        payload = {"checkpoint_dir": str(directory), "ok": not problems, "problems": problems}

        def render() -> None:
            if not problems:
                console.print(f"[green]OK[/green] {directory}")
            for problem in problems:
                error_console.print(f"[red]MISMATCH[/red] {problem}")

        emit(payload, as_json=as_json, render=render)
        raise typer.Exit(0 if not problems else 1)

    @app.command("gc")
    def gc_command(
        root: Annotated[Path, typer.Argument(help="The run root (holds checkpoints/).")],
        keep: Annotated[int, typer.Option(min=1, help="Published checkpoints to keep.")] = 3,
        dry_run: Annotated[bool, typer.Option("--dry-run", help="Only report.")] = False,
        as_json: JsonOption = False,
    ) -> None:
        """Remove partial commits and checkpoints beyond the newest N (never LATEST or pinned)."""
        report = collect_garbage(root, keep, dry_run=dry_run)
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
        root: Annotated[Path, typer.Argument(help="The run root.")],
        checkpoint_id: Annotated[str, typer.Argument(help="The checkpoint to protect.")],
        remove: Annotated[bool, typer.Option("--remove", help="Unpin instead.")] = False,
        as_json: JsonOption = False,
    ) -> None:
        """Protect a published checkpoint from gc (or lift the protection)."""
        try:
            changed = (
                unpin_checkpoint(root, checkpoint_id)
                if remove
                else bool(pin_checkpoint(root, checkpoint_id))
            )
        except ValueError as exc:
            error_console.print(f"[red]error[/red]: {exc}")
            raise typer.Exit(2) from None
        payload = {"checkpoint_id": checkpoint_id, "pinned": not remove, "changed": changed}
        emit(
            payload,
            as_json=as_json,
            render=lambda: console.print(f"{checkpoint_id}: {'unpinned' if remove else 'pinned'}"),
        )


class _Quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None
