"""``midflight bench checkpoint`` at a tiny size: the JSON shape, the floor, the plot."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from e2e import build_app
from e2e._bench.checkpoint import boundary_wait

runner = CliRunner()
ROW_FIELDS = {
    "rollouts",
    "pause_s",
    "overhead_s",
    "floor_s",
    "ratio",
    "cut_failed",
    "us_per_rollout",
}


def test_boundary_wait_adds_the_longest_wait_of_each_stage() -> None:
    kinds = {"env": "environment", "policy": "model", "a1": "agent", "a2": "agent"}
    waits = {"env": 0.5, "policy": 0.25, "a1": 1.0, "a2": 2.0}
    # Stages run one after another; the members of a stage wait at the same time.
    assert boundary_wait(waits, kinds) == 0.5 + 0.25 + 2.0


def test_bench_checkpoint_parks_every_rollout_and_reports_a_ratio(tmp_path: Path) -> None:
    out = tmp_path / "out"
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    result = runner.invoke(
        build_app(),
        [
            "bench",
            "checkpoint",
            "--sizes",
            "2,4",
            "--repeats",
            "2",
            "--token-delay-ms",
            "100",
            "--json",
            "--dir",
            str(scratch),
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert "in-process" in payload["parking"] and "fsync" in payload["floor"]
    assert len(payload["loadavg"]) == len(payload["loadavg_end"]) == 3  # its load, start and end
    assert [row["rollouts"] for row in payload["rows"]] == [2, 4]
    for row in payload["rows"]:
        assert set(row) >= ROW_FIELDS
        assert row["parked"] == row["rollouts"]  # nothing finished or went missing
        assert row["floor_s"] > 0 and row["ratio"] > 0
        assert row["pause_s"] >= row["overhead_s"] > 0
        # Every repeat cut every parked generation in one staging segment, and the floor wrote
        # that segment too.
        assert row["cut"] == row["rollouts"] and row["cut_failed"] == 0
        assert row["cut_files"] == [1, 1]
        assert row["files"] == 10 + 1
        assert row["us_per_rollout"] == round(row["overhead_s"] / row["rollouts"] * 1e6, 1)
    # The growth between the sizes (D348): the overhead's slope and the pause's.
    small, large = payload["rows"]
    assert small["slope_us_per_added_rollout"] is None
    expected = round((large["overhead_s"] - small["overhead_s"]) / 2 * 1e6, 1)
    assert large["slope_us_per_added_rollout"] == expected
    assert [(s["figure"], s["from"], s["to"]) for s in payload["slopes"]] == [
        ("overhead_s", 2, 4),
        ("pause_s", 2, 4),
    ]
    assert json.loads((out / "checkpoint.json").read_text())["rows"] == payload["rows"]
    assert (out / "checkpoint.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert list(scratch.iterdir()) == []  # the scratch directory is removed


def test_bench_checkpoint_prints_the_slope_between_sizes(tmp_path: Path) -> None:
    args = ["bench", "checkpoint", "--sizes", "1,2", "--repeats", "1", "--token-delay-ms", "100"]
    result = runner.invoke(build_app(), [*args, "--dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "slope of overhead_s from 1 to 2 rollouts" in result.stdout
    assert "slope of pause_s from 1 to 2 rollouts" in result.stdout
