"""``midflight bench``: benchmarks that print figures and ratios (never tests)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from .._bench.common import quiet_logs
from .._bench.hotpath import run_hotpath_bench
from .._bench.ledger import run_ledger_bench
from .bench_suites import add_suite_commands
from .output import JsonOption, console, emit


def register(app: typer.Typer) -> None:
    """Add the ``bench`` group and its suites to the app."""
    bench = typer.Typer(help="Benchmarks: each figure beside its floor, and the ratio.")
    app.add_typer(bench, name="bench")
    add_suite_commands(bench)

    @bench.command("ledger")
    def ledger_command(
        rollouts: Annotated[
            int, typer.Option(min=1, help="Rollouts to record (the goal figures use 20000).")
        ] = 2000,
        calls: Annotated[int, typer.Option(min=1, help="Recorded calls per rollout.")] = 4,
        batch: Annotated[
            int, typer.Option(min=1, max=4096, help="Ids per retire/delete/import batch.")
        ] = 256,
        directory: Annotated[
            Path | None,
            typer.Option("--dir", help="Where to measure (a scratch directory is made in it)."),
        ] = None,
        as_json: JsonOption = False,
    ) -> None:
        """The capture ledger: µs per rollout for record, retire, delete, manifest, import."""
        with tempfile.TemporaryDirectory(prefix="midflight-bench-", dir=directory) as scratch:
            payload = run_ledger_bench(Path(scratch), rollouts=rollouts, calls=calls, batch=batch)

        def render() -> None:
            table = Table(
                title=f"capture ledger: {rollouts} rollouts x {calls} calls, batches of {batch}"
            )
            for column in ("operation", "µs / rollout", "floor µs / rollout", "ratio"):
                table.add_column(column, justify="left" if column == "operation" else "right")
            for row in payload["operations"]:
                table.add_row(
                    row["operation"],
                    f"{row['us_per_rollout']:.1f}",
                    f"{row['floor_us_per_rollout']:.1f}",
                    f"{row['ratio']:.2f}x",
                )
            console.print(table)
            for row in payload["operations"]:
                if "floor_via_thread_us_per_rollout" not in row:
                    continue
                name = row["operation"]
                console.print(
                    f"{name}'s floor through one event loop -> thread -> event loop round trip "
                    f"per call: {row['floor_via_thread_us_per_rollout']:.1f} µs / rollout (the "
                    f"round trips: {row['hop_us_per_rollout']:.1f}); {name} is "
                    f"{row['ratio_to_floor_via_thread']:.2f}x that. Blocking file work may not "
                    f"run on the event loop, so every {name} pays such a round trip."
                )

        emit(payload, as_json=as_json, render=render)

    @bench.command("hotpath")
    def hotpath_command(
        rollouts: Annotated[
            int, typer.Option(min=1, help="Rollouts to serve, one at a time.")
        ] = 1000,
        calls: Annotated[int, typer.Option(min=1, help="Captured calls per rollout.")] = 4,
        directory: Annotated[
            Path | None,
            typer.Option("--dir", help="Where to measure (a scratch directory is made in it)."),
        ] = None,
        as_json: JsonOption = False,
    ) -> None:
        """The policy server's hot path: CPU µs per captured call, per step, fsync stubbed out."""
        with (
            tempfile.TemporaryDirectory(prefix="midflight-bench-", dir=directory) as scratch,
            quiet_logs(),
        ):
            payload = run_hotpath_bench(Path(scratch), rollouts=rollouts, calls=calls)

        def render() -> None:
            table = Table(
                title=f"policy server hot path: {rollouts} rollouts x {calls} calls, fsync stubbed"
            )
            for column in ("step", "CPU µs / call", "share"):
                table.add_column(column, justify="left" if column == "step" else "right")
            for row in payload["steps"]:
                table.add_row(row["step"], f"{row['cpu_us_per_call']:.1f}", f"{row['share']:.1%}")
            table.add_row("total", f"{payload['cpu_us_per_call']:.1f}", "100.0%")
            console.print(table)
            console.print(
                f"floor (one read and one append, each through one thread round trip): "
                f"{payload['floor_cpu_us_per_call']:.1f} CPU µs / call; ours is "
                f"{payload['ratio']:.2f}x that. Wall: {payload['wall_us_per_call']:.1f} µs / call."
            )

        emit(payload, as_json=as_json, render=render)
