"""Servers with several processes, as real processes: one participant, whatever its shards.

A ``serve resources --processes 2`` server, a shard SIGKILLed while a checkpoint is open, the
process group killed whole, ``/metrics`` summed over shards, and a small drill with two processes
per server.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from e2e._launch.routing import aggregate_metrics
from e2e._launch.spawn import ServerProcess
from participants import slot_of

pytestmark = [pytest.mark.process, pytest.mark.timeout(300)]

TOKEN = "fanout-test-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def _events(log: Path, name: str) -> list[dict[str, Any]]:
    found = []
    for line in log.read_text().splitlines():
        if line.startswith("{") and f'"{name}"' in line:
            event = json.loads(line)
            if event.get("event") == name:
                found.append(event)
    return found


def _wait(condition: Any, what: str, within: float = 30.0) -> Any:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[ServerProcess, Path]]:
    log = tmp_path / "resources.log"
    argv = [sys.executable, "-m", "e2e", "serve", "resources", "--port", "0"]
    argv += ["--root", str(tmp_path / "run"), "--processes", "2"]
    with ServerProcess(argv, env={"MIDFLIGHT_CONTROL_TOKEN": TOKEN}, log_path=log) as process:
        _wait(lambda: len(_events(log, "shard.joined")) >= 2, "two shards to join")
        yield process, log


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped yet holds nothing and does not count)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _socket_dir(shard_pid: int) -> Path:
    environ = Path(f"/proc/{shard_pid}/environ").read_bytes().split(b"\0")
    named = [v for v in environ if v.startswith(b"MIDFLIGHT_FANOUT_SOCKET=")]
    return Path(named[0].split(b"=", 1)[1].decode()).parent


def _rollouts_on_both_slots() -> list[str]:
    by_slot: dict[int, list[str]] = {0: [], 1: []}
    for n in range(64):
        rollout = f"r{n}"
        if len(by_slot[slot_of(rollout, 2)]) < 2:
            by_slot[slot_of(rollout, 2)].append(rollout)
    return by_slot[0] + by_slot[1]


def test_metrics_sum_every_shard_and_sessions_route_to_their_shard(
    server: tuple[ServerProcess, Path],
) -> None:
    process, _log = server
    with httpx.Client(base_url=process.url, timeout=30) as client:
        rollouts = _rollouts_on_both_slots()
        for rollout in rollouts:
            seeded = client.post(f"/ng-rollout/{rollout}/seed_session", json={"task_input": {}})
            assert seeded.status_code == 200, seeded.text
            cookie = {"cookie": f"ng_session={seeded.json()['session_id']}"}
            tool = client.post(f"/ng-rollout/{rollout}/tools/add", json={"arg": 2}, headers=cookie)
            assert tool.json() == {"value": 3, "notes": 0}  # found the session its seed made
        metrics = client.get("/metrics").text
        assert 'midflight_resources_requests_total{outcome="ok",route="seed"} 4.0' in metrics
        # Each shard watches its own event loop; the main process sums their figures (D406).
        assert "# TYPE midflight_event_loop_lag_seconds histogram" in metrics
        assert "midflight_event_loop_stalls_total " in metrics
        status = client.get("/ng-control/v1/checkpoint/status", headers=AUTH).json()
        assert status["report"]["counts"]["sessions"] == 4
        assert status["report"]["counts"]["workers"] == 2


def test_a_shard_killed_while_closed_blocks_until_resume_and_the_group_dies_whole(
    server: tuple[ServerProcess, Path],
) -> None:
    process, log = server
    pids = [event["pid"] for event in _events(log, "shard.joined")]
    deadline = time.time() + 60
    body = {"checkpoint_id": "ck-1", "deadline_ts": deadline}
    with httpx.Client(base_url=process.url, timeout=90) as client:
        prepared = client.post("/ng-control/v1/checkpoint/prepare", json=body, headers=AUTH)
        assert prepared.json()["phase"] == "prepared", prepared.text
        os.kill(pids[0], signal.SIGKILL)
        lost = _wait(lambda: _events(log, "shard.lost"), "the lost shard's warning")
        assert lost[0]["pid"] == pids[0] and lost[0]["level"] == "warning"
        assert lost[0]["open_checkpoint_can_commit"] is False

        def blockers() -> list[str]:
            reply = client.get("/ng-control/v1/checkpoint/status", headers=AUTH)
            return list(reply.json()["report"]["blockers"])

        assert "resources-worker-lost" in _wait(blockers, "the lost-shard blocker")
        # The replacement joins closed and reports, yet the lost share still blocks the commit.
        _wait(lambda: len(_events(log, "shard.joined")) >= 3, "a replacement shard")
        assert "resources-worker-lost" in blockers()
        resumed = client.post("/ng-control/v1/checkpoint/resume", json=body, headers=AUTH)
        assert resumed.status_code == 200, resumed.text
        assert blockers() == []
    port = int(process.url.rsplit(":", 1)[1])
    shards = [event["pid"] for event in _events(log, "shard.joined")]
    socket_dir = _socket_dir(shards[-1])
    process.kill()
    for pid in shards:  # SIGKILL of the group left no shard behind
        _wait(lambda pid=pid: not _running(pid), f"shard {pid} to die")
    assert socket_dir.exists()  # nobody removes it under SIGKILL ...
    with ServerProcess(process.argv, env={"MIDFLIGHT_CONTROL_TOKEN": TOKEN}, log_path=log):
        # ... so the next start of the same server does (D243)
        _wait(lambda: not socket_dir.exists(), "the dead server's socket directory to go")
    with socket.socket() as probe:
        # As a new server binds it (uvicorn sets SO_REUSEADDR): connections the kill left in
        # TIME_WAIT do not count, a process still listening does.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", port))  # nobody holds the port any more


def test_metrics_of_the_main_process_are_kept_and_the_shards_summed() -> None:
    main = "# HELP midflight_phase x\n# TYPE midflight_phase gauge\nmidflight_phase 2.0\n"
    shard = (
        "# HELP midflight_phase x\n# TYPE midflight_phase gauge\nmidflight_phase 0.0\n"
        '# HELP hits h\n# TYPE hits counter\nhits_total{route="a"} 2.0\n'
    )
    merged = aggregate_metrics(main, [shard, shard.replace("2.0", "3.0")])
    assert "midflight_phase 2.0" in merged and "midflight_phase 0.0" not in merged
    assert 'hits_total{route="a"} 5.0' in merged


@pytest.mark.timeout(420)  # like test_drill.py: a loaded 2-core machine takes several times longer
def test_the_drill_with_two_processes_per_server_is_green(tmp_path: Path) -> None:
    completed = subprocess.run(
        [
            *(sys.executable, "-m", "e2e", "drill", "--json", "--keep-dir", str(tmp_path)),
            *("--rollouts", "2", "--checkpoints", "3", "--crashes", "2", "--concurrency", "2"),
            *("--restart-only-share", "0", "--processes", "2"),
        ],
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    assert completed.stdout.strip(), completed.stderr[-3000:]
    figures = json.loads(completed.stdout.strip().splitlines()[-1])
    assert completed.returncode == 0, figures
    joined = _events(tmp_path / "run" / "logs" / "resources-1.log", "shard.joined")
    assert len(joined) == 2  # the restarted resources server really ran two shards
    policy = _events(tmp_path / "run" / "logs" / "policy-0.log", "shard.joined")
    assert len(policy) == 2  # and so did the policy server (D216)


def test_a_fresh_server_is_healthy_only_with_every_shard_and_restores_at_once(
    server: tuple[ServerProcess, Path], tmp_path: Path
) -> None:
    process, _log = server
    checkpoint_dir = str(tmp_path / "run" / "checkpoints" / "ck-1")
    scope = [{"rollout_id": rollout} for rollout in _rollouts_on_both_slots()]
    with httpx.Client(base_url=process.url, timeout=60) as client:
        for rollout in _rollouts_on_both_slots():
            seeded = client.post(f"/ng-rollout/{rollout}/seed_session", json={"task_input": {}})
            assert seeded.status_code == 200, seeded.text
        body = {"checkpoint_id": "ck-1", "deadline_ts": time.time() + 30}
        prepared = client.post("/ng-control/v1/checkpoint/prepare", json=body, headers=AUTH)
        assert prepared.json()["phase"] == "prepared", prepared.text
        commit = {**body, "checkpoint_dir": checkpoint_dir, "episode_ids": scope}
        committed = client.post("/ng-control/v1/checkpoint/commit", json=commit, headers=AUTH)
        assert committed.status_code == 200, committed.text
    process.kill()
    fresh_log = tmp_path / "fresh.log"
    with (
        ServerProcess(
            process.argv, env={"MIDFLIGHT_CONTROL_TOKEN": TOKEN}, log_path=fresh_log
        ) as fresh,
        httpx.Client(base_url=fresh.url, timeout=60) as client,
    ):
        health = _wait(lambda: (r := client.get("/healthz")).status_code == 200 and r, "health")
        assert health.json()["status"] == "ok"
        # Healthy means every shard joined: a restore sent now is served, not refused (D244).
        status = client.get("/ng-control/v1/checkpoint/status", headers=AUTH).json()
        assert status["report"]["counts"]["workers"] == 2
        restore = {
            "checkpoint_id": "r-1",
            "deadline_ts": time.time() + 30,
            "checkpoint_dir": checkpoint_dir,
            "episode_ids": scope,
        }
        restored = client.post("/ng-control/v1/checkpoint/restore", json=restore, headers=AUTH)
        assert restored.status_code == 200, restored.text
        assert len(restored.json()["restored"]) == len(scope)
