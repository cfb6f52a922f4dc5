"""``midflight drill``: the crash-restore drill."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from participants import RESOURCES_MODES, VERIFY_MODES

from .._drill.baseline import check_baseline_dir
from .._drill.errors import DrillRunError
from .._drill.options import FAULTS, DrillOptions, default_concurrency
from .._drill.oracle import ERROR_FIGURES
from .._drill.progress import DrillProgress
from .._drill.run import run_drill
from .._drill.store import DISK
from .._launch.limits import open_files_problem
from .._sequences.cases import NAMED_CASES
from .._sequences.suite import REFERENCE_LENGTH, REFERENCE_ROLLOUTS
from .._worker.engines import DEFAULT_ENGINE, engine_names
from .drill_checks import (
    refuse_a_drill_that_cannot_pass,
    refuse_a_store_that_cannot_run,
    refuse_a_used_directory,
    refuse_an_engine_that_cannot_run,
    refuse_hosting_that_cannot_run,
)
from .drill_matrix import run_matrix_command
from .output import JsonOption, console, emit, error_console, usage_error

SHOWN = (
    "rollouts",
    "completed",
    "checkpoints",
    "crashes",
    "restored",
    "restarted",
    "lost",
    "token_mismatches",
    "reward_mismatches",
    "repeated_model_calls",
    "redone_model_calls",
    "restored_delivered",
    "held_delivered",
    "cut_continued",
    "extra_tokens_generated",
    "prefix_mismatches",
    "commits_retried",
    "continuation_redecode_mismatches",
    "continuation_divergence",
    "stale_probes",
    "stale_accepted",
    "leftover",
    "wall_s",
    "baseline_wall_s",
)


def register(app: typer.Typer) -> None:
    """Add ``drill`` to the app (its controller processes' commands are in ``drivers``)."""

    @app.command("drill")
    def drill_command(
        rollouts: Annotated[
            int | None,
            typer.Option(
                min=1, help="Rollouts to run \\[default: 8; 10, the reference's, with --sequences]."
            ),
        ] = None,
        checkpoints: Annotated[
            int,
            typer.Option(
                min=0, help="Checkpoints to publish in all, at least 3 and at least --crashes."
            ),
        ] = 3,
        crashes: Annotated[
            int, typer.Option(min=0, help="SIGKILLs of every server (at least 2).")
        ] = 2,
        seed: Annotated[int, typer.Option(min=0, help="Generation seed of the episodes.")] = 0,
        token_delay_ms: Annotated[
            float, typer.Option(min=0.0, help="Worker delay per token.")
        ] = 4.0,
        concurrency: Annotated[
            int | None,
            typer.Option(
                min=1,
                help="Rollouts in flight at once \\[default: 4; a quarter of --rollouts, at most "
                "256, from 20 rollouts on].",
            ),
        ] = None,
        fault: Annotated[
            str | None, typer.Option(help="Inject a fault: " + ", ".join(sorted(FAULTS)))
        ] = None,
        verify: Annotated[
            str, typer.Option(help="The resources server's verify mode: wait or replay.")
        ] = "wait",
        resources_mode: Annotated[
            str,
            typer.Option(help="The resources server's mode: exported, stateless, restart_only."),
        ] = "exported",
        restart_only_share: Annotated[
            float,
            typer.Option(
                min=0.0,
                max=1.0,
                help="Share of the rollouts run through a restart-only agent (0 for none).",
            ),
        ] = 0.2,
        processes: Annotated[
            int,
            typer.Option(
                "--processes",
                "--workers",
                min=1,
                max=16,
                help="Processes per server but the inference worker (each server still one "
                "participant). --workers is the same option.",
            ),
        ] = 1,
        keep_dir: Annotated[
            Path | None, typer.Option(help="Run here and keep every file (evidence, logs).")
        ] = None,
        baseline: Annotated[
            Path | None,
            typer.Option(
                help="Keep the baseline run here and reuse it next time (same rollouts, seed and "
                "task input)."
            ),
        ] = None,
        sequences: Annotated[
            int,
            typer.Option(
                min=0,
                help="Run this many random operation sequences instead (seeds from --seed on).",
            ),
        ] = 0,
        sequence_length: Annotated[
            int, typer.Option(min=2, help="Operations per random sequence.")
        ] = REFERENCE_LENGTH,
        sequence_crashes: Annotated[
            int, typer.Option(min=0, help="At most this many crashes per random sequence.")
        ] = 2,
        sequence_case: Annotated[
            str | None,
            typer.Option(
                help="Run one named, forced interleaving instead: " + ", ".join(sorted(NAMED_CASES))
            ),
        ] = None,
        matrix: Annotated[
            str | None,
            typer.Option(
                help="Run the kill -9 matrix instead: small, full, or killed:boundary,… cells."
            ),
        ] = None,
        matrix_jobs: Annotated[
            int, typer.Option(min=1, help="Matrix clusters (baseline, cells) run side by side.")
        ] = 1,
        engine: Annotated[
            str,
            typer.Option(
                metavar="NAME", help=f"The worker's inference engine: {', '.join(engine_names())}."
            ),
        ] = DEFAULT_ENGINE,
        model: Annotated[
            Path | None,
            typer.Option(
                metavar="DIR",
                help="A model engine's model directory \\[default: the tiny model, built in the "
                "run's directory].",
            ),
        ] = None,
        dtype: Annotated[
            str,
            typer.Option(help="A model engine's floating-point type: float64, float32, bfloat16."),
        ] = "float64",
        trace_dir: Annotated[
            Path | None,
            typer.Option(
                metavar="DIR",
                help="Every process of the run appends its spans to DIR; the drill draws the "
                "last checkpoint's timeline there (see midflight trace).",
            ),
        ] = None,
        checkpoint_store: Annotated[
            str,
            typer.Option(
                metavar="STORE",
                help="Where the run keeps its checkpoints: disk (the run directory), s3 (a "
                "local S3 API server the drill starts) or s3://bucket/prefix (AWS_* variables).",
            ),
        ] = DISK,
        on: Annotated[
            str,
            typer.Option(
                metavar="HOST",
                help="Where the servers run: local (a process group each) or ray (an actor "
                "each, on a local Ray head the drill starts; crashes kill the actors' processes).",
            ),
        ] = "local",
        as_json: JsonOption = False,
    ) -> None:
        """Run rollouts through checkpoints and SIGKILLs and prove nothing was lost or repeated."""
        checkpoint_store = refuse_a_store_that_cannot_run(checkpoint_store, sequences)
        on = refuse_hosting_that_cannot_run(on, matrix=matrix is not None, sequences=sequences)
        if fault is not None and fault not in FAULTS:
            usage_error(f"unknown fault {fault!r}; known: {sorted(FAULTS)}")
        if verify not in VERIFY_MODES:
            usage_error(f"unknown verify mode {verify!r}; known: {list(VERIFY_MODES)}")
        if resources_mode not in RESOURCES_MODES:
            usage_error(
                f"unknown resources mode {resources_mode!r}; known: {list(RESOURCES_MODES)}"
            )
        if sequence_case is not None and sequence_case not in NAMED_CASES:
            usage_error(f"unknown sequence case {sequence_case!r}; known: {sorted(NAMED_CASES)}")
        if sequence_case is not None:
            sequences = 1
        refuse_an_engine_that_cannot_run(engine, model, dtype)
        if keep_dir is not None:
            refuse_a_used_directory(keep_dir)
        if baseline is not None:
            try:
                check_baseline_dir(baseline)
            except ValueError as exc:
                usage_error(str(exc))
        if matrix is None and not sequences:
            refuse_a_drill_that_cannot_pass(checkpoints, crashes)
        if rollouts is None:
            rollouts = REFERENCE_ROLLOUTS if sequences else 8
        if concurrency is None:
            concurrency = default_concurrency(rollouts)
        if (problem := open_files_problem(min(concurrency, rollouts))) is not None:
            usage_error(problem)  # before anything starts, not as EMFILE halfway through
        options = DrillOptions(
            rollouts=rollouts,
            checkpoints=checkpoints,
            crashes=crashes,
            seed=seed,
            token_delay_ms=token_delay_ms,
            concurrency=concurrency,
            fault=fault,
            verify=verify,
            resources_mode=resources_mode,
            restart_only_share=restart_only_share,
            processes=processes,
            engine=engine,
            model=None if model is None else str(model.resolve()),
            dtype=dtype,
            trace_dir=None if trace_dir is None else str(trace_dir.resolve()),
            checkpoint_store=checkpoint_store,
            on=on,
        )
        if matrix is not None:
            # Matrix cells run one crash each and no restart-only share (their own crash plan).
            cells = dataclasses.replace(options, restart_only_share=0.0, processes=1)
            run_matrix_command(matrix, cells, keep_dir, jobs=matrix_jobs, as_json=as_json)
        work = keep_dir.resolve() if keep_dir else Path(tempfile.mkdtemp(prefix="midflight-drill-"))
        if sequences:
            from .drill_sequences import run_sequences_command

            run_sequences_command(
                sequences,
                seed,
                options,
                work,
                length=sequence_length,
                max_crashes=sequence_crashes,
                case=sequence_case,
                keep=keep_dir is not None,
                as_json=as_json,
            )
        progress = DrillProgress(
            error_console, rollouts=rollouts, checkpoints=checkpoints, crashes=crashes
        )

        def quiet(line: str) -> None:
            return None

        # A run that did not pass keeps its directory (logs, evidence, checkpoints), D366: a
        # rare failure may not come back when the drill is run again with --keep-dir.
        discard = False
        try:
            with progress if not as_json else contextlib.nullcontext():
                figures = run_drill(
                    options,
                    work,
                    quiet if as_json else progress.on_line,
                    baseline_dir=baseline.resolve() if baseline else None,
                )
        except ValueError as exc:  # a kept baseline of other rollouts: nothing was run
            discard = True  # nothing was run
            usage_error(str(exc))
        except KeyboardInterrupt:
            discard = True  # stopped by its user, who did not ask to keep it
            raise
        except DrillRunError as exc:  # stalled, or a baseline short: one line or JSON object
            message = f"{exc}; the run's files are kept in {work}"
            emit(
                {"ok": False, "error": message, "failures": [str(exc)], "kept_dir": str(work)},
                as_json=as_json,
                render=lambda: error_console.print(
                    f"midflight drill: FAIL: {message}", markup=False, soft_wrap=True
                ),
            )
            raise typer.Exit(1) from None
        else:
            failures = figures.failed_checks(require_cuts=True)
            discard = not failures
        finally:
            if keep_dir is None and discard:
                shutil.rmtree(work, ignore_errors=True)
        figures.values["ok"] = not failures
        figures.values["failures"] = failures
        figures.values["kept_dir"] = None if keep_dir is None and discard else str(work)

        def render() -> None:
            table = Table(title="midflight drill")
            table.add_column("figure")
            table.add_column("value", justify="right")
            for name in SHOWN:
                value = figures.values.get(name)
                style = "red" if name in ERROR_FIGURES and value else ""
                table.add_row(name, f"[{style}]{value}[/{style}]" if style else str(value))
            console.print(table)
            if figures.values.get("trace_dir"):
                timeline = figures.values.get("trace_timeline") or "none drawn"
                console.print(
                    f"spans in {figures.values['trace_dir']}; timeline: {timeline}", markup=False
                )
            if figures.values.get("on") == "ray":
                console.print(
                    f"hosted on Ray: the crashes killed {figures.values['ray_processes_killed']} "
                    f"processes; {figures.values['ray_left_running']} outlived the head",
                    markup=False,
                )
            where = figures.values["checkpoint_store"]
            objects = figures.values["checkpoint_objects"]
            if figures.values["kept_dir"] is None and where.startswith(str(work)):
                said = f"{objects} checkpoint objects, removed with the passed run"
                said += " (--keep-dir DIR keeps them)"
            else:
                said = f"checkpoints in {where} ({objects} objects)"
            console.print(said, markup=False)
            console.print(
                "[green]PASS[/green]" if not failures else "[red]FAIL[/red]: " + "; ".join(failures)
            )
            if failures and keep_dir is None:
                console.print(f"the run's files are kept in {work}", markup=False)

        emit(figures.values, as_json=as_json, render=render)
        raise typer.Exit(0 if not failures else 1)
