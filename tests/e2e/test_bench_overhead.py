"""``midflight bench overhead`` with short windows: the JSON fields and every mode measured."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from e2e import build_app

runner = CliRunner()


def test_bench_overhead_reports_each_mode_against_the_disabled_floor(tmp_path: Path) -> None:
    result = runner.invoke(
        build_app(),
        [
            "bench",
            "overhead",
            "--seconds",
            # Long enough that a rollout finishes inside each window on a loaded 2-core machine
            # (at 1.5 s a window once counted none while other suites ran).
            "4",
            "--rounds",
            "1",
            "--concurrency",
            "4",
            "--period",
            "1",
            "--json",
            "--dir",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    for name in ("disabled_per_s", "idle_per_s", "periodic_per_s"):
        assert payload[name] > 0
    for name in ("idle_overhead_pct", "periodic_overhead_pct"):
        assert isinstance(payload[name], float)
    assert payload["checkpoints"] >= 1  # the periodic mode did checkpoint
    modes = [window["mode"] for window in payload["windows"]]
    assert modes == ["disabled", "idle", "periodic"]
    assert [w["checkpoints"] > 0 for w in payload["windows"]] == [False, False, True]
