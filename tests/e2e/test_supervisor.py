"""The supervisor over real processes: start in order, SIGKILL, restart, never an orphan.

Only the worker exists on every branch; set ``MIDFLIGHT_SUPERVISOR_ROLES`` (comma-separated) to
run the same tests over more roles once they exist.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from e2e._cluster import ROLES, read_cluster
from e2e._supervisor import Supervisor, SupervisorOptions, option_flags

TOKEN = "supervisor-token"
ROLES_UNDER_TEST = tuple(
    role
    for role in ROLES
    if role in os.environ.get("MIDFLIGHT_SUPERVISOR_ROLES", "worker").split(",")
)


def gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def test_option_flags() -> None:
    assert option_flags({"token_delay_ms": 2, "restart_only": True, "x": False}) == [
        "--token-delay-ms",
        "2",
        "--restart-only",
        "--no-x",
    ]


@pytest.mark.process
def test_start_kill_restart_and_exit_leave_no_process(tmp_path: Path) -> None:
    options = SupervisorOptions(roles=ROLES_UNDER_TEST, role_options={"worker": {"seed": 3}})
    with Supervisor(tmp_path, TOKEN, options) as supervisor:
        first = dict(supervisor.urls)
        assert len(first) == len(ROLES_UNDER_TEST)
        cluster = read_cluster(tmp_path / "cluster.toml")
        assert [s.role for s in cluster.servers] == list(ROLES_UNDER_TEST)
        assert {s.name: s.url for s in cluster.servers} == first
        assert cluster.by_role("worker")[0].options == {"seed": 3}
        for url in first.values():
            assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
        first_pgids = list(supervisor.started_pgids)
        supervisor.kill_all()
        assert all(gone(pgid) for pgid in first_pgids)
        supervisor.restart_all()
        assert all(not gone(p.pid) for p in supervisor.processes.values())
        assert {s.url for s in read_cluster(tmp_path / "cluster.toml").servers} == set(
            supervisor.urls.values()
        )
        assert (tmp_path / "logs" / "worker-0.log").exists()
        assert (tmp_path / "logs" / "worker-1.log").exists()
        all_pgids = list(supervisor.started_pgids)
    assert len(all_pgids) == 2 * len(ROLES_UNDER_TEST)
    assert all(gone(pgid) for pgid in all_pgids)


@pytest.mark.process
def test_keyboard_interrupt_leaves_no_process(tmp_path: Path) -> None:
    pgids: list[int] = []
    supervisor = Supervisor(tmp_path, TOKEN, SupervisorOptions(roles=("worker",)))
    with pytest.raises(KeyboardInterrupt), supervisor:  # noqa: PT012 - raised inside the block
        pgids = list(supervisor.started_pgids)
        raise KeyboardInterrupt
    assert pgids and all(gone(pgid) for pgid in pgids)


@pytest.mark.process
def test_a_failed_start_kills_the_servers_already_started(tmp_path: Path) -> None:
    options = SupervisorOptions(
        roles=("worker", "resources"),
        role_options={"resources": {"no_such_option_anywhere": 1}},
        startup_timeout=20,
    )
    supervisor = Supervisor(tmp_path, TOKEN, options)
    with pytest.raises((TimeoutError, RuntimeError)):
        supervisor.start_all()
    assert supervisor.processes == {}
    assert supervisor.started_pgids and all(gone(pgid) for pgid in supervisor.started_pgids)
