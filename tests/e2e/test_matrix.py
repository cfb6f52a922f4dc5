"""The kill -9 matrix: a real SIGKILL at named boundaries, then the run ends exactly once."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path

import pytest

from e2e._drill.matrix import SMALL_MATRIX, full_matrix, parse_cells, run_cell
from e2e._drill.options import DrillOptions
from e2e._drill.oracle import RolloutOutcome
from participants import KILL_BOUNDARIES


def test_the_full_matrix_kills_every_process_at_every_boundary_it_reaches() -> None:
    cells = full_matrix()
    assert len(cells) == len(set(cells)) == 30
    assert {killed for killed, _ in cells} == {
        "controller",
        "environment",
        "policy",
        "agent",
        "resources",
    }
    assert {boundary for _, boundary in cells} == set(KILL_BOUNDARIES)
    assert ("controller", "records-written") not in cells
    assert ("agent", "checkpoint-json-written") not in cells
    assert parse_cells("small") == list(SMALL_MATRIX)
    assert parse_cells("agent:prepare-sent, controller:retire-partly-applied") == [
        ("agent", "prepare-sent"),
        ("controller", "retire-partly-applied"),
    ]


@pytest.mark.parametrize("spec", ["agent:checkpoint-json-written", "worker:prepare-sent", "x"])
def test_a_cell_no_process_reaches_is_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="no process reaches"):
        parse_cells(spec)


def _matrix(
    tmp_path: Path, spec: str, *extra: str, timeout: float = 900
) -> tuple[int, dict[str, object]]:
    completed = subprocess.run(
        [sys.executable, "-m", "e2e", "drill", "--matrix", spec, "--json",
         "--keep-dir", str(tmp_path), "--rollouts", "4", *extra],
        capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    assert completed.stdout.strip(), completed.stderr[-3000:]
    return completed.returncode, json.loads(completed.stdout.strip().splitlines()[-1])


@pytest.mark.process
def test_the_small_matrix_is_green(tmp_path: Path) -> None:
    code, report = _matrix(tmp_path, "small", "--matrix-jobs", "3")
    cells = report["cells"]
    assert isinstance(cells, list)
    assert [(c["killed"], c["boundary"]) for c in cells] == list(SMALL_MATRIX)
    assert all(c["ok"] for c in cells), cells
    assert code == 0


@pytest.mark.process
def test_latest_before_manifest_turns_the_latest_boundary_cell_red(tmp_path: Path) -> None:
    # The baseline only judges token and reward figures; this cell is red before them.
    no_baseline: Future[dict[str, RolloutOutcome]] = Future()
    no_baseline.set_result({})
    cell = run_cell(
        tmp_path,
        DrillOptions(rollouts=4, restart_only_share=0.0, fault="latest-before-manifest"),
        "controller",
        "checkpoint-json-written",
        baseline=no_baseline,
        token="matrix-test-token",
        on_line=lambda _line: None,
    )
    assert not cell.ok
    # Which checkpoints these are depends on the commits abandoned for want of a cut (D232,
    # D360), so on timing: a loaded machine once gave ckpt-0-2 and ckpt-0-0.
    found = re.search(
        r"restored ckpt-0-(\d+), the last fully published was ckpt-0-(\d+)", cell.detail
    )
    assert found, cell.detail
    restored, published = (int(index) for index in found.groups())
    assert restored > published, cell.detail  # LATEST named one whose manifest never came


@pytest.mark.process
@pytest.mark.soak
@pytest.mark.timeout(3600)  # thirty cells, each a short drill with one kill and a restore
def test_the_full_matrix_is_green(tmp_path: Path) -> None:
    code, report = _matrix(tmp_path, "full", "--matrix-jobs", "2", timeout=3000)
    cells = report["cells"]
    assert isinstance(cells, list) and len(cells) == 30
    assert [c for c in cells if not c["ok"]] == []
    assert code == 0
