"""The second half of ``midflight demo``: the example participant through a crash.

Starts ``docs/examples/minimal_participant.py`` as a real process, runs episodes, checkpoints
them, SIGKILLs the process, restores into a fresh one and shows each episode continue from its
saved step while its crashed attempt is refused.
"""

from __future__ import annotations

import secrets
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from protocols import CONTROL_PREFIX

from ._spawn import ServerProcess

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "minimal_participant.py"


def _serve(root: Path, token: str, name: str) -> ServerProcess:
    if not EXAMPLE.is_file():
        raise FileNotFoundError(f"the example participant is missing: {EXAMPLE}")
    return ServerProcess(
        [sys.executable, str(EXAMPLE), "--port", "0", "--tick-ms", "20"],
        env={"MIDFLIGHT_CONTROL_TOKEN": token},
        log_path=root / f"{name}.log",
    )


def _control(client: httpx.Client, token: str, route: str, **body: Any) -> dict[str, Any]:
    body.setdefault("deadline_ts", time.time() + 30)
    reply = client.post(
        f"{CONTROL_PREFIX}/{route}", json=body, headers={"Authorization": f"Bearer {token}"}
    )
    result: dict[str, Any] = reply.json()
    result["http_status"] = reply.status_code
    return result


def run_participant_demo(root: Path, *, episodes: int = 3) -> dict[str, Any]:
    """Checkpoint, crash and restore the example participant; return what was observed."""
    token = secrets.token_urlsafe(16)
    checkpoint = root / "ckpt-1"
    keys = [f"episode-{i}" for i in range(episodes)]
    scope = [{"rollout_id": key} for key in keys]
    with _serve(root, token, "first") as server, httpx.Client(base_url=server.url, timeout=30) as c:
        unauthenticated = c.get(f"{CONTROL_PREFIX}/status").status_code
        for key in keys:
            c.post(f"/ng-rollout/{key}/start", json={"target": 100_000}).raise_for_status()
        deadline = time.monotonic() + 20
        while c.get(f"/ng-rollout/{keys[-1]}").json()["step"] < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        prepared = _control(c, token, "prepare", checkpoint_id="ckpt-1")
        committed = _control(
            c,
            token,
            "commit",
            checkpoint_id="ckpt-1",
            checkpoint_dir=str(checkpoint),
            episode_ids=scope,
        )
        saved = {key: c.get(f"/ng-rollout/{key}").json()["step"] for key in keys}
        resumed = _control(c, token, "resume", checkpoint_id="ckpt-1")
        stale = _control(c, token, "prepare", checkpoint_id="ckpt-1")
        server.kill()
    with (
        _serve(root, token, "second") as server,
        httpx.Client(base_url=server.url, timeout=30) as c,
    ):
        restored = _control(
            c,
            token,
            "restore",
            checkpoint_id="restore-1",
            checkpoint_dir=str(checkpoint),
            episode_ids=scope,
        )
        _control(c, token, "resume", checkpoint_id="restore-1")
        crashed_attempt = c.post(f"/ng-rollout/{keys[0]}/start", json={"target": 1})
        continued = {
            key: c.post(f"/ng-rollout/{key}-a1/start", json={"target": 1}).json()["step"]
            for key in keys
        }
    return {
        "unauthenticated_status": unauthenticated,
        "prepare_phase": prepared.get("phase"),
        "committed_episodes": committed.get("episode_ids"),
        "manifest_records": committed.get("manifest", {}).get("record_count"),
        "saved_steps": saved,
        "resume_phase": resumed.get("phase"),
        "prepare_after_resume": stale.get("error", {}).get("code"),
        "restored": restored.get("restored"),
        "crashed_attempt": crashed_attempt.json().get("error", {}).get("code"),
        "continued_steps": continued,
    }
