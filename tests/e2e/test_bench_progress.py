"""What a long bench shows while it runs: each suite's stages, drawn on stderr, never with --json."""

from __future__ import annotations

import io
import re
from dataclasses import replace
from pathlib import Path

import anyio
from rich.console import Console
from typer.testing import CliRunner

from e2e import build_app
from e2e._bench.checkpoint import PARKED_WORKLOAD, run_checkpoint_bench
from e2e._bench.common import reporting_stages, stage
from e2e._bench.restore import crash_restore_cycle, run_restore_bench
from e2e._cli.bench_progress import BenchProgress

runner = CliRunner()


def test_a_restore_bench_says_each_stage_of_each_size(tmp_path: Path) -> None:
    said: list[str] = []
    with reporting_stages(said.append):
        run_restore_bench(tmp_path, sizes=[2, 3])
    assert said == [
        f"{n} rollouts · {what}"
        for n in (2, 3)
        for what in (
            "parking",
            "checkpoint before the crash",
            "restoring",
            "retiring the attempts it did not continue (1)",
            "floor",
        )
    ]


def test_a_crash_restore_cycle_that_finishes_says_so(tmp_path: Path) -> None:
    said: list[str] = []
    with reporting_stages(said.append):
        anyio.run(lambda: crash_restore_cycle(tmp_path, 2, finish=True))
    assert "2 rollouts · finishing every restored rollout" in said
    assert said.index("2 rollouts · restoring") < said.index("2 rollouts · floor")


def test_a_checkpoint_bench_says_each_repeat_and_its_wait(tmp_path: Path) -> None:
    said: list[str] = []
    fast = replace(PARKED_WORKLOAD, token_delay_ms=100.0)
    with reporting_stages(said.append):
        run_checkpoint_bench(tmp_path, sizes=[2], repeats=2, workload=fast)
    waiting = "waiting for a new token on every call"
    assert said == [
        "2 rollouts · parking",
        f"2 rollouts · checkpoint 1 of 2: {waiting}",
        "2 rollouts · checkpoint 1 of 2",
        "2 rollouts · floor 1 of 2",
        f"2 rollouts · checkpoint 2 of 2: {waiting}",
        "2 rollouts · checkpoint 2 of 2",
        "2 rollouts · floor 2 of 2",
    ]


def test_no_one_hears_a_stage_outside_a_reporting_block() -> None:
    said: list[str] = []
    with reporting_stages(said.append):
        stage("inside")
    stage("outside")
    assert said == ["inside"]


def test_away_from_a_terminal_each_stage_is_a_line_with_the_time_since_the_start() -> None:
    out = io.StringIO()
    with BenchProgress(Console(file=out, width=40, force_terminal=False), "scale") as progress:
        progress.on_stage("16,000 rollouts · restoring [fast]")
    # One line, however narrow the console, and the markup-like text kept as written.
    assert out.getvalue() == "bench scale · 0:00 · 16,000 rollouts · restoring [fast]\n"


def test_on_a_terminal_the_stage_is_one_live_line_stopped_at_the_end() -> None:
    out = io.StringIO()
    with BenchProgress(Console(file=out, width=100, force_terminal=True), "restore") as progress:
        assert progress.progress.live.is_started
        progress.on_stage("4,000 rollouts · parking")
        (task,) = progress.progress.tasks
        assert task.description == "bench restore · 4,000 rollouts · parking"
    assert not progress.progress.live.is_started  # its refresh thread ends with the bench
    assert "bench restore · 0:00 ·" not in out.getvalue()  # no line per stage on a terminal


def test_the_command_shows_its_stages_on_stderr_and_none_with_json(tmp_path: Path) -> None:
    args = ["bench", "restore", "--sizes", "2", "--dir", str(tmp_path)]
    result = runner.invoke(build_app(), args)
    assert result.exit_code == 0, result.output
    shown = re.findall(r"^bench restore · \d+:\d\d · (.*)$", result.stderr, re.MULTILINE)
    stages = (
        "parking",
        "checkpoint before the crash",
        "restoring",
        "retiring the attempts it did not continue (1)",
        "floor",
    )
    assert shown == [f"2 rollouts · {what}" for what in stages]
    assert "bench restore ·" not in result.stdout  # the figures' stream stays clean
    quiet = runner.invoke(build_app(), [*args, "--json"])
    assert quiet.exit_code == 0, quiet.output
    assert "bench restore ·" not in quiet.stderr
