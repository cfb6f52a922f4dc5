"""``midflight drill --sequences N``: random operation sequences over the reference deployment.

A sequence is a plan — a seeded, weighted list of operations (start rollouts, let model calls
finish, checkpoint, checkpoint then crash and restore, retire) — that the sequence driver
(``e2e._sequences.driver``) executes on a fresh cluster, checking control-plane §8.1 after each
operation. At the end the drill's oracle (figures from evidence only) and the end-of-run rules of
§8.1 item 10 decide:

- every rollout finished with the baseline's reward and tokens (nothing lost, nothing repeated);
- no attempt made more model calls than its episode needs (the baseline's count);
- every server is idle with no retire mark and nothing live after the final forget;
- every published checkpoint verifies with the reader;
- no invariant check logged a violation.

The generation seed of the episodes stays fixed across sequences, so one baseline serves them all;
the sequence seed chooses only the operations.
"""

from __future__ import annotations

import json
import random
import secrets
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

from coordinator import verify_checkpoint
from protocols import EpisodeId

from .._drill.driver_process import DriverProcess
from .._drill.options import DrillOptions
from .._drill.oracle import (
    ERROR_FIGURES,
    RolloutOutcome,
    calls_by_incarnation,
    compute_figures,
    rollout_outcomes,
)
from .._drill.run import run_cluster
from .._launch.supervisor import Supervisor, SupervisorOptions
from .._servers.evidence import EvidenceLog, read_evidence
from .cases import NAMED_CASES

BLOCK_SHARE: Final = 0.15
"""Share of the checkpoint and crash operations whose prepare the controller treats as blocked."""

OPERATION_WEIGHTS: Final[Mapping[str, int]] = {
    "start": 4,
    "finish": 2,
    "checkpoint": 3,
    "crash": 2,
    "retire": 1,
}
"""How often each operation is drawn (weights of ``random.choices``)."""


REFERENCE_LENGTH: Final = 30
"""Operations per sequence of the reference's random-sequence suite (4 seeds, 10 rollouts each)."""
REFERENCE_ROLLOUTS: Final = 10


@dataclass(frozen=True)
class SequenceOptions:
    """What one ``--sequences`` run does: seeded plans, or one named case when ``case`` is set."""

    sequences: int = 1
    seed: int = 0
    length: int = REFERENCE_LENGTH
    max_crashes: int = 2
    drill: DrillOptions = field(
        default_factory=lambda: DrillOptions(rollouts=REFERENCE_ROLLOUTS, restart_only_share=0.0)
    )
    case: str | None = None
    keep: bool = True
    """Keep every sequence's directory; otherwise only those of failing sequences stay."""


def plan_sequence(
    seed: int, length: int = REFERENCE_LENGTH, max_crashes: int = 2
) -> list[dict[str, Any]]:
    """The operations of sequence ``seed``: the same seed always gives the same plan.

    The first operation starts rollouts (an empty deployment proves little); at most
    ``max_crashes`` crashes are drawn (an extra one becomes a checkpoint). A second generator,
    seeded from the same seed, marks about ``BLOCK_SHARE`` of the checkpoint and crash operations
    ``block``: the controller then treats that prepare as blocked by one attempt of its scope
    (``block`` picks which), so the rarer outcome of a checkpoint runs every time (D220). The
    operation names a seed draws are the same as before the marks existed.
    """
    rng = random.Random(seed)  # noqa: S311 - a reproducible plan, not a secret
    blocks = random.Random(f"block-{seed}")  # noqa: S311 - the same
    names = list(OPERATION_WEIGHTS)
    weights = list(OPERATION_WEIGHTS.values())
    ops: list[dict[str, Any]] = [{"op": "start", "count": rng.randint(1, 3)}]
    crashes = 0
    while len(ops) < length:
        name = rng.choices(names, weights)[0]
        if name == "crash":
            crashes += 1
            if crashes > max_crashes:
                name = "checkpoint"
        op: dict[str, Any] = {"op": name}
        if name == "start":
            op["count"] = rng.randint(1, 3)
        elif name == "retire":
            op["pick"] = round(rng.random(), 3)
        if name in ("checkpoint", "crash") and blocks.random() < BLOCK_SHARE:
            op["block"] = round(blocks.random(), 3)
        ops.append(op)
    return ops


def plan_of(options: SequenceOptions, seed: int) -> list[dict[str, Any]]:
    """The plan of sequence ``seed`` under ``options`` (the named case's, when one is set)."""
    if options.case is not None:
        return [dict(op) for op in NAMED_CASES[options.case]]
    return plan_sequence(seed, options.length, options.max_crashes)


