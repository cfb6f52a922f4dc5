"""``midflight drill``: the crash-restore drill.

1. **Baseline**: the same rollouts on a fresh cluster, no checkpoint, no crash.
2. **Run**: the rollouts again with checkpoints taken while model calls are in flight, and a SIGKILL
   of every server process (and of the controller) after some of them; each time fresh processes
   start on the same run root and the controller restores from the last published checkpoint.
3. **Oracle**: the figures, computed from evidence, against the baseline.
"""

from __future__ import annotations

import functools
import json
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from .._launch.supervisor import ExtraServer, Supervisor, SupervisorOptions
from .._servers.evidence import EvidenceLog, evidence_written
from .._trace.setup import TRACE_DIR_ENV
from .baseline import (
    BASELINE_MARKER,
    BASELINE_STARTED,
    baseline_shortfall,
    check_baseline_dir,
    finished_baseline,
)
from .continuations import continued_calls, model_engine_figures
from .driver_process import DriverProcess
from .errors import DrillBaselineError, DrillStalledError
from .hosting import ClusterHosting, DrillHosting, drill_hosting
from .loop_stalls import loop_stalls
from .options import (
    MULTI_PROCESS_ROLES,
    RESTART_AGENT,
    RESTART_ENVIRONMENT,
    DrillOptions,
    process_options,
    restart_only_rollouts,
)
from .oracle import Figures, RolloutOutcome, compute_figures, rollout_outcomes
from .store import DrillStore, drill_store
from .trace_figures import trace_figures


def _phase_checkpoints(options: DrillOptions) -> list[int]:
    """Spread the checkpoints over the phases; every phase before a crash gets at least one."""
    phases = options.crashes + 1
    counts = [0] * phases
    for index in range(options.checkpoints):
        counts[index % phases] += 1
    for phase in range(options.crashes):
        counts[phase] = max(counts[phase], 1)  # a crash needs a published checkpoint to restore
    return counts


def run_cluster(
    root: Path,
    options: DrillOptions,
    *,
    crashes: int,
    checkpoints: list[int],
    token: str,
    on_line: Callable[[str], None],
    trace_dir: Path | None = None,
    store: DrillStore | None = None,
    hosting: ClusterHosting | None = None,
) -> None:
    """Run every driver phase on one cluster, crashing between phases (traced into
    ``trace_dir`` when given; its checkpoints in ``store``, the run directory by default; its
    servers where ``hosting`` says, local processes by default)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "logs").mkdir(exist_ok=True)
    store = store or DrillStore()
    hosting = hosting or ClusterHosting()
    env = {"MIDFLIGHT_CONTROL_TOKEN": token, **store.env}
    if options.fault:
        env["MIDFLIGHT_FAULT"] = options.fault
    if trace_dir is not None:
        env[TRACE_DIR_ENV] = str(trace_dir.resolve())  # servers and driver trace there
    rollouts = [f"r{index:03d}" for index in range(options.rollouts)]
    task_input = options.task_input()
    evidence = EvidenceLog(root / "evidence" / "driver.jsonl")
    restart_only = restart_only_rollouts(rollouts, options.restart_only_share)
    extra: tuple[ExtraServer, ...] = ()
    if restart_only:
        # The environment sends every episode to one agent, so the restart-only agent gets an
        # environment of its own; the driver sends it the restart-only share.
        extra = (
            ExtraServer(RESTART_AGENT, "agent", {"restart_only": True}),
            ExtraServer(RESTART_ENVIRONMENT, "environment", peers={"agent": RESTART_AGENT}),
        )
    shards = process_options(options.processes)
    if shards and restart_only:
        extra = tuple(
            ExtraServer(e.name, e.role, {**e.options, **shards}, e.peers)
            if e.role in MULTI_PROCESS_ROLES
            else e
            for e in extra
        )
    supervisor_options = SupervisorOptions(
        role_options={
            "worker": options.worker_options(),
            "resources": {"mode": options.resources_mode, "verify": options.verify, **shards},
            **{role: dict(shards) for role in MULTI_PROCESS_ROLES if role != "resources"},
        },
        env=env,
        extra_servers=extra,
        checkpoint_root=store.root_of(root),
    )
    with Supervisor(root, token, supervisor_options, host=hosting.host) as supervisor:
        for phase in range(crashes + 1):
            crash_after = phase < crashes
            plan = {
                "rollouts": rollouts,
                "task_input": task_input,
                "phase": phase,
                "checkpoints": checkpoints[phase] if phase < len(checkpoints) else 0,
                "crash_after": crash_after,
                "concurrency": options.concurrency,
                "fault": options.fault,
                "restart_only_rollouts": restart_only,
                "restart_environment": RESTART_ENVIRONMENT,
                "checkpoint_root": store.root_of(root),
            }
            on_line(f"phase {phase + 1}/{crashes + 1}")
            driver = DriverProcess(root, supervisor.cluster_path, plan, {**env, **hosting.env})
            try:
                word = "crash-point" if crash_after else "done"
                moving = functools.partial(evidence_written, root)
                if not driver.wait_for_progressing(
                    word, options.phase_timeout_s, on_line, activity=moving
                ):
                    raise DrillStalledError(
                        f"the drill's controller did not reach {word!r} in phase {phase}: "
                        f"{driver.why_it_stopped(options.phase_timeout_s)} (its log is "
                        f"{root / 'logs' / f'driver-{phase}.log'})"
                    )
            finally:
                driver.kill()
            if crash_after:
                supervisor.kill_all()
                hosting.crashed()
                evidence.append({"event": "crash", "phase": phase, "t": time.time()})
                on_line(f"crash {phase + 1}: every server SIGKILLed")
                supervisor.restart_all()


def baseline_key(options: DrillOptions) -> dict[str, Any]:
    """The options a baseline's outcomes (tokens, rewards) depend on; the rest only change timing.

    A model engine's outcomes also depend on the model (its files' digest) and its dtype.
    """
    key: dict[str, Any] = {"rollouts": options.rollouts, **options.task_input()}
    if options.model_engine:
        from .._worker.tiny_model import directory_digest

        model = Path(options.model) if options.model else None
        key.update(
            engine=options.engine,
            dtype=options.dtype,
            model_digest=directory_digest(model) if model and model.is_dir() else None,
        )
    return key


def _baseline(
    options: DrillOptions,
    directory: Path,
    reuse: bool,
    token: str,
    on_line: Callable[[str], None],
    hosting: DrillHosting,
) -> float:
    """Run the baseline into ``directory`` (or reuse a finished one); its wall time."""
    marker = directory / BASELINE_MARKER
    if reuse and marker.exists():
        recorded = finished_baseline(marker)
        if recorded["key"] != baseline_key(options):
            raise ValueError(
                f"the baseline in {directory} was run with {recorded['key']}, "
                f"this drill needs {baseline_key(options)}"
            )
        on_line(f"baseline: reused from {directory}")
        return float(recorded["wall_s"])
    check_baseline_dir(directory)
    if directory.exists():
        shutil.rmtree(directory)  # an unfinished baseline (no marker) is run again whole
    directory.mkdir(parents=True)
    (directory / BASELINE_STARTED).write_text("a drill's baseline runs here\n")
    started = time.monotonic()
    with hosting.cluster(directory) as cluster:
        run_cluster(
            directory,
            DrillOptions(**{**asdict(options), "fault": None}),
            crashes=0,
            checkpoints=[0],
            token=token,
            on_line=lambda line: on_line(f"baseline: {line}"),
            hosting=cluster,
        )
    wall = round(time.monotonic() - started, 3)
    finished = len(rollout_outcomes(directory))
    if finished < options.rollouts:  # no marker: it is never reused, and is run again next time
        raise DrillBaselineError(baseline_shortfall(directory, finished, options.rollouts))
    marker.write_text(json.dumps({"key": baseline_key(options), "wall_s": wall}))
    return wall


def build_drill_model(directory: Path, on_line: Callable[[str], None]) -> Path:
    """The tiny model a model engine's drill runs when ``--model`` names none."""
    from .._worker.tiny_model import build_tiny_model

    on_line(f"building the tiny model in {directory}")
    return build_tiny_model(directory).directory


