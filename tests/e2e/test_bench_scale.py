"""``midflight bench scale`` on a tiny ladder: every rung carried through, and what limited it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from e2e import build_app

runner = CliRunner()


def test_bench_scale_climbs_until_the_budget_and_names_the_limit(tmp_path: Path) -> None:
    result = runner.invoke(
        build_app(),
        # The budget fits the first rungs; the last one would need hours, so it is not tried.
        [
            "bench",
            "scale",
            "--ladder",
            "2,4,1000000",
            "--budget",
            "60",
            "--json",
            "--dir",
            str(tmp_path),
            "--out",
            str(tmp_path / "results"),
        ],
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert [rung["rollouts"] for rung in payload["rungs"]] == [2, 4, 1000000]
    # The picture draws the rungs carried; the one not tried is named in its title.
    picture = tmp_path / "results" / "scale.png"
    assert payload["written"][-1] == str(picture)
    assert picture.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    *run, skipped = payload["rungs"]
    for rung in run:
        assert rung["parked"] == rung["restored"] == rung["finished"] == rung["rollouts"]
        assert rung["lost"] == 0
    # The size not tried still has its row, naming what ran out.
    assert skipped["resource"] == "time" and skipped["skipped"].startswith("time budget")
    assert payload["limited_resource"] == "time"
    assert payload["largest_clean"] == 4
    small, large = run
    assert large["us_per_rollout"] == round(large["restore_s"] / 4 * 1e6, 1)
    assert large["wall_us_per_rollout"] == round(large["wall_s"] / 4 * 1e6, 1)
    assert [(s["figure"], s["from"], s["to"]) for s in payload["slopes"]] == [
        ("restore_s", 2, 4),
        ("wall_s", 2, 4),
    ]
    assert small["slope_us_per_added_rollout"] is None
    assert large["slope_us_per_added_rollout"] == payload["slopes"][0]["us_per_added_rollout"]
    assert payload["limited_by"].startswith("time budget: 1000000 rollouts")


def test_a_rung_that_would_not_fit_in_memory_is_reported_not_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("e2e._bench.scale.available_memory_mb", lambda: 1.0)
    result = runner.invoke(
        build_app(),
        ["bench", "scale", "--ladder", "2,50,200", "--json", "--dir", str(tmp_path)],
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    first, memory, later = payload["rungs"]
    assert first["rollouts"] == 2 and first["lost"] == 0
    assert memory == {
        "rollouts": 50,
        "skipped": memory["skipped"],
        "resource": "memory",
    } and memory["skipped"].startswith("memory: 50 rollouts would need about")
    assert later == {"rollouts": 200, "skipped": "not tried: the climb stopped at 50"}
    assert payload["limited_resource"] == "memory" and payload["largest_clean"] == 2
