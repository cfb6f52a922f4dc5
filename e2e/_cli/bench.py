"""``midflight bench``: benchmarks that print figures and ratios (never tests)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from .._bench.common import quiet_logs, under_load
from .._bench.cuts import (
    CALLS,
    CHUNK_TOKENS,
    GENERATED_TOKENS,
    PROMPT_TOKENS,
    ROUNDS,
    run_cuts_bench,
)
from .._bench.hotpath import run_hotpath_bench
from .._bench.ledger import run_ledger_bench
from .._bench.tracing import run_tracing_bench
from .bench_paths import DirOption, refuse_unusable_paths
from .bench_plot import add_plot_command
from .bench_suites import add_suite_commands, emit_bench, parse_sizes
from .output import JsonOption, console, print_whole, usage_error
from .serve_options import LedgerLayoutChoice


def register(app: typer.Typer) -> None:
    """Add the ``bench`` group and its suites to the app."""
    bench = typer.Typer(help="Benchmarks: each figure beside its floor, and the ratio.")
    app.add_typer(bench, name="bench")
    add_suite_commands(bench)
    add_plot_command(bench)

    @bench.command("ledger")
    def ledger_command(
        rollouts: Annotated[
            int, typer.Option(min=1, help="Rollouts to record (the goal figures use 20000).")
        ] = 2000,
        calls: Annotated[int, typer.Option(min=1, help="Recorded calls per rollout.")] = 4,
        batch: Annotated[
            int, typer.Option(min=1, max=4096, help="Ids per retire/delete/import batch.")
        ] = 256,
        directory: DirOption = None,
        layout: Annotated[
            LedgerLayoutChoice,
            typer.Option(help="The ledger's on-disk layout, each beside its own floor."),
        ] = LedgerLayoutChoice.sqlite,
        as_json: JsonOption = False,
    ) -> None:
        """The capture ledger: µs per rollout for record, manifest (alone and 64 at once),
        retire, delete and import."""
        refuse_unusable_paths(directory)
        with tempfile.TemporaryDirectory(prefix="midflight-bench-", dir=directory) as scratch:
            payload = under_load(
                lambda: run_ledger_bench(
                    Path(scratch), rollouts=rollouts, calls=calls, batch=batch, layout=layout.value
                )
            )

        def render() -> None:
            table = Table(
                title=f"capture ledger ({layout.value} layout): {rollouts} rollouts x {calls} "
                f"calls, batches of {batch}"
            )
            for column in ("operation", "µs / rollout", "floor µs / rollout", "ratio"):
                table.add_column(
                    column, justify="left" if column == "operation" else "right", overflow="fold"
                )
            for row in payload["operations"]:
                table.add_row(
                    row["operation"],
                    f"{row['us_per_rollout']:.1f}",
                    f"{row['floor_us_per_rollout']:.1f}",
                    f"{row['ratio']:.2f}x",
                )
            print_whole(table)
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
            probe = payload.get("wake_probe_us")
            if probe:
                console.print(
                    f"one bare round trip, the thread pinned to the event loop's CPU: "
                    f"{probe['same_cpu_us']:.1f} µs; to another CPU: {probe['other_cpu_us']:.1f} "
                    "µs. The kernel places the ledger's threads and the floor's, so a ratio to "
                    "the floor through a thread can move between runs by about that difference."
                )

        emit_bench(payload, as_json=as_json, render=render)

    @bench.command("hotpath")
    def hotpath_command(
        rollouts: Annotated[
            int, typer.Option(min=1, help="Rollouts to serve, each call after the last.")
        ] = 1000,
        calls: Annotated[int, typer.Option(min=1, help="Captured calls per rollout.")] = 4,
        in_flight: Annotated[
            int,
            typer.Option(
                min=1,
                help="Rollouts served at once: each step runs for all their calls together.",
            ),
        ] = 1,
        tool_bytes: Annotated[
            int,
            typer.Option(
                min=0,
                help="Bytes of each tool output in the conversation (it grows by that a call).",
            ),
        ] = 0,
        directory: DirOption = None,
        layout: Annotated[
            LedgerLayoutChoice, typer.Option(help="The capture ledger's on-disk layout.")
        ] = LedgerLayoutChoice.sqlite,
        as_json: JsonOption = False,
    ) -> None:
        """The policy server's hot path: CPU µs per captured call, per step, fsync stubbed out."""
        refuse_unusable_paths(directory)
        with (
            tempfile.TemporaryDirectory(prefix="midflight-bench-", dir=directory) as scratch,
            quiet_logs(),
        ):
            payload = under_load(
                lambda: run_hotpath_bench(
                    Path(scratch),
                    rollouts=rollouts,
                    calls=calls,
                    layout=layout.value,
                    in_flight=in_flight,
                    tool_bytes=tool_bytes,
                )
            )

        def render() -> None:
            table = Table(
                title=f"policy server hot path ({layout.value} layout): {rollouts} rollouts x "
                f"{calls} calls, {in_flight} in flight, fsync stubbed"
            )
            for column in ("step", "CPU µs / call", "share"):
                table.add_column(
                    column, justify="left" if column == "step" else "right", overflow="fold"
                )
            for row in payload["steps"]:
                table.add_row(row["step"], f"{row['cpu_us_per_call']:.1f}", f"{row['share']:.1%}")
            table.add_row("total", f"{payload['cpu_us_per_call']:.1f}", "100.0%")
            print_whole(table)
            floor = (
                "one read and one append per call, each through one thread round trip"
                if in_flight == 1
                else f"a wave's {in_flight} reads, then its {in_flight} appends, one thread "
                "round trip each"
            )
            console.print(
                f"floor ({floor}): {payload['floor_cpu_us_per_call']:.1f} CPU µs / call; ours "
                f"is {payload['ratio']:.2f}x that. Wall: {payload['wall_us_per_call']:.1f} µs / "
                f"call. One core of this machine captures about "
                f"{1e6 / payload['cpu_us_per_call']:,.0f} calls a second this way. Of the steps' "
                f"CPU, the garbage collector took {payload['gc_us_per_call']:.1f} µs a call "
                f"({payload['gc_collections']:,} collections)."
            )

        emit_bench(payload, as_json=as_json, render=render)

    @bench.command("cuts")
    def cuts_command(
        calls: Annotated[
            str | None,
            typer.Option(
                help="Comma-separated live calls on the worker, one size each (256,1024,4096)."
            ),
        ] = None,
        prompt_tokens: Annotated[
            int, typer.Option(min=1, help="Prompt tokens of each call, past its parent's.")
        ] = PROMPT_TOKENS,
        parent_tokens: Annotated[
            int,
            typer.Option(
                min=0,
                help="Tokens of each call's parent sequence: a later turn of a conversation "
                "(token_in); 0 makes root calls.",
            ),
        ] = 0,
        generated: Annotated[
            int, typer.Option(min=0, help="Tokens each call has generated at round 1.")
        ] = GENERATED_TOKENS,
        chunk: Annotated[
            int, typer.Option(min=1, help="Tokens each call generates before each later round.")
        ] = CHUNK_TOKENS,
        rounds: Annotated[int, typer.Option(min=1, help="Cut rounds per size.")] = ROUNDS,
        cut_timeout_ms: Annotated[
            float,
            typer.Option(
                min=1.0, help="The worker's cut deadline (serve worker --cut-timeout-ms)."
            ),
        ] = 5000.0,
        directory: DirOption = None,
        as_json: JsonOption = False,
    ) -> None:
        """The worker's generation-cut round at real context lengths: CPU per call and per token
        in flight, calls past the cut deadline, beside the bytes' floor."""
        refuse_unusable_paths(directory)
        sizes = parse_sizes(calls, CALLS, False, "--calls")
        with (
            tempfile.TemporaryDirectory(prefix="midflight-bench-", dir=directory) as scratch,
            quiet_logs(),
        ):
            payload = under_load(
                lambda: run_cuts_bench(
                    Path(scratch),
                    calls=sizes,
                    prompt_tokens=prompt_tokens,
                    generated=generated,
                    chunk=chunk,
                    rounds=rounds,
                    cut_timeout_ms=cut_timeout_ms,
                    parent_tokens=parent_tokens,
                )
            )

        def render() -> None:
            parent = f"{parent_tokens:,} parent + " if parent_tokens else ""
            table = Table(
                title=f"worker cut rounds: {parent}{prompt_tokens:,} prompt + {generated:,} generated "
                f"tokens a call, +{chunk} a round, deadline {cut_timeout_ms:g} ms"
            )
            columns = (
                ("calls", "calls"),
                ("round", "round"),
                ("staged", "staged"),
                ("tokens_in_flight", "tokens in flight"),
                ("cut_failed", "past deadline"),
                ("round_s", "round s"),
                ("us_per_call", "CPU µs / call"),
                ("ns_per_token", "CPU ns / token"),
                ("floor_s", "floor s"),
                ("ratio", "ratio"),
            )
            for _key, heading in columns:
                table.add_column(heading, justify="right", overflow="fold")
            for row in payload["rows"]:
                table.add_row(
                    *(
                        f"{row[key]:,}" if isinstance(row[key], int) else str(row[key])
                        for key, _ in columns
                    )
                )
            print_whole(table)

        emit_bench(payload, as_json=as_json, render=render)

    @bench.command("tracing")
    def tracing_command(
        rollouts: Annotated[int, typer.Option(min=1, help="Rollouts per data-plane window.")] = 100,
        concurrency: Annotated[int, typer.Option(min=1, help="Rollouts in flight.")] = 8,
        rounds: Annotated[
            int, typer.Option(min=1, help="Rounds, each every mode (the order flips).")
        ] = 5,
        parked: Annotated[
            int, typer.Option(min=1, help="Rollouts parked at each mode's checkpoint.")
        ] = 50,
        directory: DirOption = None,
        as_json: JsonOption = False,
    ) -> None:
        """Tracing off and on: µs per model call, the checkpoint pause, spans written."""
        refuse_unusable_paths(directory)
        try:
            with (
                tempfile.TemporaryDirectory(prefix="midflight-bench-", dir=directory) as scratch,
                quiet_logs(),
            ):
                payload = run_tracing_bench(
                    Path(scratch),
                    rollouts=rollouts,
                    concurrency=concurrency,
                    rounds=rounds,
                    parked=parked,
                )
        except RuntimeError as exc:
            usage_error(str(exc))

        def render() -> None:
            table = Table(
                title=f"tracing: median of {rounds} round{'s' if rounds > 1 else ''}, {rollouts} rollouts "
                f"({payload['calls_per_rollout']} model calls, "
                f"{payload['http_requests_per_rollout']:g} requests each), {concurrency} in "
                f"flight, {parked} parked at the checkpoint"
            )
            for column in (
                "mode",
                "µs / call",
                "CPU µs / call",
                "checkpoint s",
                "spans / rollout",
                "spans / checkpoint",
            ):
                table.add_column(
                    column, justify="left" if column == "mode" else "right", overflow="fold"
                )
            table.add_row(
                "off (floor)",
                f"{payload['off_us_per_call']:.1f}",
                f"{payload['off_cpu_us_per_call']:.1f}",
                f"{payload['checkpoint_off_s']:.3f}",
                "0",
                "0",
            )
            table.add_row(
                "checkpoints traced, rollouts not",
                f"{payload['checkpoints_us_per_call']:.1f}",
                f"{payload['checkpoints_cpu_us_per_call']:.1f}",
                f"{payload['checkpoint_checkpoints_s']:.3f}",
                f"{payload['checkpoints_spans_per_rollout']:g}",
                f"{payload['spans_per_checkpoint']:g}",
            )
            table.add_row(
                "on (all traced)",
                f"{payload['on_us_per_call']:.1f}",
                f"{payload['on_cpu_us_per_call']:.1f}",
                f"{payload['checkpoint_on_s']:.3f}",
                f"{payload['spans_per_rollout']:g}",
                f"{payload['spans_per_checkpoint']:g}",
            )
            print_whole(table)
            micro = payload["span_call"]
            console.print(
                f"on - off: {payload['overhead_us_per_call']:.1f} µs / call "
                f"({payload['ratio']}x; CPU {payload['cpu_ratio']}x; round by round "
                f"{payload['round_ratios']}). floor: {payload['floor']}."
            )
            console.print(
                f"one checkpoint_span with no provider: {micro['span_off_ns']:.0f} ns (an empty "
                f"nullcontext: {micro['nullcontext_ns']:.0f} ns, an empty @contextmanager: "
                f"{micro['empty_contextmanager_ns']:.0f} ns); with the provider on and the spans "
                f"file written: {micro['span_on_ns']:.0f} ns."
            )

        emit_bench(payload, as_json=as_json, render=render)