def run_drill(
    options: DrillOptions,
    work: Path,
    on_line: Callable[[str], None],
    *,
    baseline_dir: Path | None = None,
) -> Figures:
    """The whole drill in ``work``: baseline, run, figures.

    Args:
        options: What to run.
        work: The run's directory (``baseline/`` and ``run/`` under it).
        on_line: Called with every progress line.
        baseline_dir: Keep the baseline here and reuse it when it already holds a finished
            baseline of the same rollouts and task input (D156).

    Raises:
        ValueError: ``baseline_dir`` holds a baseline of other rollouts or task input.
    """
    token = secrets.token_urlsafe(24)
    if options.model_engine and options.model is None:
        options = replace(options, model=str(build_drill_model(work / "model", on_line)))
    directory = baseline_dir if baseline_dir is not None else work / "baseline"
    with drill_hosting(options.on, work, on_line) as hosting:
        reuse = baseline_dir is not None
        baseline_wall = _baseline(options, directory, reuse, token, on_line, hosting)
        baseline = rollout_outcomes(directory)
        with drill_store(options.checkpoint_store) as store:
            if store.local is not None:
                on_line(f"checkpoints on a local S3 server at {store.local.endpoint}")
            figures = _run_and_judge(
                options, work, on_line, token, store, baseline, baseline_wall, hosting
            )
    figures.values.update(hosting.figures())  # after the head is gone: what outlived it
    return figures


def _run_and_judge(
    options: DrillOptions,
    work: Path,
    on_line: Callable[[str], None],
    token: str,
    store: DrillStore,
    baseline: dict[str, RolloutOutcome],
    baseline_wall: float,
    hosting: DrillHosting,
) -> Figures:
    """The run with crashes, and its figures against the baseline (the store still up)."""
    run = work / "run"
    started = time.monotonic()
    with hosting.cluster(run) as cluster:
        run_cluster(
            run,
            options,
            crashes=options.crashes,
            checkpoints=_phase_checkpoints(options),
            token=token,
            on_line=on_line,
            trace_dir=None if options.trace_dir is None else Path(options.trace_dir),
            store=store,
            hosting=cluster,
        )
    on_line("computing the figures from evidence")
    continued = continued_calls(run)  # read from the store once, for both checks
    figures = compute_figures(
        run,
        baseline,
        rollouts=options.rollouts,
        continued=continued,
        checkpoints_at=store.location(run),
    )
    figures.values.update(loop_stalls(run / "logs").figures())  # D406
    figures.values["checkpoint_store"] = store.root_of(run) or str(run)
    figures.values["checkpoint_objects"] = store.object_count(run)
    if options.model_engine:
        assert options.model is not None
        figures.values.update(
            model_engine_figures(continued, Path(options.model), options.engine, options.dtype)
        )
    figures.values["wall_s"] = round(time.monotonic() - started, 3)
    figures.values["baseline_wall_s"] = round(baseline_wall, 3)
    figures.values["fault"] = options.fault
    figures.values["engine"] = options.engine
    if options.model_engine:
        figures.values["dtype"] = options.dtype
    if options.trace_dir is not None:
        figures.values.update(trace_figures(Path(options.trace_dir), store.location(run)))
    return figures
