"""``midflight bench scale`` on a tiny ladder: every rung carried through, and what limited it."""

from __future__ import annotations

import json
from pathlib import Path

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
        ],
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert [rung["rollouts"] for rung in payload["rungs"]] == [2, 4]
    for rung in payload["rungs"]:
        assert rung["parked"] == rung["restored"] == rung["finished"] == rung["rollouts"]
        assert rung["lost"] == 0
    assert payload["largest_clean"] == 4
    small, large = payload["rungs"]
    assert large["us_per_rollout"] == round(large["restore_s"] / 4 * 1e6, 1)
    assert large["wall_us_per_rollout"] == round(large["wall_s"] / 4 * 1e6, 1)
    assert [(s["figure"], s["from"], s["to"]) for s in payload["slopes"]] == [
        ("restore_s", 2, 4),
        ("wall_s", 2, 4),
    ]
    assert small["slope_us_per_added_rollout"] is None
    assert large["slope_us_per_added_rollout"] == payload["slopes"][0]["us_per_added_rollout"]
    assert payload["limited_by"].startswith("time budget: 1000000 rollouts")
