"""Every process the harness starts dies with the process that started it (D242), as processes.

A harness process starts real servers (one with two shard processes) and is SIGKILLed: every
server and shard must be gone soon after. SIGTERM and SIGHUP to a harness command clean up as
Ctrl-C does.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from .processes import kill_group

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

HARNESS = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from e2e._launch.lifeline import terminate_as_interrupt
    from e2e._launch.supervisor import Supervisor, SupervisorOptions

    roles = tuple(sys.argv[2].split(","))
    options = SupervisorOptions(roles=roles, role_options={"resources": {"workers": 2}})
    try:
        with terminate_as_interrupt(), Supervisor(Path(sys.argv[1]), "tok", options) as s:
            print(json.dumps([p.pid for p in s.processes.values()]), flush=True)
            time.sleep(600)
    except KeyboardInterrupt:
        print("cleaned up", flush=True)
    """
)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _group_members(pgids: list[int]) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[2]) in pgids:
                members.append(int(entry.name))
    return members


def _harness(tmp_path: Path, roles: str) -> tuple[subprocess.Popen[str], list[int]]:
    process = subprocess.Popen(
        [sys.executable, "-c", HARNESS, str(tmp_path / "run"), roles],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        assert process.stdout is not None
        servers: list[int] = json.loads(process.stdout.readline())
    except BaseException:
        kill_group(process)  # a harness that never listed its servers must not outlive the test
        raise
    return process, servers


def _kill_groups(pgids: list[int]) -> None:
    for pgid in pgids:  # never leave them behind, even when the test fails
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)


def _wait_gone(pids: list[int], within: float = 20.0) -> list[int]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if _running(pid)]
        if not alive:
            return []
        time.sleep(0.1)
    return [pid for pid in pids if _running(pid)]


def test_servers_and_their_shards_die_when_the_harness_is_sigkilled(tmp_path: Path) -> None:
    process, servers = _harness(tmp_path, "worker,resources")
    try:
        deadline = time.monotonic() + 30
        while len(members := _group_members(servers)) < len(servers) + 2:  # + two shards
            assert time.monotonic() < deadline, f"the shards never started: {members}"
            time.sleep(0.1)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
        assert _wait_gone(members) == [], "orphans outlived the harness"
    finally:
        kill_group(process)
        _kill_groups(servers)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_clean_up_like_ctrl_c(tmp_path: Path, sig: signal.Signals) -> None:
    process, servers = _harness(tmp_path, "worker")
    try:
        os.kill(process.pid, sig)
        out, _ = process.communicate(timeout=30)
        assert "cleaned up" in out
        assert process.returncode == 0
        assert _wait_gone(servers, within=5.0) == []
    finally:
        kill_group(process)
        _kill_groups(servers)
