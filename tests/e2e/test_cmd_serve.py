"""``midflight serve`` as a person starts it: a taken port, a missing control token, --processes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
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
