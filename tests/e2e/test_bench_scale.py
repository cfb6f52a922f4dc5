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
    assert payload["limited_by"].startswith("time budget: 1000000 rollouts")
