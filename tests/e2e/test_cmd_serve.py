"""``midflight serve`` as a person starts it: a taken port, a missing control token, --processes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from e2e._cli.app import build_app
from e2e._servers.context import ServeContext
from tests.e2e.processes import serve

pytestmark = pytest.mark.process
TOKEN = "serve-test-token"


@pytest.mark.parametrize(
    "role_args",
    [["worker"], ["resources", "--processes", "2"], ["resources", "--workers", "2"]],
)
def test_a_taken_port_is_one_line_and_exit_2(tmp_path: Path, role_args: list[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        completed = subprocess.run(
            [sys.executable, "-m", "e2e", "serve", *role_args, "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            cwd=tmp_path,
            env={**os.environ, "MIDFLIGHT_CONTROL_TOKEN": TOKEN},
        )
    assert completed.returncode == 2, completed.stderr
    assert completed.stdout == ""
    (line,) = completed.stderr.strip().splitlines()
    assert f"port {port}" in line and "already in use" in line and "Traceback" not in line


def _events(log: Path) -> list[str]:
    events = []
    for line in log.read_text().splitlines():
        if line.startswith("{"):
            events.append(json.loads(line).get("event", ""))
    return events


def test_a_server_without_a_control_token_says_its_control_routes_are_off(tmp_path: Path) -> None:
    log = tmp_path / "without.log"
    with serve("worker", "--root", str(tmp_path), log=log, env={"MIDFLIGHT_CONTROL_TOKEN": ""}):
        pass
    assert "control_routes_disabled" in _events(log)
    log = tmp_path / "with.log"
    with serve("worker", "--root", str(tmp_path), log=log, env={"MIDFLIGHT_CONTROL_TOKEN": TOKEN}):
        pass
    assert "control_routes_disabled" not in _events(log)


@pytest.mark.parametrize("flag", ["--processes", "--workers"])
@pytest.mark.parametrize("role", ["model", "resources", "agent", "environment"])
def test_processes_and_its_older_name_workers_start_the_same_server(
    flag: str, role: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[ServeContext] = []
    monkeypatch.setattr(
        "e2e._cli.serve.run_server", lambda app, options, role: started.append(options)
    )
    result = CliRunner().invoke(
        build_app(), ["serve", role, flag, "3", "--port", "0", "--root", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    assert [options.processes for options in started] == [3]


def _thresholds_logged(log: Path) -> list[list[int]]:
    logged = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    return [event["thresholds"] for event in logged if event.get("event") == "collector_thresholds"]


def test_every_server_process_takes_the_collector_s_thresholds_from_the_environment(
    tmp_path: Path,
) -> None:
    """The main process and each shard set ``MIDFLIGHT_GC_THRESHOLDS`` (D428); unset, none logs."""
    log = tmp_path / "tuned.log"
    env = {"MIDFLIGHT_CONTROL_TOKEN": TOKEN, "MIDFLIGHT_GC_THRESHOLDS": "700, 10, 100"}
    with serve("resources", "--processes", "2", "--root", str(tmp_path), log=log, env=env):
        deadline = time.monotonic() + 30
        while len(_thresholds_logged(log)) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
    assert _thresholds_logged(log) == [[700, 10, 100]] * 3
    log = tmp_path / "default.log"
    env = {"MIDFLIGHT_CONTROL_TOKEN": TOKEN, "MIDFLIGHT_GC_THRESHOLDS": ""}
    with serve("worker", "--root", str(tmp_path), log=log, env=env):
        pass
    assert _thresholds_logged(log) == []


@pytest.mark.parametrize(
    "value", ["700,10,10,10", "700;10", "-1", "lots", "700,,10", "\uff11\uff10"]
)
def test_malformed_collector_thresholds_are_one_line_and_exit_2(tmp_path: Path, value: str) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "e2e", "serve", "worker", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
        env={**os.environ, "MIDFLIGHT_CONTROL_TOKEN": TOKEN, "MIDFLIGHT_GC_THRESHOLDS": value},
    )
    assert completed.returncode == 2, completed.stderr
    assert completed.stdout == ""  # nothing was bound or announced
    (line,) = completed.stderr.strip().splitlines()
    assert line.startswith("error: MIDFLIGHT_GC_THRESHOLDS=") and "Traceback" not in line