class SequenceDriverProcess(DriverProcess):
    """A sequence-driver incarnation: it ends with ``done`` or asks to be crashed (``crash-at``)."""

    def wait_for_end(self, timeout: float, on_line: Callable[[str], None]) -> int | None:
        """The op index it asked to be crashed at, ``None`` once it said ``done``.

        Raises:
            RuntimeError: It exited or said neither within ``timeout``.
        """
        for text in self.lines(timeout, on_line):
            if text == "done":
                return None
            if text.startswith("crash-at "):
                return int(text.split()[1])
        raise RuntimeError("the sequence driver ended without 'done' or 'crash-at'")


def run_sequence(
    root: Path,
    seed: int,
    options: SequenceOptions,
    token: str,
    on_line: Callable[[str], None],
) -> int:
    """Execute sequence ``seed`` on a fresh cluster under ``root``; return the crashes."""
    drill = options.drill
    ops = plan_of(options, seed)
    root.mkdir(parents=True, exist_ok=True)
    (root / "logs").mkdir(exist_ok=True)
    (root / "sequence.json").write_text(json.dumps({"seed": seed, "ops": ops}))
    env = {"MIDFLIGHT_CONTROL_TOKEN": token}
    if drill.fault:
        env["MIDFLIGHT_FAULT"] = drill.fault
    supervisor_options = SupervisorOptions(
        role_options={
            "worker": {"token_delay_ms": drill.token_delay_ms, "seed": drill.seed},
            "resources": {"mode": drill.resources_mode, "verify": drill.verify},
        },
        env=env,
    )
    crashes = 0
    first = 0
    with Supervisor(root, token, supervisor_options) as supervisor:
        while True:
            plan = {
                "rollouts": [f"r{index:03d}" for index in range(drill.rollouts)],
                "task_input": {
                    "activations": drill.activations,
                    "turns": drill.turns,
                    "max_tokens": drill.max_tokens,
                    "seed": drill.seed,
                },
                "phase": crashes,
                "checkpoints": 0,
                "crash_after": False,
                "concurrency": drill.concurrency,
                "fault": drill.fault,
                "ops": ops[first:],
                "first_index": first,
            }
            driver = SequenceDriverProcess(
                root, supervisor.cluster_path, plan, env, command="sequence-driver"
            )
            try:
                crashed_at = driver.wait_for_end(drill.phase_timeout_s * 3, on_line)
            finally:
                driver.kill()
            if crashed_at is None:
                return crashes
            supervisor.kill_all()
            crashes += 1
            EvidenceLog(root / "evidence" / "driver.jsonl").append(
                {"event": "crash", "phase": crashes - 1, "t": time.time()}
            )
            on_line(f"seed {seed}: crash {crashes} after op {crashed_at}")
            supervisor.restart_all()
            first = crashed_at + 1


