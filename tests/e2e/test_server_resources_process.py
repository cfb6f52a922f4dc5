"""``midflight serve resources`` as real processes: checkpoint, SIGKILL, restore, continue."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from e2e._launch.spawn import ServerProcess
from protocols import CONTROL_PREFIX

pytestmark = pytest.mark.process
TOKEN = "resources-process-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TASK = {"task_input": {"activations": 1, "turns": 1, "max_tokens": 4, "seed": 3}}


def _serve(tmp_path: Path, log: str) -> ServerProcess:
    return ServerProcess(
        [sys.executable, "-m", "e2e", "serve", "resources", "--port", "0",
         "--root", str(tmp_path / "run"), "--verify", "replay"],
        env={"MIDFLIGHT_CONTROL_TOKEN": TOKEN},
        log_path=tmp_path / log,
    )  # fmt: skip


def _control(client: httpx.Client, route: str, **body: Any) -> httpx.Response:
    body.setdefault("deadline_ts", time.time() + 30)
    return client.post(f"{CONTROL_PREFIX}/{route}", json=body, headers=AUTH)


def test_a_session_survives_sigkill_and_continues_as_the_next_attempt(tmp_path: Path) -> None:
    checkpoint = tmp_path / "run" / "checkpoints" / "ckpt"  # under the run root (D240)
    scope = [{"rollout_id": "r1"}]
    with _serve(tmp_path, "first.log") as server, httpx.Client(base_url=server.url) as client:
        seeded = client.post("/ng-rollout/r1/seed_session", json=TASK)
        assert seeded.headers["x-ng-checkpoint-verify"] == "replay"
        sid = seeded.json()["session_id"]
        cookie = {"cookie": f"ng_session={sid}"}
        client.cookies.clear()
        assert client.post("/ng-rollout/r1/tools/mul", json={"arg": 6}, headers=cookie).json() == {
            "value": 7,
            "notes": 0,
        }
        assert _control(client, "prepare", checkpoint_id="c1").json()["phase"] == "prepared"
        committed = _control(
            client, "commit", checkpoint_id="c1", checkpoint_dir=str(checkpoint), episode_ids=scope
        )
        assert committed.json()["episode_ids"] == ["r1"], committed.text
        server.kill()

    with _serve(tmp_path, "second.log") as server, httpx.Client(base_url=server.url) as client:
        restored = _control(
            client, "restore", checkpoint_id="r1", checkpoint_dir=str(checkpoint), episode_ids=scope
        )
        assert restored.json()["restored"] == ["r1-a1"], restored.text
        assert _control(client, "resume", checkpoint_id="r1").status_code == 200
        stale = client.post("/ng-rollout/r1/tools/add", json={"arg": 1}, headers=cookie)
        assert (stale.status_code, stale.json()["error"]["code"]) == (409, "stale_attempt")
        continued = client.post("/ng-rollout/r1-a1/tools/add", json={"arg": 1}, headers=cookie)
        assert continued.json() == {"value": 8, "notes": 0}
        reward = client.post("/ng-rollout/r1-a1/verify", headers=cookie).json()["reward"]
        assert reward == 0.08
