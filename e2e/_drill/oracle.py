"""The drill's figures, computed only from evidence that survives SIGKILL.

Inputs: the driver's evidence (dispatches, accepted results with their ledger manifests, checkpoints,
restores, crashes, stale probes, the final state), the policy server's egress evidence, the
published checkpoints and the worker's staging store. Never an in-memory counter.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from protocols import EpisodeId

from .._servers.evidence import read_evidence
from .continuations import ContinuedCall, continued_calls, cut_continuations, prefix_mismatches
from .store import delivered_rows, published_checkpoints
from .tokens_of import TokenSequenceError, token_sequence

ERROR_FIGURES: Final = (
    "lost",
    "token_mismatches",
    "reward_mismatches",
    "repeated_model_calls",
    "stale_accepted",
    "extra_tokens_generated",
    "prefix_mismatches",
    "leftover",
    "ray_left_running",
)
"""Any of these non-zero fails the drill (``ray_left_running``: processes of the drill's Ray
head that outlived it, on ``--on ray`` only)."""
MIN_CHECKPOINTS: Final = 3
MIN_CRASHES: Final = 2
"""Fewer published checkpoints or crashes than this, and a run proves too little (contract §6)."""


@dataclass(frozen=True)
class RolloutOutcome:
    """What one rollout finally produced."""

    reward: float | None
    tokens: list[int] | None
    model_calls: int


def rollout_outcomes(root: Path) -> dict[str, RolloutOutcome]:
    """The accepted final result of every rollout of a run, with its rebuilt token sequence."""
    events = read_evidence(root / "evidence" / "driver.jsonl")
    final = next((e for e in reversed(events) if e.get("event") == "final"), None)
    accepted: Mapping[str, Any] = final["accepted"] if final else {}
    results = {(e["rollout"], e["attempt"]): e for e in events if e.get("event") == "result"}
    outcomes: dict[str, RolloutOutcome] = {}
    for rollout, choice in accepted.items():
        result = results.get((rollout, choice["attempt"]))
        if result is None:
            continue
        records = result.get("manifest", {}).get("records", [])
        try:
            tokens: list[int] | None = token_sequence(records, root / "staging")
        except TokenSequenceError:
            tokens = None
        outcomes[rollout] = RolloutOutcome(
            reward=result.get("reward"), tokens=tokens, model_calls=len(records)
        )
    return outcomes


def _delivered_at(
    checkpoint_dir: Path | str, egress_by_call: Mapping[str, Mapping[str, Any]]
) -> set[tuple[str, str]]:
    """(rollout, request digest) of every call the checkpoint's model records list as delivered."""
    delivered: set[tuple[str, str]] = set()
    for rollout, row in delivered_rows(checkpoint_dir):
        egress = egress_by_call.get(row.get("model_call_id", ""))
        if egress is not None:
            delivered.add((rollout, egress["request_digest"]))
    return delivered


def restored_cuts(checkpoint_dir: Path | str) -> dict[str, int]:
    """Target capture key → generated tokens of the durable cut a restore hands to it."""
    return {
        target: int(continuation["prefix_token_count"])
        for target, continuation in cut_continuations(checkpoint_dir)
    }


def extra_tokens_generated(
    restores: Sequence[Mapping[str, Any]], worker: Sequence[Mapping[str, Any]]
) -> int:
    """Tokens generated again at positions a restored durable cut already covered.

    The re-issued call of a cut episode is the first call of the restored attempt (the cut call
    was undelivered, so the agent stood just before it). Its worker evidence says which positions
    it took from the cut (``tokens_continued``) and which it generated (``tokens_generated``
    after them); the overlap of the generated positions with the cut's prefix is waste.
    """
    extra = 0
    for restore in restores:
        for target, prefix in restored_cuts(restore["checkpoint_dir"]).items():
            if target not in restore.get("restored", []):
                continue  # nothing was restored (a rerun from input): no cut was handed over
            first = next(
                (
                    e
                    for e in worker
                    if e.get("event") == "generation"
                    and e.get("capture_key") == target
                    and e.get("at", 0.0) > restore["t"]
                ),
                None,
            )
            if first is None:
                continue
            start = int(first.get("tokens_continued", 0))
            end = start + int(first.get("tokens_generated", 0))
            extra += max(0, min(prefix, end) - start)
    return extra


