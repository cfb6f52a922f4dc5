"""``midflight bench checkpoint|restore|overhead|scale``: the control plane's figures at scale.

Each suite measures its floor in the same run and prints the ratio; ``--json`` prints one JSON
object, ``--out DIR`` also writes ``<suite>.json`` there (and, for ``checkpoint``, ``restore``
and ``scale``, its picture ``<suite>.png``), ``--profile PATH`` writes a pyinstrument profile of
the timed sections.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from .._bench.checkpoint import PARKED_WORKLOAD, SIZES, SOAK_SIZE, run_checkpoint_bench
from .._bench.common import quiet_logs, reporting_stages, under_load
from .._bench.output import Profile, write_json
from .._bench.overhead import run_overhead_bench
from .._bench.plots import ROWS_KEY, draw, plot_file
from .._bench.restore import run_restore_bench
from .._bench.restore_servers import RESTORED_INTO, RestoreServers
from .._bench.scale import LADDER, run_scale_bench
from .bench_paths import DirOption, OutOption, ProfileOption, refuse_unusable_paths
from .bench_progress import BenchProgress
from .output import JsonOption, console, emit, error_console, print_whole


def _table(title: str, rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> None:
    table = Table(title=title)
    for _key, heading in columns:
        table.add_column(heading, justify="right", overflow="fold")
    for row in rows:
        cells = []
        for key, _heading in columns:
            value = row.get(key)
            if isinstance(value, float):
                cells.append(f"{value:.4g}")
            else:
                cells.append("—" if value is None else str(value))
        table.add_row(*cells)
    print_whole(table)


def _print_slopes(slopes: Sequence[dict[str, Any]]) -> None:
    for entry in slopes:
        console.print(
            f"slope of {entry['figure']} from {entry['from']:,} to {entry['to']:,} rollouts: "
            f"{entry['us_per_added_rollout']:.4g} µs per added rollout; per-rollout cost "
            f"x{entry['per_rollout_ratio']} (1.0 is linear)"
        )


def _run(
    suite: str,
    measure: Callable[[Path, Callable[[], AbstractContextManager[Any]] | None], dict[str, Any]],
    *,
    directory: Path | None,
    out: Path | None,
    profile: Path | None,
    as_json: bool,
) -> dict[str, Any]:
    """Measure in a scratch directory, with an optional profile and, without ``--json``, its
    progress on stderr; write ``--out`` files."""
    refuse_unusable_paths(directory, out, profile)
    profiler = Profile(profile) if profile is not None else None
    with (
        quiet_logs(),
        ExitStack() as shown,
        tempfile.TemporaryDirectory(prefix=f"midflight-bench-{suite}-", dir=directory) as scratch,
    ):
        if not as_json:
            progress = shown.enter_context(BenchProgress(error_console, suite))
            shown.enter_context(reporting_stages(progress.on_stage))
        payload = under_load(lambda: measure(Path(scratch), profiler.section if profiler else None))
    if profiler is not None:
        payload["profile"] = [str(path) for path in profiler.write()]
    if out is not None:
        written = [write_json(out, suite, payload)]
        if suite in ROWS_KEY:
            written.append(draw(payload, out / plot_file(suite)))
        payload["written"] = [str(path) for path in written]
    return payload


def _print_load(payload: dict[str, Any]) -> None:
    """The line under every bench table: the load average it ran under, start and end."""
    start, end = payload["loadavg"], payload["loadavg_end"]
    console.print(
        f"load average (1, 5, 15 min): {', '.join(f'{v:g}' for v in start)} at the start, "
        f"{', '.join(f'{v:g}' for v in end)} at the end"
    )
    if "speed_probe_ms" in payload:  # every suite but tracing, which keeps its own fields
        first, last = payload["speed_probe_ms"]
        console.print(f"speed probe: {first:g} ms at the start, {last:g} ms at the end (D426)")


def emit_bench(payload: dict[str, Any], *, as_json: bool, render: Callable[[], None]) -> None:
    """``emit`` for a bench: the table for people ends with the load average it ran under."""

    def render_with_load() -> None:
        render()
        _print_load(payload)

    emit(payload, as_json=as_json, render=render_with_load)


def parse_sizes(
    text: str | None, default: Sequence[int], soak: bool, option: str = "--sizes"
) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",")] if text else list(default)
    except ValueError:
        raise typer.BadParameter(
            f"a comma-separated list of whole numbers, such as 1000,4000; got {text!r}",
            param_hint=option,
        ) from None
    if soak and SOAK_SIZE not in sizes:
        sizes.append(SOAK_SIZE)
    if any(size < 1 for size in sizes):
        raise typer.BadParameter("every size must be at least 1", param_hint=option)
    return sizes


def add_suite_commands(bench: typer.Typer) -> None:
    """Add the checkpoint, restore, overhead and scale suites to the ``bench`` group."""

    @bench.command("checkpoint")
    def checkpoint_command(
        sizes: Annotated[
            str | None,
            typer.Option(help="Comma-separated rollouts parked, one row each (100,1000,4000)."),
        ] = None,
        soak: Annotated[
            bool, typer.Option("--soak", help=f"Add the {SOAK_SIZE:,}-rollout row (minutes).")
        ] = False,
        repeats: Annotated[int, typer.Option(min=1, help="Checkpoints per size (median).")] = 3,
        token_delay_ms: Annotated[
            float,
            typer.Option(min=1.0, help="The parked generations' pace (each repeat waits a token)."),
        ] = PARKED_WORKLOAD.token_delay_ms,
        directory: DirOption = None,
        out: OutOption = None,
        profile: ProfileOption = None,
        as_json: JsonOption = False,
    ) -> None:
        """Checkpoint pause and control-plane overhead against writing the same bytes."""
        chosen = parse_sizes(sizes, SIZES, soak)
        workload = replace(PARKED_WORKLOAD, token_delay_ms=token_delay_ms)
        payload = _run(
            "checkpoint",
            lambda scratch, profiler: run_checkpoint_bench(
                scratch, sizes=chosen, repeats=repeats, workload=workload, profiler=profiler
            ),
            directory=directory,
            out=out,
            profile=profile,
            as_json=as_json,
        )

        def render() -> None:
            _table(
                f"checkpoint: median of {repeats}; {payload['parking']}",
                payload["rows"],
                [
                    ("rollouts", "rollouts"),
                    ("parked", "parked"),
                    ("pause_s", "pause s"),
                    ("boundary_wait_s", "boundary wait s"),
                    ("overhead_s", "overhead s"),
                    ("floor_s", "floor s"),
                    ("ratio", "ratio"),
                    ("us_per_rollout", "µs / rollout"),
                    ("slope_us_per_added_rollout", "slope µs / added rollout"),
                    ("bytes", "bytes"),
                ],
            )
            _print_slopes(payload["slopes"])
            console.print(f"floor: {payload['floor']}")

        emit_bench(payload, as_json=as_json, render=render)

    @bench.command("overhead")
    def overhead_command(
        seconds: Annotated[float, typer.Option(min=1.0, help="Length of each window.")] = 10.0,
        rounds: Annotated[int, typer.Option(min=1, help="Windows per mode (alternating).")] = 3,
        concurrency: Annotated[int, typer.Option(min=1, help="Rollouts in flight.")] = 32,
        period: Annotated[
            float, typer.Option(min=0.1, help="Seconds between checkpoints (periodic mode).")
        ] = 5.0,
        directory: DirOption = None,
        out: OutOption = None,
        profile: ProfileOption = None,
        as_json: JsonOption = False,
    ) -> None:
        """Rollout throughput: checkpointing disabled, enabled but idle, and periodic."""
        if period >= seconds:
            raise typer.BadParameter("must be shorter than --seconds", param_hint="--period")
        payload = _run(
            "overhead",
            lambda scratch, profiler: run_overhead_bench(
                scratch,
                seconds=seconds,
                rounds=rounds,
                concurrency=concurrency,
                period_s=period,
                profiler=profiler,
            ),
            directory=directory,
            out=out,
            profile=profile,
            as_json=as_json,
        )

        def render() -> None:
            rows = [
                {"mode": "disabled (floor)", "per_s": payload["disabled_per_s"], "pct": None},
                {
                    "mode": "enabled, idle",
                    "per_s": payload["idle_per_s"],
                    "pct": payload["idle_overhead_pct"],
                },
                {
                    "mode": f"checkpoint every {period:g} s",
                    "per_s": payload["periodic_per_s"],
                    "pct": payload["periodic_overhead_pct"],
                },
            ]
            _table(
                f"overhead: {rounds} x {seconds:g} s windows, {concurrency} in flight; "
                f"{payload['parking']}",
                rows,
                [("mode", "mode"), ("per_s", "rollouts / s"), ("pct", "throughput lost %")],
            )
            console.print(f"floor: {payload['floor']}; {payload['checkpoints']} checkpoints taken")

        emit_bench(payload, as_json=as_json, render=render)

    @bench.command("restore")
    def restore_command(
        sizes: Annotated[
            str | None,
            typer.Option(help="Comma-separated rollouts in flight, one row each (100,1000,4000)."),
        ] = None,
        repeats: Annotated[int, typer.Option(min=1, help="Crash-restore cycles per size.")] = 1,
        servers: Annotated[
            RestoreServers,
            typer.Option(
                help="Restore into servers in this process, or into a process per server (the "
                "reference deployment; rollouts are still parked in one process)."
            ),
        ] = RestoreServers.in_process,
        directory: DirOption = None,
        out: OutOption = None,
        profile: ProfileOption = None,
        as_json: JsonOption = False,
    ) -> None:
        """Restore time against records size and rollout count, beside reading and writing the
        same bytes."""
        chosen = parse_sizes(sizes, SIZES, False)
        payload = _run(
            "restore",
            lambda scratch, profiler: run_restore_bench(
                scratch, sizes=chosen, repeats=repeats, profiler=profiler, servers=servers.value
            ),
            directory=directory,
            out=out,
            profile=profile,
            as_json=as_json,
        )

        def render() -> None:
            _table(
                f"restore: median of {repeats}; {payload['parking']}; restored into "
                f"{RESTORED_INTO[payload['servers']]}",
                payload["rows"],
                [
                    ("rollouts", "rollouts"),
                    ("restored", "restored"),
                    ("records_bytes", "records bytes"),
                    ("restore_s", "restore s"),
                    ("floor_s", "floor s"),
                    ("ratio", "ratio"),
                    ("us_per_rollout", "µs / rollout"),
                    ("slope_us_per_added_rollout", "slope µs / added rollout"),
                    ("retired", "retired"),
                    ("retire_s", "retire s"),
                ],
            )
            _print_slopes(payload["slopes"])
            for row in payload["rows"]:
                own = ", ".join(f"{n} {s:.3f} s" for n, s in row["server_restore_s"].items())
                console.print(f"{row['rollouts']:,} rollouts, each server's own restore: {own}")
            console.print(f"floor: {payload['floor']}")

        emit_bench(payload, as_json=as_json, render=render)

    @bench.command("scale")
    def scale_command(
        ladder: Annotated[
            str | None,
            typer.Option(help="Comma-separated sizes to climb (1000,4000,16000,50000)."),
        ] = None,
        budget: Annotated[
            float, typer.Option(min=1.0, help="Wall seconds allowed for the whole climb.")
        ] = 3600.0,
        directory: DirOption = None,
        out: OutOption = None,
        as_json: JsonOption = False,
    ) -> None:
        """The most rollouts in flight carried through checkpoint, crash and restore, none lost."""
        chosen = parse_sizes(ladder, LADDER, False, "--ladder")
        payload = _run(
            "scale",
            lambda scratch, _profiler: run_scale_bench(scratch, ladder=chosen, budget_s=budget),
            directory=directory,
            out=out,
            profile=None,
            as_json=as_json,
        )

        def render() -> None:
            _table(
                f"scale: {payload['parking']}",
                payload["rungs"],
                [
                    ("rollouts", "rollouts"),
                    ("parked", "parked"),
                    ("restored", "restored"),
                    ("finished", "finished"),
                    ("lost", "lost"),
                    ("pause_s", "pause s"),
                    ("restore_s", "restore s"),
                    ("us_per_rollout", "restore µs / rollout"),
                    ("wall_s", "wall s"),
                    ("wall_us_per_rollout", "wall µs / rollout"),
                    ("peak_rss_mb", "peak RSS MB"),
                    ("skipped", "not run"),
                ],
            )
            _print_slopes(payload["slopes"])
            console.print(
                f"largest clean: {payload['largest_clean']}; limited by: {payload['limited_by']}"
            )

        emit_bench(payload, as_json=as_json, render=render)
