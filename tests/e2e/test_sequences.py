"""Random operation sequences on real processes (``midflight drill --sequences``).

A sequence seed is a plan of operations the sequence driver executes on a fresh reference
deployment, checking control-plane §8.1 after each; the end-of-run rules (rewards and tokens as in
the baseline, calls within the episode's need, nothing left, every checkpoint verifies) decide.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from e2e._drill.oracle import calls_by_incarnation
from e2e._sequences.cases import NAMED_CASES
from e2e._sequences.suite import OPERATION_WEIGHTS, plan_sequence
from e2e._servers.evidence import read_evidence

pytestmark = pytest.mark.process

FAST_SEED = 5
"""Its plan starts rollouts, crashes after a checkpoint and retires a restored attempt."""


def _sequences(tmp_path: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    completed = subprocess.run(
        [sys.executable, "-m", "e2e", "drill", "--json", "--keep-dir", str(tmp_path), *extra],
        capture_output=True,
        text=True,
        timeout=4 * 3600,
        check=False,
    )
    assert completed.stdout.strip(), completed.stderr[-3000:]
    return completed.returncode, json.loads(completed.stdout.strip().splitlines()[-1])


def test_a_sequence_plan_is_reproducible_and_bounded() -> None:
    plans = [plan_sequence(seed, 8, 2) for seed in range(50)]
    assert plans == [plan_sequence(seed, 8, 2) for seed in range(50)]
    assert all(len(p) == 8 and p[0]["op"] == "start" for p in plans)
    assert all(sum(op["op"] == "crash" for op in p) <= 2 for p in plans)
    assert {op["op"] for p in plans for op in p} == set(OPERATION_WEIGHTS)
    blocked = [op for p in plans for op in p if "block" in op]
    assert blocked and {op["op"] for op in blocked} <= {"checkpoint", "crash"}
    assert all(0 <= op["block"] < 1 for op in blocked)


def test_the_block_marks_leave_the_operations_a_seed_draws_unchanged() -> None:
    # Seed 22 is the issue-18 plan: its operations are those the issue quotes.
    ops = [op["op"] for op in plan_sequence(22, 30, 2)]
    assert ops == [op["op"] for op in NAMED_CASES["blocked-after-restore"]]


@pytest.mark.timeout(300)
def test_a_checkpoint_blocked_right_after_a_restore_then_a_crash_keeps_exactly_once(
    tmp_path: Path,
) -> None:
    """Issue 18, forced: seed 22's plan with the second crash's prepare blocked by r000-a2.

    The controller reruns r000-a3 from input (its calls repeat r000-a1's by design), then the
    crash restores the first checkpoint again, so r001-a1 … r006-a1 call the model in two
    incarnations. An oracle counting either as a repeat reports a false failure (it did).
    """
    code, report = _sequences(tmp_path, "--sequence-case", "blocked-after-restore")
    (row,) = report["sequences"]
    assert row["failures"] == [] and code == 0, row
    blocked = [c for c in row["checkpoint_outcomes"] if c["outcome"] == "blocked"]
    assert blocked == [
        {"step": 5, "id": "ckpt-1-0", "outcome": "blocked", "blockers": ["r000-a2"], "forced": True}
    ]
    assert row["crashes"] == 2 and row["rerun_model_calls"] > 0, row
    root = tmp_path / "seq-0"
    driver = read_evidence(root / "evidence" / "driver.jsonl")
    restores = [e for e in driver if e["event"] == "restore"]
    assert [r["checkpoint_id"] for r in restores] == ["ckpt-0-0", "ckpt-0-0"]
    calls = calls_by_incarnation(driver, read_evidence(root / "evidence" / "policy.jsonl"))
    twice = [key for key, counts in calls.items() if counts[1] and counts[2]]
    assert twice, calls  # restored keys that ran in both incarnations after a restore


@pytest.mark.timeout(300)  # three cluster starts (baseline, run, restart) on a loaded 2-core box
def test_one_sequence_with_a_crash_and_a_retire_keeps_every_invariant(tmp_path: Path) -> None:
    ops = [op["op"] for op in plan_sequence(FAST_SEED, 6, 1)]
    assert "crash" in ops and "retire" in ops
    code, report = _sequences(
        tmp_path,
        "--sequences", "1", "--seed", str(FAST_SEED), "--rollouts", "3",
        "--sequence-length", "6", "--sequence-crashes", "1",
    )  # fmt: skip
    (row,) = report["sequences"]
    assert row["failures"] == [] and report["failed_seeds"] == [], report
    assert code == 0
    assert row["crashes"] == 1 and row["checkpoints"] >= 1 and row["retires"] >= 1, row
    events = [
        json.loads(line)
        for line in (tmp_path / f"seq-{FAST_SEED}" / "evidence" / "driver.jsonl")
        .read_text()
        .splitlines()
    ]
    steps = [e["index"] for e in events if e["event"] == "step"]
    assert steps == list(range(len(ops))), steps  # every operation ran, each checked once
    probes = [e for e in events if e["event"] == "stale_probe" and e.get("after") == "retire"]
    assert {p["kind"] for p in probes} == {"environment", "agent", "resources", "model"}
    assert {p["code"] for p in probes} == {"stale_attempt"}


@pytest.mark.soak
@pytest.mark.timeout(1800)
def test_sequences_at_the_reference_size_keep_every_invariant(tmp_path: Path) -> None:
    # The reference's suite: 4 seeds of 30 operations over 10 rollouts (the CLI's defaults).
    code, report = _sequences(tmp_path, "--sequences", "4", "--seed", "21")
    assert report["failed_seeds"] == [], report
    assert code == 0
    assert all(len(row["ops"]) == 30 for row in report["sequences"])


@pytest.mark.soak
@pytest.mark.timeout(4 * 3600)
def test_two_hundred_sequences_at_the_reference_size_keep_every_invariant(tmp_path: Path) -> None:
    code, report = _sequences(tmp_path, "--sequences", "200", "--seed", "100")
    assert report["failed_seeds"] == [], [r for r in report["sequences"] if not r["ok"]]
    assert code == 0


@pytest.mark.soak
@pytest.mark.timeout(300)
def test_a_missing_restore_fence_fails_the_sequence_and_names_its_seed(tmp_path: Path) -> None:
    code, report = _sequences(
        tmp_path,
        "--sequences", "1", "--seed", str(FAST_SEED), "--rollouts", "3",
        "--sequence-length", "6", "--sequence-crashes", "1", "--fault", "no-restore-fence",
    )  # fmt: skip
    assert code == 1 and report["failed_seeds"] == [FAST_SEED], report
    assert any(
        "retire_refuses" in f or "stale_accepted" in f for f in report["sequences"][0]["failures"]
    )