@dataclass
class Figures:
    """Every figure the drill reports (e2e-contract §6)."""

    values: dict[str, Any] = field(default_factory=dict)

    def failed_checks(self, *, require_cuts: bool = False) -> list[str]:
        """Why the run fails: error figures, or too little activity to prove anything."""
        v = self.values
        reasons = [f"{name} = {v[name]}" for name in ERROR_FIGURES if v.get(name)]
        if v.get("redecode_must_match") and v.get("continuation_redecode_mismatches"):
            reasons.append(
                f"continuation_redecode_mismatches = {v['continuation_redecode_mismatches']}"
            )
        if v["checkpoints"] < MIN_CHECKPOINTS:
            reasons.append(f"only {v['checkpoints']} checkpoints (need {MIN_CHECKPOINTS})")
        if v["crashes"] < MIN_CRASHES:
            reasons.append(f"only {v['crashes']} crashes (need {MIN_CRASHES})")
        killed = v.get("ray_processes_killed")
        if v.get("on") == "ray" and (killed is None or len(killed) < v["crashes"] or 0 in killed):
            reasons.append(f"a crash on Ray killed no process (killed per crash: {killed})")
        # A crash must bring rollouts back: restored, or (restart-only resources) run again.
        restarted = v.get("restarted_per_crash") or [0] * len(v["restored_per_crash"])
        per_crash = zip(v["restored_per_crash"], restarted, strict=False)
        if idle := [str(i) for i, (n, r) in enumerate(per_crash, 1) if n + r == 0]:
            reasons.append(f"a crash restored nothing (crash {', '.join(idle)} of {v['crashes']})")
        # Repeats are checked against the calls a restored checkpoint had delivered: none, no proof.
        if v["restored"] and v["restored_delivered"] < 1:
            reasons.append("no restored checkpoint recorded a delivered call")
        if v["held_delivered"] < 1:
            reasons.append("no response was held through a checkpoint")
        if v["crashes"] and min(v["stale_probes_per_crash"] or [0]) < 4:
            reasons.append("fewer than 4 stale probes after a crash")
        # Only a restored episode can continue a cut: a run of restart-only rollouts has none.
        if require_cuts and v["restored"] and v["cut_continued"] < 1:
            reasons.append("no continued generation cut")
        return reasons


@dataclass(frozen=True)
class RerunWindow:
    """An attempt the controller ran again from its input, and while that incarnation lasted.

    The window runs from the attempt's dispatch to the next crash or restore: after one, the same
    capture key may come back as a restored continuation, whose repeats count again.
    """

    capture_key: str
    start: float
    end: float

    def covers(self, capture_key: str, t: float) -> bool:
        """Whether an execution of ``capture_key`` at ``t`` belongs to this rerun."""
        return capture_key == self.capture_key and self.start <= t < self.end


def reruns_from_input(driver: Sequence[Mapping[str, Any]]) -> list[RerunWindow]:
    """The attempts the controller dispatched right after retiring the attempt before them.

    Two controller choices do that: retiring the stragglers of a blocked prepare (control-plane
    §3.4.1, ``prepare_blocked``) and retiring an attempt of its own accord (a sequence's
    ``retire``). The next attempt starts over from its input, so its model calls repeat the
    retired attempt's by design: they are not the repeats the drill hunts (a continued rollout
    calling the model again, D209 revised by D219).
    """
    cuts = sorted(e["t"] for e in driver if e.get("event") in ("crash", "restore"))
    retired: set[str] = set()
    windows: list[RerunWindow] = []
    for event in driver:
        name = event.get("event")
        if name in ("crash", "restore"):
            retired.clear()  # a later dispatch of the same key may be a restored continuation
        elif name == "prepare_blocked":
            retired.update(event.get("blockers", []))
        elif name == "retire" and "key" in event:
            retired.add(event["key"])
        elif name == "dispatch" and event["attempt"] > 0:
            before = EpisodeId(rollout_id=event["rollout"], attempt=event["attempt"] - 1)
            if before.capture_key in retired:
                key = EpisodeId(rollout_id=event["rollout"], attempt=event["attempt"]).capture_key
                end = next((t for t in cuts if t > event["t"]), float("inf"))
                windows.append(RerunWindow(key, event["t"], end))
    return windows


