"""The documented example participant, as a real process on 127.0.0.1, through a crash."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from e2e._launch.spawn import ServerProcess
from participants import read_participant_checkpoint
from protocols import CONTROL_PREFIX

pytestmark = pytest.mark.process
REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "docs" / "examples" / "minimal_participant.py"
TOKEN = "example-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _serve(log: Path) -> ServerProcess:
    return ServerProcess(
        [sys.executable, str(EXAMPLE), "--port", "0", "--tick-ms", "20"],
        env={"MIDFLIGHT_CONTROL_TOKEN": TOKEN},
        log_path=log,
    )


def _control(client: httpx.Client, route: str, **body: Any) -> httpx.Response:
    body.setdefault("deadline_ts", time.time() + 30)
    return client.post(f"{CONTROL_PREFIX}/{route}", json=body, headers=AUTH)


def test_the_example_checkpoints_crashes_and_continues(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt-1"
    with (
        _serve(tmp_path / "first.log") as server,
        httpx.Client(base_url=server.url, timeout=30) as client,
    ):
        assert client.get(f"{CONTROL_PREFIX}/status").status_code == 401
        for key in ("a", "b-a2"):
            assert (
                client.post(f"/ng-rollout/{key}/start", json={"target": 10_000}).status_code == 200
            )
        deadline = time.monotonic() + 20
        while client.get("/ng-rollout/a").json()["step"] < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        prepared = _control(client, "prepare", checkpoint_id="c1")
        assert prepared.json()["phase"] == "prepared", prepared.text
        assert client.post("/ng-rollout/c/start", json={"target": 5}).json()["error"]["code"] == (
            "admission_closed"
        )
        scope = [{"rollout_id": "a"}, {"rollout_id": "b", "attempt": 2}]
        committed = _control(
            client, "commit", checkpoint_id="c1", checkpoint_dir=str(checkpoint), episode_ids=scope
        )
        assert committed.status_code == 200, committed.text
        share = read_participant_checkpoint(
            checkpoint / "gym" / "environment" / "example", kind="environment", instance="example"
        )
        assert share.manifest == committed.json()["manifest"]
        steps = {r["episode_id"]["rollout_id"]: r["step"] for r in share.records}
        assert steps["a"] > 0
        assert _control(client, "resume", checkpoint_id="c1").json() == {
            "phase": "idle",
            "idempotent": False,
        }
        again = _control(client, "prepare", checkpoint_id="c1")
        assert (again.status_code, again.json()["error"]["code"]) == (409, "stale_checkpoint")
        missing = client.post(
            f"{CONTROL_PREFIX}/prepare", json={"checkpoint_id": "c2"}, headers=AUTH
        )
        assert (missing.status_code, missing.json()["error"]["code"]) == (422, "invalid_request")
        server.kill()  # SIGKILL: the episodes die with the process

    with (
        _serve(tmp_path / "second.log") as server,
        httpx.Client(base_url=server.url, timeout=30) as client,
    ):
        restored = _control(
            client, "restore", checkpoint_id="r1", checkpoint_dir=str(checkpoint), episode_ids=scope
        )
        assert restored.json()["restored"] == ["a-a1", "b-a3"], restored.text
        early = client.post("/ng-rollout/a-a1/start", json={"target": 1})
        assert early.json()["error"]["code"] == "admission_closed"
        assert _control(client, "resume", checkpoint_id="r1").status_code == 200
        stale = client.post("/ng-rollout/a/start", json={"target": 1})
        assert (stale.status_code, stale.json()["error"]["code"]) == (409, "stale_attempt")
        continued = client.post("/ng-rollout/a-a1/start", json={"target": 1})
        assert continued.status_code == 200 and continued.json()["step"] == steps["a"]
