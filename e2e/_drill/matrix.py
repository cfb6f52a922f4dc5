"""``midflight drill --matrix``: a real SIGKILL of one process at each publication boundary.

Each cell names a process (a server or the controller) and a boundary. The cell's run arms that
named kill point (test flag only, see ``participants.KillPoint``); when the process announces it
reached the boundary, the harness SIGKILLs it, then crashes the rest of the deployment like the
drill does (every server and the controller), starts fresh processes, and the next controller
incarnation restores from ``LATEST``. The cell is green when the run ends exactly once (every
oracle error figure 0) and every restore used the last fully published checkpoint at its crash
(a checkpoint killed before ``LATEST`` moved is never restored; a half-written one never verifies).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

from coordinator import checkpoint_location, read_latest, verify_checkpoint
from participants import KILL_BOUNDARIES, read_kill_announcements
from participants.testing import KILL_FILE_ENV, KILL_POINT_ENV, TEST_HOOKS_ENV

from .._launch.supervisor import Supervisor, SupervisorOptions
from .._servers.cluster import DEFAULT_NAMES
from .._servers.evidence import EvidenceLog, read_evidence
from .driver_process import DriverProcess
from .options import DrillOptions
from .oracle import ERROR_FIGURES, RolloutOutcome, compute_figures, rollout_outcomes
from .run import run_cluster
from .store import DrillStore, drill_store

SERVERS: Final = tuple(
    DEFAULT_NAMES[role] for role in ("environment", "model", "agent", "resources")
)
"""The participant servers by server name (the model's is ``policy``), in prepare order."""
CONTROLLER: Final = "controller"
CONTROLLER_ONLY: Final = frozenset({"checkpoint-json-written"})
SERVER_ONLY: Final = frozenset({"records-written"})
"""``checkpoint.json`` is the controller's file; a records file is a server's."""
SMALL_MATRIX: Final = (
    (CONTROLLER, "checkpoint-json-written"),
    ("resources", "records-written"),
)
"""The fast tier's cells: a controller kill at the checkpoint.json/LATEST boundary, a server
kill in the middle of its write."""
BASELINE_WAIT_SECONDS: Final = 900.0
MAX_PHASES: Final = 3
"""Controller incarnations per cell: the kill may come in the first or in a recovery."""


@dataclass(frozen=True)
class MatrixCell:
    """One cell's outcome (``--json``: ``{"killed", "boundary", "ok", "detail"}``)."""

    killed: str
    boundary: str
    ok: bool
    detail: str


PUBLICATION_BOUNDARIES: Final = frozenset(
    {"records-written", "manifests-published", "checkpoint-json-written"}
)
"""Where a checkpoint's files or objects are written: the cells ``publication`` names."""


def full_matrix() -> list[tuple[str, str]]:
    """Every (process, boundary) a process can reach: the controller and each server."""
    cells: list[tuple[str, str]] = []
    for killed in (CONTROLLER, *SERVERS):
        for boundary in KILL_BOUNDARIES:
            excluded = SERVER_ONLY if killed == CONTROLLER else CONTROLLER_ONLY
            if boundary not in excluded:
                cells.append((killed, boundary))
    return cells


def parse_cells(text: str) -> list[tuple[str, str]]:
    """``killed:boundary,…`` → cells; ``small``, ``publication`` and ``full`` name the built-in
    sets (``publication``: every cell at a boundary where the checkpoint is written).

    Raises:
        ValueError: An unknown set, process, boundary, or a pair no process can reach.
    """
    if text == "small":
        return list(SMALL_MATRIX)
    if text == "full":
        return full_matrix()
    if text == "publication":
        return [cell for cell in full_matrix() if cell[1] in PUBLICATION_BOUNDARIES]
    reachable = set(full_matrix())
    cells: list[tuple[str, str]] = []
    for item in (part.strip() for part in text.split(",")):
        killed, _, boundary = item.partition(":")
        if (killed, boundary) not in reachable:
            raise ValueError(
                f"no process reaches {item!r}: use small, publication, full or killed:boundary "
                f"with killed in {[CONTROLLER, *SERVERS]} and boundary in {list(KILL_BOUNDARIES)}"
            )
        cells.append((killed, boundary))
    return cells


def occurrence_of(boundary: str) -> int:
    """Which reach of the boundary is killed: the second checkpoint's, so one is published.

    Retire happens once a checkpoint is behind us anyway (a recovery, or the final retire).
    """
    return 1 if boundary == "retire-partly-applied" else 2


def fully_published(root: Path, checkpoints_at: Path | str | None = None) -> list[str]:
    """Checkpoints whose publication finished, oldest first.

    Fully published means the controller logged it after ``LATEST`` moved (its ``checkpoint``
    evidence line) and it still verifies; a ``checkpoint.json`` whose ``LATEST`` never moved
    does not count.
    """
    logged = [
        e["id"]
        for e in read_evidence(root / "evidence" / "driver.jsonl")
        if e.get("event") == "checkpoint"
    ]
    return [
        checkpoint_id
        for checkpoint_id in logged
        if not verify_checkpoint(checkpoint_location(checkpoints_at or root, checkpoint_id))
    ]


def _latest_readable(checkpoints_at: Path | str) -> str:
    try:
        manifest = read_latest(checkpoints_at)
    except Exception as exc:  # the very thing a red cell reports
        return f"unreadable ({type(exc).__name__}: {exc})"
    return manifest.checkpoint_id if manifest else "none"


def run_cell(
    root: Path,
    options: DrillOptions,
    killed: str,
    boundary: str,
    *,
    baseline: Future[dict[str, RolloutOutcome]],
    token: str,
    on_line: Callable[[str], None],
    store: DrillStore | None = None,
) -> MatrixCell:
    """Run one cell in ``root`` (its checkpoints in ``store``, the run directory by default) and
    judge it against the baseline once that is ready."""
    store = store or DrillStore()
    checkpoints_at = store.location(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / "logs").mkdir(exist_ok=True)
    kill_file = root / "evidence" / "kill-points.jsonl"
    env = {
        "MIDFLIGHT_CONTROL_TOKEN": token,
        TEST_HOOKS_ENV: "1",
        KILL_POINT_ENV: f"{killed}:{boundary}@{occurrence_of(boundary)}",
        KILL_FILE_ENV: str(kill_file),
        **store.env,
    }
    if options.fault:
        env["MIDFLIGHT_FAULT"] = options.fault
    evidence = EvidenceLog(root / "evidence" / "driver.jsonl")
    rollouts = [f"r{index:03d}" for index in range(options.rollouts)]
    task_input = options.task_input()
    supervisor_options = SupervisorOptions(
        role_options={
            "worker": {"token_delay_ms": options.token_delay_ms, "seed": options.seed},
            "resources": {"mode": options.resources_mode, "verify": options.verify},
        },
        env=env,
        checkpoint_root=store.root_of(root),
    )
    expected: list[tuple[float, str | None]] = []  # crash time → the checkpoint to restore
    problems: list[str] = []
    with Supervisor(root, token, supervisor_options) as supervisor:
        for phase in range(MAX_PHASES):
            plan = {
                "rollouts": rollouts,
                "task_input": task_input,
                "phase": phase,
                "checkpoints": 2,
                "crash_after": phase == 0,
                "concurrency": options.concurrency,
                "fault": None,
                "checkpoint_root": store.root_of(root),
            }
            word = "crash-point" if phase == 0 else "done"
            driver = DriverProcess(root, supervisor.cluster_path, plan, env)
            try:
                outcome = _watch(driver, word, kill_file, options.phase_timeout_s, on_line)
                if outcome == "killed":
                    # The real SIGKILL at the boundary, before anything else dies.
                    if killed == CONTROLLER:
                        driver.kill()
                    else:
                        supervisor.processes[killed].kill()
                    on_line(f"{killed} SIGKILLed at {boundary}")
            finally:
                driver.kill()
            if outcome == "done":
                break
            if outcome not in ("killed", "crash-point"):
                problems.append(f"phase {phase}: {outcome}")
                break
            supervisor.kill_all()
            published = fully_published(root, checkpoints_at)
            crash_t = time.time()
            expected.append((crash_t, published[-1] if published else None))
            evidence.append({"event": "crash", "phase": phase, "t": crash_t, "cause": outcome})
            on_line(
                f"crash {phase + 1}: every server SIGKILLed; LATEST {_latest_readable(checkpoints_at)}"
            )
            supervisor.restart_all()
        else:
            problems.append(f"the run did not finish in {MAX_PHASES} controller incarnations")
    return _judge(root, checkpoints_at, options, (killed, boundary), baseline, expected, problems)


def _watch(
    driver: DriverProcess,
    word: str,
    kill_file: Path,
    timeout: float,
    on_line: Callable[[str], None],
) -> str:
    """Until the kill point is announced (``killed``), ``word`` is said, the driver ends, or
    the phase times out."""
    deadline = time.monotonic() + timeout
    announced = len(read_kill_announcements(kill_file))
    while time.monotonic() < deadline:
        if driver.wait_for(word, 0.2, on_line):
            return word if word == "done" else "crash-point"
        if len(read_kill_announcements(kill_file)) > announced:
            return "killed"
        if driver.process.poll() is not None:
            # One last look: the announcement may have landed just before the exit.
            if len(read_kill_announcements(kill_file)) > announced:
                return "killed"
            return f"the controller exited with code {driver.process.returncode}"
    return f"nothing happened within {timeout:g} s"


def _judge(
    root: Path,
    checkpoints_at: Path | str,
    options: DrillOptions,
    cell: tuple[str, str],
    baseline: Future[dict[str, RolloutOutcome]],
    expected: Sequence[tuple[float, str | None]],
    problems: list[str],
) -> MatrixCell:
    killed, boundary = cell
    announcements = [
        a
        for a in read_kill_announcements(root / "evidence" / "kill-points.jsonl")
        if a.get("process") == killed and a.get("boundary") == boundary
    ]
    if len(announcements) != 1:
        problems.append(f"the kill point was reached {len(announcements)} times, not once")
    restores = [
        e for e in read_evidence(root / "evidence" / "driver.jsonl") if e.get("event") == "restore"
    ]
    for crash_t, wanted in expected:
        restore = next((r for r in restores if r["t"] > crash_t), None)
        if restore is None:
            problems.append("a crash was never restored")
        elif restore["checkpoint_id"] != wanted:
            problems.append(
                f"restored {restore['checkpoint_id']}, the last fully published was {wanted}"
            )
    for restore in restores:
        problems += verify_checkpoint(restore["checkpoint_dir"])
    figures = compute_figures(
        root,
        baseline.result(timeout=BASELINE_WAIT_SECONDS),
        rollouts=options.rollouts,
        checkpoints_at=checkpoints_at,
    ).values
    problems += [f"{name} = {figures[name]}" for name in ERROR_FIGURES if figures.get(name)]
    if not problems:
        detail = (
            f"{len(expected)} crash(es), restored {[r['checkpoint_id'] for r in restores]}, "
            f"{figures['completed']}/{options.rollouts} completed exactly once"
        )
    else:
        detail = "; ".join(problems)
    return MatrixCell(killed, boundary, not problems, detail)


def run_matrix(
    cells: Sequence[tuple[str, str]],
    options: DrillOptions,
    work: Path,
    on_line: Callable[[str], None],
    *,
    jobs: int = 1,
) -> list[MatrixCell]:
    """Every cell on a fresh cluster of its own, and one shared baseline to judge them by.

    With ``jobs`` > 1 the baseline and the cells run side by side (each its own cluster on
    its own ports and run root): a cluster spends most of its time starting processes.
    """
    token = secrets.token_urlsafe(24)
    with drill_store(options.checkpoint_store) as store:
        return _run_cells(cells, options, work, on_line, jobs, token, store)


def _run_cells(
    cells: Sequence[tuple[str, str]],
    options: DrillOptions,
    work: Path,
    on_line: Callable[[str], None],
    jobs: int,
    token: str,
    store: DrillStore,
) -> list[MatrixCell]:
    def baseline() -> dict[str, RolloutOutcome]:
        run_cluster(
            work / "baseline",
            DrillOptions(**{**asdict(options), "fault": None}),
            crashes=0,
            checkpoints=[0],
            token=token,
            on_line=lambda line: on_line(f"baseline: {line}"),
        )
        return rollout_outcomes(work / "baseline")

    def one(killed: str, boundary: str, outcomes: Future[dict[str, RolloutOutcome]]) -> MatrixCell:
        name = f"{killed}-{boundary}"
        try:
            cell = run_cell(
                work / name,
                options,
                killed,
                boundary,
                baseline=outcomes,
                token=token,
                on_line=lambda line: on_line(f"{name}: {line}"),
                store=store,
            )
        except Exception as exc:  # a cell that cannot even run is a red cell, not a crash
            cell = MatrixCell(killed, boundary, False, f"{type(exc).__name__}: {exc}")
        on_line(f"{name}: {'ok' if cell.ok else 'FAILED'} — {cell.detail}")
        return cell

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        outcomes = pool.submit(baseline)
        futures = [pool.submit(one, killed, boundary, outcomes) for killed, boundary in cells]
        return [future.result() for future in futures]


def cells_json(cells: Sequence[MatrixCell]) -> dict[str, Any]:
    """``{"cells": [{"killed", "boundary", "ok", "detail"}, …]}`` (the command adds ``kept_dir``)."""
    return {"cells": [asdict(cell) for cell in cells]}
