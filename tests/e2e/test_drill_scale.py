"""The drill at scale: hundreds in flight by default, a phase bounded by its silence rather than
its length, and a stalled phase reported in one line."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from e2e._cli.app import build_app
from e2e._drill.driver_process import DriverProcess
from e2e._drill.errors import DrillStalledError
from e2e._drill.options import default_concurrency
from e2e._servers.evidence import evidence_written


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
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # the kept directory goes there
    result = CliRunner().invoke(build_app(), ["drill", "--rollouts", "1000"])
    line = result.output.strip().splitlines()[-1]  # under the progress bar's last frame
    assert result.exit_code == 1 and line.startswith("midflight drill: FAIL: "), result.output
    assert "did not reach 'done'" in line and "the run's files are kept in" in line
    assert "Traceback" not in result.output
    # With --json, the same failure is one JSON object on stdout, as the control commands do.
    result = CliRunner().invoke(build_app(), ["drill", "--rollouts", "1000", "--json"])
    (line,) = result.output.strip().splitlines()
    failed = json.loads(line)
    assert result.exit_code == 1 and failed["ok"] is False and failed["kept_dir"]
    assert "did not reach 'done'" in failed["failures"][0] and failed["kept_dir"] in failed["error"]


def _figures(lost: int) -> Any:
    from e2e._drill.oracle import Figures

    return Figures(
        {
            "lost": lost,
            "checkpoints": 3,
            "crashes": 2,
            "restored": 4,
            "restored_per_crash": [2, 2],
            "restored_delivered": 3,
            "held_delivered": 2,
            "stale_probes_per_crash": [4, 4],
            "cut_continued": 1,
        }
    )


@pytest.mark.parametrize(
    ("outcome", "code", "kept"),
    [("stalled", 1, True), ("lost", 1, True), ("passed", 0, False)],
)
def test_a_run_that_fails_keeps_its_directory_and_names_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, outcome: str, code: int, kept: bool
) -> None:
    """D366: without --keep-dir, only a run that passed removes its temporary directory."""
    runs: list[Path] = []

    def run(options: Any, work: Path, on_line: Any, **kwargs: Any) -> Any:
        (work / "run" / "logs").mkdir(parents=True)
        (work / "run" / "logs" / "driver-0.log").write_text("what the controller printed\n")
        runs.append(work)
        if outcome == "stalled":
            raise DrillStalledError("the drill's controller did not reach 'done' in phase 0")
        return _figures(lost=1 if outcome == "lost" else 0)

    monkeypatch.setattr("e2e._cli.drill.run_drill", run)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    result = CliRunner().invoke(build_app(), ["drill", "--json"])
    assert result.exit_code == code, result.output
    (work,) = runs
    assert (work / "run" / "logs" / "driver-0.log").exists() is kept
    assert work.parent == tmp_path
    figures = json.loads(result.stdout)
    assert figures["kept_dir"] == (str(work) if kept else None)
    assert figures["ok"] is not kept


@pytest.mark.parametrize("ok", [False, True])
def test_a_matrix_with_a_red_cell_keeps_its_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, ok: bool
) -> None:
    from e2e._drill.matrix import MatrixCell

    runs: list[Path] = []

    def run(cells: Any, options: Any, work: Path, on_line: Any, **kwargs: Any) -> Any:
        (work / "cell-0").mkdir(parents=True)
        (work / "cell-0" / "controller.log").write_text("the cell's controller\n")
        runs.append(work)
        return [MatrixCell("controller", "checkpoint-json-written", ok, "" if ok else "lost 1")]

    monkeypatch.setattr("e2e._cli.drill_matrix.run_matrix", run)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    result = CliRunner().invoke(build_app(), ["drill", "--matrix", "small", "--json"])
    assert result.exit_code == (0 if ok else 1), result.output
    (work,) = runs
    assert (work / "cell-0" / "controller.log").exists() is not ok
    assert json.loads(result.stdout)["kept_dir"] == (None if ok else str(work))


def test_a_stopped_controller_is_reported_with_its_exit_code_and_last_log_line(
    tmp_path: Path,
) -> None:
    """D366: the stall's line says why: the exit code and the log's last line, or the silence."""

    def started(script: str) -> DriverProcess:
        driver = DriverProcess.__new__(DriverProcess)
        driver._log = open(tmp_path / f"driver-{len(list(tmp_path.iterdir()))}.log", "ab")  # noqa: SIM115
        driver.process = subprocess.Popen(
            [sys.executable, "-u", "-c", script],
            stdout=subprocess.PIPE,
            stderr=driver._log,
            stdin=subprocess.DEVNULL,
        )
        driver._buffer = b""
        return driver

    crashed = started(
        "print('progress 0/1')\nraise ConnectionError('all connection attempts failed')"
    )
    try:
        assert not crashed.wait_for_progressing("done", 30, lambda line: None)
        why = crashed.why_it_stopped(30)
        assert why.startswith("it exited with code 1, its log ending ")
        assert "ConnectionError: all connection attempts failed" in why
    finally:
        _close(crashed)
        crashed._log.close()
    silent = started("import time\nprint('progress 0/1')\ntime.sleep(30)")
    try:
        assert not silent.wait_for_progressing("done", 0.5, lambda line: None)
        assert silent.why_it_stopped(0.5) == "it printed nothing for 0.5 s"
    finally:
        silent.process.kill()
        _close(silent)
        silent._log.close()


def test_a_baseline_that_did_not_finish_every_rollout_fails_the_drill_and_is_never_reused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """D373: a rollout the baseline lost has no outcome to compare the run's with; the drill
    compared only the others, and kept the short baseline for reuse. Here the cluster's run is
    replaced by the evidence an overloaded one left: one result, one failure."""
    from e2e._servers.evidence import EvidenceLog

    def overloaded(root: Path, *args: Any, **kwargs: Any) -> None:
        log = EvidenceLog(root / "evidence" / "driver.jsonl")
        for rollout in ("r000", "r001"):
            log.append({"event": "dispatch", "rollout": rollout, "attempt": 0, "t": 1.0})
        log.append({"event": "result", "rollout": "r000", "attempt": 0, "reward": 0.5,
                    "manifest": {"records": []}, "t": 2.0})  # fmt: skip
        log.append({"event": "run_failed", "rollout": "r001", "attempt": 0, "status": 200,
                    "code": None, "t": 3.0, "failure": {"code": "deadline_exceeded",
                    "detail": "resources seed_session of r001 did not answer within 60 s"}})  # fmt: skip
        log.append({"event": "final", "accepted": {"r000": {"attempt": 0, "reward": 0.5}},
                    "leftover": {}, "t": 4.0})  # fmt: skip

    monkeypatch.setattr("e2e._drill.run.run_cluster", overloaded)
    baseline = tmp_path / "baseline"
    args = [
        "drill",
        "--rollouts",
        "2",
        "--baseline",
        str(baseline),
        "--keep-dir",
        str(tmp_path / "k"),
    ]
    result = CliRunner().invoke(build_app(), [*args, "--json"])
    failed = json.loads(result.output.strip().splitlines()[-1])
    assert result.exit_code == 1 and failed["ok"] is False, result.output
    assert failed["error"].startswith("the baseline finished 1 of 2 rollouts; 1 ended in a failure")
    assert "deadline_exceeded: resources seed_session of r001" in failed["error"]
    assert not (baseline / "baseline.json").exists()  # never reused as a finished baseline


def test_a_silent_controller_is_no_stall_while_the_servers_evidence_grows(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """D375: thousands in flight at once may finish nothing for minutes while every model call
    still writes its evidence line; that growth ends a silence as a line does."""
    monkeypatch.setattr("e2e._drill.driver_process.ACTIVITY_POLL_S", 0.1)
    evidence = tmp_path / "evidence"
    assert evidence_written(tmp_path) == 0  # before the directory exists
    evidence.mkdir()
    calls = evidence / "worker.jsonl"

    def growing() -> int:
        with calls.open("a") as handle:  # a model call lands on each look
            handle.write('{"event":"generation"}\n')
        return evidence_written(tmp_path)

    script = "import time\nprint('progress 0/1')\ntime.sleep(2.5)\nprint('done')"
    moving = _printing(script)
    try:  # silent for 2.5 s against a stall of 1 s: carried by the evidence alone
        assert moving.wait_for_progressing("done", 1.0, lambda line: None, activity=growing)
    finally:
        _close(moving)
    assert evidence_written(tmp_path) == calls.stat().st_size > 0
    unaided = _printing(script)
    try:  # the same controller with nothing else to watch stalls, as before D375
        assert not unaided.wait_for_progressing("done", 1.0, lambda line: None)
    finally:
        unaided.process.kill()
        _close(unaided)
    still = _printing("import time\nprint('progress 0/1')\ntime.sleep(30)")
    try:  # evidence that stops growing is a stall, and the line says what was watched
        frozen = evidence_written(tmp_path)
        assert not still.wait_for_progressing(
            "done", 1.0, lambda line: None, activity=lambda: frozen
        )
        assert still.why_it_stopped(1.0).startswith("it printed nothing and no server's evidence")
    finally:
        still.process.kill()
        _close(still)
    ended = _printing("print('progress 0/1')")
    started = time.monotonic()
    try:  # a controller that ended is reported at once, however busy the servers look
        assert not ended.wait_for_progressing("done", 30, lambda line: None, activity=growing)
        assert time.monotonic() - started < 10
    finally:
        _close(ended)