@dataclass(frozen=True)
class RepeatedCalls:
    """Executions after a restore of calls the restored checkpoint had delivered."""

    repeated: int
    """Repeats of a continued rollout: each one fails the drill."""
    by_rerun: int
    """Repeats made by a rerun from input the controller chose: reported, not a failure."""
    delivered: int = 0
    """Calls the restored checkpoints recorded as delivered (summed over the restores): what
    could have been repeated. With none, a run shows nothing about repeats."""


def repeated_model_calls(
    driver: Sequence[Mapping[str, Any]], policy: Sequence[Mapping[str, Any]]
) -> RepeatedCalls:
    """Count the model calls executed again after a restore (admit or egress, once each)."""
    egress_by_call = {e["model_call_id"]: e for e in policy if e.get("event") == "egress"}
    delivered = [
        _delivered_at(restore["checkpoint_dir"], egress_by_call)
        for restore in driver
        if restore.get("event") == "restore"
    ]
    return count_repeats(driver, policy, delivered)


def count_repeats(
    driver: Sequence[Mapping[str, Any]],
    policy: Sequence[Mapping[str, Any]],
    delivered: Sequence[set[tuple[str, str]]],
) -> RepeatedCalls:
    """Count repeats, given (rollout, request digest) delivered at each restore, in order.

    An execution after restore *i* of a call that restore's checkpoint had delivered is a repeat,
    unless the rollout ran again from its input in between: a rerun (its own window, D219) starts
    a lineage that owes nothing to restore *i*, so what descends from it — a later checkpoint of
    the rerun, restored — may make those calls once more (D219).
    """
    executions = [e for e in policy if e.get("event") in ("admit", "egress")]
    windows = reruns_from_input(driver)
    rerun_starts: dict[str, list[float]] = {}
    for window in windows:
        rollout = EpisodeId.from_capture_key(window.capture_key).rollout_id
        rerun_starts.setdefault(rollout, []).append(window.start)
    restores = [e for e in driver if e.get("event") == "restore"]
    repeated: set[tuple[str, str, float]] = set()
    by_rerun: set[tuple[str, str, float]] = set()
    for restore, delivered_then in zip(restores, delivered, strict=True):
        for event in executions:
            rollout = EpisodeId.from_capture_key(event["capture_key"]).rollout_id
            t = event["t"]
            if t <= restore["t"] or (rollout, event["request_digest"]) not in delivered_then:
                continue
            found = (rollout, event["request_digest"], t)
            if any(w.covers(event["capture_key"], t) for w in windows):
                by_rerun.add(found)
            elif any(restore["t"] < start < t for start in rerun_starts.get(rollout, [])):
                by_rerun.add(found)  # descends from a rerun since that restore, not from it
            else:
                repeated.add(found)
    return RepeatedCalls(
        repeated=len(repeated),
        by_rerun=len(by_rerun - repeated),
        delivered=sum(len(calls) for calls in delivered),
    )


def calls_by_incarnation(
    driver: Sequence[Mapping[str, Any]], policy: Sequence[Mapping[str, Any]]
) -> dict[str, list[int]]:
    """Capture key → model calls admitted in each incarnation of the deployment.

    Incarnation *i* runs from restore *i* (0: the start) to the next one. A restore of a checkpoint
    older than the last crash's brings back capture keys that already ran after that checkpoint
    (their later files are wiped, policy-model §2.7 ``import_rows_many``), so one key may call
    the model in several incarnations; within each it never needs more than its episode does.
    """
    restores = sorted(e["t"] for e in driver if e.get("event") == "restore")
    counts: dict[str, list[int]] = {}
    for event in policy:
        if event.get("event") != "admit":
            continue
        incarnation = sum(1 for t in restores if t < event["t"])
        row = counts.setdefault(event["capture_key"], [0] * (len(restores) + 1))
        row[incarnation] += 1
    return counts


