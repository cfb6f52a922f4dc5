"""The supervisor over real processes: start in order, SIGKILL, restart, never an orphan.

Only the worker exists on every branch; set ``MIDFLIGHT_SUPERVISOR_ROLES`` (comma-separated) to
run the same tests over more roles once they exist.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from e2e._drill.options import restart_only_rollouts
from e2e._launch.supervisor import ExtraServer, Supervisor, SupervisorOptions, option_flags
from e2e._servers.cluster import ROLES, ServerEntry, read_cluster

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


def test_an_extra_server_sees_its_chosen_peers_first(tmp_path: Path) -> None:
    extra = ExtraServer("environment-restart", "environment", peers={"agent": "agent-restart"})
    supervisor = Supervisor(tmp_path, TOKEN, SupervisorOptions(extra_servers=(extra,)))
    entries = [
        ServerEntry("agent", "agent", "http://127.0.0.1:1"),
        ServerEntry("resources", "resources", "http://127.0.0.1:2"),
        ServerEntry("agent-restart", "agent", "http://127.0.0.1:3", {"restart_only": True}),
    ]
    view = read_cluster(supervisor._peer_view(extra, entries))
    assert view.url_of("agent") == "http://127.0.0.1:3"
    assert view.url_of("resources") == "http://127.0.0.1:2"
    assert {s.name for s in view.servers} == {"agent", "resources", "agent-restart"}
    lonely = ExtraServer("environment-restart", "environment", peers={"agent": "nobody"})
    with pytest.raises(ValueError, match="nobody"):
        supervisor._peer_view(lonely, entries)


def test_the_restart_only_share_is_spread_over_the_rollouts() -> None:
    rollouts = [f"r{i:03d}" for i in range(8)]
    assert restart_only_rollouts(rollouts, 0.2) == ["r000", "r004"]
    assert restart_only_rollouts(rollouts[:4], 0.2) == ["r000"]
    assert restart_only_rollouts(rollouts, 0.0) == []
    assert restart_only_rollouts(rollouts, 1.0) == rollouts
