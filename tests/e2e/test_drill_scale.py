"""The drill at scale: hundreds in flight by default, a phase bounded by its silence rather than
its length, and a stalled phase reported in one line."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from e2e._cli.app import build_app
from e2e._drill.driver_process import DriverProcess
from e2e._drill.run import DrillStalledError, default_concurrency


def test_large_drills_run_a_quarter_of_their_rollouts_at_once() -> None:
    assert [default_concurrency(n) for n in (1, 8, 10, 19, 20, 100, 1000, 5000)] == [
        4, 4, 4, 4, 5, 25, 250, 256,
    ]  # fmt: skip


def _printing(script: str) -> DriverProcess:
    """A DriverProcess reading a real child that runs ``script`` (only its output is used)."""
    driver = DriverProcess.__new__(DriverProcess)
    driver.process = subprocess.Popen(
        [sys.executable, "-u", "-c", script], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL
    )
    driver._buffer = b""
    return driver


def _close(driver: DriverProcess) -> None:
    driver.process.wait(timeout=10)
    assert driver.process.stdout is not None
    driver.process.stdout.close()


def test_a_phase_that_keeps_printing_may_outlast_its_stall_bound() -> None:
    driver = _printing(
        "import time\nfor i in range(10):\n    print(f'progress {i}/10'); time.sleep(0.2)\n"
        "print('done')"
    )
    seen: list[str] = []
    started = time.monotonic()
    try:
        # A stall of 1.5 s leaves the child's start and each 0.2 s gap a wide margin on a
        # loaded 2-core machine, and the whole phase (2 s or more) still outlasts it.
        assert driver.wait_for_progressing("done", 1.5, seen.append)
    finally:
        _close(driver)
    assert time.monotonic() - started > 1.5  # longer than one stall, yet not a stall
    assert seen[-1] == "done" and len(seen) == 11


def test_a_silent_phase_fails_after_one_stall_and_an_ended_one_at_once() -> None:
    silent = _printing("import time\nprint('progress 0/1')\ntime.sleep(30)")
    started = time.monotonic()
    try:
        assert not silent.wait_for_progressing("done", 0.5, lambda line: None)
        assert time.monotonic() - started < 10
    finally:
        silent.process.kill()
        _close(silent)
    ended = _printing("print('progress 0/1')")
    try:
        assert not ended.wait_for_progressing("done", 30, lambda line: None)
    finally:
        _close(ended)


def test_a_stalled_drill_is_one_line_and_exit_1(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def stalled(*args: Any, **kwargs: Any) -> None:
        raise DrillStalledError("the drill's controller did not reach 'done' in phase 0")

    monkeypatch.setattr("e2e._cli.drill.run_drill", stalled)
    result = CliRunner().invoke(build_app(), ["drill", "--rollouts", "1000", "--json"])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1, result.output
    assert "did not reach 'done'" in lines[0] and "--keep-dir" in lines[0]
    assert "Traceback" not in result.output
