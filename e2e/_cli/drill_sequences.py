"""What ``midflight drill --sequences N`` prints: one row per sequence seed, or one JSON object."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from .._drill.options import DrillOptions
from .._drill.progress import is_progress_line
from .._sequences.suite import SequenceOptions, run_sequences
from .output import console, emit, error_console


def run_sequences_command(
    count: int,
    first_seed: int,
    drill: DrillOptions,
    work: Path,
    *,
    length: int,
    max_crashes: int,
    keep: bool,
    as_json: bool,
    case: str | None = None,
) -> None:
    """Run ``count`` sequences from seed ``first_seed``; exit non-zero if any fails.

    The episodes' generation seed stays 0 so that one baseline serves every sequence, and the
    restart-only share is off (the sequence cluster has the five reference servers only).
    """
    options = SequenceOptions(
        sequences=count,
        seed=first_seed,
        length=length,
        max_crashes=max_crashes,
        drill=dataclasses.replace(drill, seed=0, restart_only_share=0.0),
        case=case,
        keep=keep,
    )

    def on_line(line: str) -> None:
        if not as_json and not is_progress_line(line):
            error_console.print(f"[dim]{line}[/dim]")

    report: dict[str, Any] | None = None
    try:
        report = run_sequences(options, work, on_line)
    finally:
        # A failing sequence keeps its directory (evidence, logs, checkpoints) to be looked at.
        if not keep and (report is None or report["ok"]):
            shutil.rmtree(work, ignore_errors=True)

    def render() -> None:
        table = Table(title="midflight drill --sequences")
        for column in ("seed", "ops", "crashes", "checkpoints", "retires", "result"):
            table.add_column(column)
        for row in report["sequences"]:
            result = "[green]ok[/green]" if row["ok"] else "[red]" + "; ".join(row["failures"])
            table.add_row(
                row["case"] or str(row["seed"]),
                " ".join(row["ops"]),
                str(row["crashes"]),
                str(row["checkpoints"]),
                str(row["retires"]),
                result,
            )
        console.print(table)
        if report["failed_seeds"]:
            console.print(f"[red]FAIL[/red]: seeds {report['failed_seeds']}")
            for row in report["sequences"]:
                if not row["ok"]:
                    console.print(f"  replay: {row['replay']}\n  evidence: {row['evidence']}")
        else:
            console.print("[green]PASS[/green]")

    assert report is not None  # run_sequences returned, or the exception propagated
    emit(report, as_json=as_json, render=render)
    raise typer.Exit(0 if report["ok"] else 1)