def compute_figures(
    run_root: Path,
    baseline: Mapping[str, RolloutOutcome],
    *,
    rollouts: int,
    continued: Sequence[ContinuedCall] | None = None,
    checkpoints_at: Path | str | None = None,
) -> Figures:
    """Every figure of one drill run against its baseline.

    Args:
        continued: The run's continued calls when the caller already rebuilt them
            (:func:`continued_calls`, which reads the staging store); rebuilt here otherwise.
        checkpoints_at: The run's checkpoint root when it is not the run directory (S3).
    """
    driver = read_evidence(run_root / "evidence" / "driver.jsonl")
    policy = read_evidence(run_root / "evidence" / "policy.jsonl")
    worker = read_evidence(run_root / "evidence" / "worker.jsonl")
    outcomes = rollout_outcomes(run_root)
    egress = [e for e in policy if e.get("event") == "egress"]
    executions = [e for e in policy if e.get("event") in ("admit", "egress")]

    repeated = repeated_model_calls(driver, policy)
    redone = 0
    restores = [e for e in driver if e.get("event") == "restore"]
    crashes = [e for e in driver if e.get("event") == "crash"]
    for restore in restores:
        published = restore.get("checkpoint_t", 0.0)
        crash_t = max((c["t"] for c in crashes if c["t"] < restore["t"]), default=restore["t"])
        after = {
            (EpisodeId.from_capture_key(e["capture_key"]).rollout_id, e["request_digest"])
            for e in executions
            if e["t"] > restore["t"]
        }
        redone += sum(
            1
            for e in egress
            if published < e["t"] < crash_t
            and (EpisodeId.from_capture_key(e["capture_key"]).rollout_id, e["request_digest"])
            in after
        )

    probes = [e for e in driver if e.get("event") == "stale_probe"]
    probes_per_crash: dict[int, int] = defaultdict(int)
    for probe in probes:
        probes_per_crash[probe.get("crash", 0)] += 1
    final: dict[str, Any] = next((e for e in reversed(driver) if e.get("event") == "final"), {})
    leftover_detail = final.get("leftover", {"driver": "did not finish"})
    leftover = sum(int(v) for v in leftover_detail.values() if isinstance(v, int | bool)) + (
        0 if final else 1
    )
    published = published_checkpoints(run_root if checkpoints_at is None else checkpoints_at)
    token_mismatches = sum(
        1
        for rollout, outcome in outcomes.items()
        if rollout in baseline
        and (outcome.tokens is None or outcome.tokens != baseline[rollout].tokens)
    )
    reward_mismatches = sum(
        1
        for rollout, outcome in outcomes.items()
        if rollout in baseline and outcome.reward != baseline[rollout].reward
    )
    values: dict[str, Any] = {
        "rollouts": rollouts,
        "completed": len(outcomes),
        "checkpoints": len(published),
        "crashes": len(crashes),
        "restored": sum(len(r.get("restored", [])) for r in restores),
        "restored_per_crash": [len(r.get("restored", [])) for r in restores],
        "restarted": sum(len(e["rollouts"]) for e in driver if e.get("event") == "restarted"),
        "restarted_per_crash": [
            len(e["rollouts"]) for e in driver if e.get("event") == "restarted"
        ],
        "lost": rollouts - len(outcomes),
        "token_mismatches": token_mismatches,
        "reward_mismatches": reward_mismatches,
        "repeated_model_calls": repeated.repeated,
        "rerun_model_calls": repeated.by_rerun,
        "redone_model_calls": redone,
        "restored_delivered": repeated.delivered,
        "held_delivered": sum(1 for e in egress if e.get("held")),
        "cut_continued": sum(1 for e in worker if e.get("tokens_continued", 0) > 0),
        "extra_tokens_generated": extra_tokens_generated(restores, worker),
        "prefix_mismatches": prefix_mismatches(
            continued if continued is not None else continued_calls(run_root)
        ),
        "commits_retried": sum(1 for e in driver if e.get("event") == "commit_retried"),
        "stale_probes": len(probes),
        "stale_probes_per_crash": [probes_per_crash[i] for i in range(1, len(crashes) + 1)],
        "stale_accepted": sum(1 for p in probes if p.get("accepted")),
        "leftover": leftover,
        "leftover_detail": leftover_detail,
    }
    return Figures(values)


def dump_figures(figures: Figures) -> str:
    """The figures as one JSON object."""
    return json.dumps(figures.values, sort_keys=True)
