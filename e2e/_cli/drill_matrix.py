"""``midflight drill --matrix``: the kill -9 matrix, one cluster per cell."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path
from typing import NoReturn

import typer
from rich.table import Table

from coordinator.testing import PUBLISH_FAULTS

from .._drill.matrix import cells_json, parse_cells, run_matrix
from .._drill.options import FAULTS, DrillOptions
from .._drill.progress import is_progress_line
from .output import console, emit, error_console, usage_error


def run_matrix_command(
    spec: str, options: DrillOptions, keep_dir: Path | None, *, jobs: int, as_json: bool
) -> NoReturn:
    """Run the cells of ``spec``; exit 0 only when every cell is green.

    Raises:
        typer.Exit: 2 for an unknown cell set, cell or fault (one line).
        typer.Exit: Always, with 1 when any cell failed.
    """
    try:
        cells = parse_cells(spec)
    except ValueError as exc:
        usage_error(f"--matrix: {exc}")
    known = sorted({*FAULTS, *PUBLISH_FAULTS})
    if options.fault is not None and options.fault not in known:
        usage_error(f"unknown fault {options.fault!r}; known: {known}")
    work = keep_dir.resolve() if keep_dir else Path(tempfile.mkdtemp(prefix="midflight-matrix-"))

    def on_line(line: str) -> None:
        if not as_json and not is_progress_line(line):
            error_console.print(f"[dim]{line}[/dim]")

    discard = False  # a failing cell's files stay to be looked at (D366)
    try:
        with (
            error_console.status(f"running {len(cells)} matrix cells…", spinner="dots")
            if not as_json
            else contextlib.nullcontext()
        ):
            results = run_matrix(cells, options, work, on_line, jobs=jobs)
    except KeyboardInterrupt:
        discard = True
        raise
    else:
        discard = all(cell.ok for cell in results)
    finally:
        if keep_dir is None and discard:
            shutil.rmtree(work, ignore_errors=True)
    ok = all(cell.ok for cell in results)

    def render() -> None:
        table = Table(title="midflight drill --matrix (kill -9)")
        for column in ("killed", "boundary", "ok", "detail"):
            table.add_column(column)
        for cell in results:
            verdict = "[green]ok[/green]" if cell.ok else "[red]FAIL[/red]"
            table.add_row(cell.killed, cell.boundary, verdict, cell.detail)
        console.print(table)
        failed = sum(1 for cell in results if not cell.ok)
        console.print("[green]PASS[/green]" if ok else f"[red]FAIL[/red]: {failed} cell(s)")
        if not ok and keep_dir is None:
            console.print(f"the cells' files are kept in {work}", markup=False)

    kept = None if keep_dir is None and discard else str(work)
    emit({**cells_json(results), "kept_dir": kept}, as_json=as_json, render=render)
    raise typer.Exit(0 if ok else 1)
