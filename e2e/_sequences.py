"""``midflight drill --sequences N``: random operation sequences over the reference deployment.

A sequence is a plan — a seeded, weighted list of operations (start rollouts, let model calls
finish, checkpoint, checkpoint then crash and restore, retire) — that the sequence driver
(``_sequence_driver.py``) executes on a fresh cluster, checking control-plane §8.1 after each
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
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

from coordinator import verify_checkpoint
from protocols import EpisodeId

from ._drill import DrillOptions, DriverProcess, run_cluster
from ._evidence import EvidenceLog, read_evidence
from ._oracle import ERROR_FIGURES, RolloutOutcome, compute_figures, rollout_outcomes
from ._oracle import _delivered_at as delivered_at
from ._supervisor import Supervisor, SupervisorOptions

OPERATION_WEIGHTS: Final[Mapping[str, int]] = {
    "start": 4,
    "finish": 2,
    "checkpoint": 3,
    "crash": 2,
    "retire": 1,
}
"""How often each operation is drawn (weights of ``random.choices``)."""


@dataclass(frozen=True)
class SequenceOptions:
    """What one ``--sequences`` run does."""

    sequences: int = 1
    seed: int = 0
    length: int = 8
    max_crashes: int = 2
    drill: DrillOptions = field(
        default_factory=lambda: DrillOptions(rollouts=4, restart_only_share=0.0)
    )


def plan_sequence(seed: int, length: int = 8, max_crashes: int = 2) -> list[dict[str, Any]]:
    """The operations of sequence ``seed``: the same seed always gives the same plan.

    The first operation starts rollouts (an empty deployment proves little); at most
    ``max_crashes`` crashes are drawn (an extra one becomes a checkpoint).
    """
    rng = random.Random(seed)  # noqa: S311 - a reproducible plan, not a secret
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
        ops.append(op)
    return ops


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
    ops = plan_sequence(seed, options.length, options.max_crashes)
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


def repeated_calls(root: Path, driver: list[dict[str, Any]]) -> Counter[str]:
    """Rollout → calls executed after a restore that the restored checkpoint had delivered."""
    policy = read_evidence(root / "evidence" / "policy.jsonl")
    egress_by_call = {e["model_call_id"]: e for e in policy if e.get("event") == "egress"}
    executions = [e for e in policy if e.get("event") in ("admit", "egress")]
    repeated: set[tuple[str, str, float]] = set()
    for restore in (e for e in driver if e.get("event") == "restore"):
        delivered = delivered_at(Path(restore["checkpoint_dir"]), egress_by_call)
        for event in executions:
            rollout = EpisodeId.from_capture_key(event["capture_key"]).rollout_id
            if event["t"] > restore["t"] and (rollout, event["request_digest"]) in delivered:
                repeated.add((rollout, event["request_digest"], event["t"]))
    return Counter(rollout for rollout, _, _ in repeated)


def sequence_failures(
    root: Path, baseline: Mapping[str, RolloutOutcome], rollouts: int
) -> tuple[list[str], dict[str, Any]]:
    """Why sequence run ``root`` fails §8.1 (empty when it holds), and its figures."""
    figures = compute_figures(root, baseline, rollouts=rollouts).values
    driver = read_evidence(root / "evidence" / "driver.jsonl")
    # A rollout the controller retired after a restore reruns from its input on purpose: its
    # re-executed calls are the controller's doing (§8.1 item 10), reported, not a failure.
    repeated = repeated_calls(root, driver)
    retired_after = {
        EpisodeId.from_capture_key(r["key"]).rollout_id
        for r in driver
        if r.get("event") == "retire"
        and any(r["t"] > e["t"] for e in driver if e.get("event") == "restore")
    }
    figures["repeated_model_calls"] = sum(n for r, n in repeated.items() if r not in retired_after)
    figures["rerun_by_retire"] = sum(n for r, n in repeated.items() if r in retired_after)
    failures = [f"{name} = {figures[name]}" for name in ERROR_FIGURES if figures.get(name)]
    for event in driver:
        if event.get("event") == "violation":
            failures.append(f"step {event['step']}: {event['rule']}: {event['detail']}")
    needed = {rollout: outcome.model_calls for rollout, outcome in baseline.items()}
    admits = Counter(
        e["capture_key"]
        for e in read_evidence(root / "evidence" / "policy.jsonl")
        if e.get("event") == "admit"
    )
    for key, calls in sorted(admits.items()):
        bound = needed.get(EpisodeId.from_capture_key(key).rollout_id, 0)
        if calls > bound:
            failures.append(f"calls: {key} made {calls} model calls, its episode needs {bound}")
    for directory in sorted((root / "checkpoints").glob("*/checkpoint.json")):
        failures += [f"verify: {p}" for p in verify_checkpoint(directory.parent)]
    figures["violations"] = sum(1 for e in driver if e.get("event") == "violation")
    figures["retires"] = sum(1 for e in driver if e.get("event") == "retire")
    return failures, figures


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
    for seed in range(options.seed, options.seed + options.sequences):
        root = work / f"seq-{seed}"
        try:
            crashes = run_sequence(root, seed, options, token, on_line)
            failures, figures = sequence_failures(root, baseline, options.drill.rollouts)
        except RuntimeError as exc:
            crashes, failures, figures = -1, [f"did not finish: {exc}"], {}
        ok = not failures
        if not ok:
            on_line(f"sequence seed {seed} FAILED: " + "; ".join(failures))
        results.append(
            {
                "seed": seed,
                "ok": ok,
                "ops": [
                    op["op"] for op in plan_sequence(seed, options.length, options.max_crashes)
                ],
                "crashes": crashes,
                "checkpoints": figures.get("checkpoints", 0),
                "retires": figures.get("retires", 0),
                "restored": figures.get("restored", 0),
                "failures": failures,
            }
        )
    failed = [r["seed"] for r in results if not r["ok"]]
    return {
        "sequences": results,
        "failed_seeds": failed,
        "ok": not failed,
        "fault": options.drill.fault,
        "wall_s": round(time.monotonic() - started, 3),
    }