def checkpoint_outcomes(driver: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each checkpoint the controller tried: its operation's index, id and outcome."""
    outcomes: list[dict[str, Any]] = []
    pending: list[dict[str, Any]] = []
    for event in driver:
        if event.get("event") == "checkpoint":
            pending.append({"id": event["id"], "outcome": "published"})
        elif event.get("event") == "prepare_blocked":
            pending.append(
                {
                    "id": event["id"],
                    "outcome": "blocked",
                    "blockers": event.get("blockers", []),
                    "forced": bool(event.get("forced")),
                }
            )
        elif event.get("event") == "step":
            outcomes += [{"step": event["index"], **item} for item in pending]
            pending = []
    return outcomes + pending


def sequence_failures(
    root: Path, baseline: Mapping[str, RolloutOutcome], rollouts: int
) -> tuple[list[str], dict[str, Any]]:
    """Why sequence run ``root`` fails §8.1 (empty when it holds), and its figures.

    The figures are the drill's (a rerun from input the controller chose repeats calls by design,
    D219); calls are bounded per incarnation, since a restore of an older checkpoint brings back
    capture keys that already ran.
    """
    figures = compute_figures(root, baseline, rollouts=rollouts).values
    driver = read_evidence(root / "evidence" / "driver.jsonl")
    policy = read_evidence(root / "evidence" / "policy.jsonl")
    failures = [f"{name} = {figures[name]}" for name in ERROR_FIGURES if figures.get(name)]
    for event in driver:
        if event.get("event") == "violation":
            failures.append(f"step {event['step']}: {event['rule']}: {event['detail']}")
    needed = {rollout: outcome.model_calls for rollout, outcome in baseline.items()}
    calls = calls_by_incarnation(driver, policy)
    for key, counts in sorted(calls.items()):
        bound = needed.get(EpisodeId.from_capture_key(key).rollout_id, 0)
        for incarnation, count in enumerate(counts):
            if count > bound:
                failures.append(
                    f"calls: {key} made {count} model calls in incarnation {incarnation}, "
                    f"its episode needs {bound}"
                )
    for directory in sorted((root / "checkpoints").glob("*/checkpoint.json")):
        failures += [f"verify: {p}" for p in verify_checkpoint(directory.parent)]
    figures["violations"] = sum(1 for e in driver if e.get("event") == "violation")
    figures["retires"] = sum(1 for e in driver if e.get("event") == "retire")
    figures["checkpoint_outcomes"] = checkpoint_outcomes(driver)
    figures["calls"] = {key: counts for key, counts in calls.items() if sum(counts)}
    return failures, figures


def replay_command(options: SequenceOptions, seed: int) -> str:
    """The command line that runs sequence ``seed`` (or the named case) again, keeping its files."""
    drill = options.drill
    words = ["midflight", "drill", "--sequences", "1", "--rollouts", str(drill.rollouts)]
    if options.case is not None:
        words += ["--sequence-case", options.case]
    else:
        words += [
            "--seed", str(seed),
            "--sequence-length", str(options.length),
            "--sequence-crashes", str(options.max_crashes),
        ]  # fmt: skip
    if drill.token_delay_ms != DrillOptions.token_delay_ms:
        words += ["--token-delay-ms", f"{drill.token_delay_ms:g}"]
    if drill.fault:
        words += ["--fault", drill.fault]
    if drill.verify != DrillOptions.verify:
        words += ["--verify", drill.verify]
    if drill.resources_mode != DrillOptions.resources_mode:
        words += ["--resources-mode", drill.resources_mode]
    return " ".join([*words, "--keep-dir", f"midflight-seq-{seed}", "--json"])


def run_sequences(
    options: SequenceOptions, work: Path, on_line: Callable[[str], None]
) -> dict[str, Any]:
    """Run every sequence of ``options`` under ``work``; one report for ``--json``."""
    token = secrets.token_urlsafe(24)
    started = time.monotonic()
    baseline_options = DrillOptions(**{**asdict(options.drill), "fault": None})
    run_cluster(
        work / "baseline",
        baseline_options,
        crashes=0,
        checkpoints=[0],
        token=token,
        on_line=lambda line: on_line(f"baseline: {line}"),
    )
    baseline = rollout_outcomes(work / "baseline")
    results: list[dict[str, Any]] = []
    seeds = (
        [options.seed] if options.case else range(options.seed, options.seed + options.sequences)
    )
    for seed in seeds:
        root = work / f"seq-{seed}"
        begun = time.monotonic()
        try:
            crashes = run_sequence(root, seed, options, token, on_line)
            failures, figures = sequence_failures(root, baseline, options.drill.rollouts)
        except RuntimeError as exc:
            crashes, failures, figures = -1, [f"did not finish: {exc}"], {}
        ok = not failures
        row: dict[str, Any] = {
            "seed": seed,
            "case": options.case,
            "ok": ok,
            "ops": [_op_word(op) for op in plan_of(options, seed)],
            "crashes": crashes,
            "checkpoints": figures.get("checkpoints", 0),
            "retires": figures.get("retires", 0),
            "restored": figures.get("restored", 0),
            "rerun_model_calls": figures.get("rerun_model_calls", 0),
            "checkpoint_outcomes": figures.get("checkpoint_outcomes", []),
            "failures": failures,
            "wall_s": round(time.monotonic() - begun, 3),
        }
        if not ok:
            row["replay"] = replay_command(options, seed)
            row["evidence"] = str(root)
            row["calls"] = figures.get("calls", {})
            on_line(f"sequence seed {seed} FAILED: " + "; ".join(failures))
            on_line(f"  replay: {row['replay']}  (evidence kept in {root})")
        elif not options.keep:
            shutil.rmtree(root, ignore_errors=True)
        results.append(row)
    failed = [r["seed"] for r in results if not r["ok"]]
    return {
        "sequences": results,
        "failed_seeds": failed,
        "ok": not failed,
        "fault": options.drill.fault,
        "wall_s": round(time.monotonic() - started, 3),
    }


def _op_word(op: Mapping[str, Any]) -> str:
    """An operation as the report shows it: ``checkpoint!`` is one the controller blocks."""
    return str(op["op"]) + ("!" if "block" in op else "")
