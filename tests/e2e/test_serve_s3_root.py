"""A reference server with an ``s3://`` checkpoint root (D330): the option, and a round trip.

The server runs in-process (``httpx.ASGITransport``) against moto's S3 API (``s3_root``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from e2e import build_app
from e2e._servers.cluster import default_cluster
from e2e._servers.context import ServeContext, control_settings, serve_options_from
from e2e._servers.resources import create_resources_app
from participants import read_participant_checkpoint
from protocols import CONTROL_PREFIX

TOKEN = "s3-root-token"
TASK = {"task_input": {"activations": 2, "turns": 2, "max_tokens": 8, "seed": 0}}
runner = CliRunner()


def test_serve_keeps_an_s3_checkpoint_root_in_canonical_form(tmp_path: Path) -> None:
    options = serve_options_from(
        name="r", port=0, cluster=None, root=tmp_path, checkpoint_root="s3://midflight/runs/a/"
    )
    assert options.checkpoints_under == "s3://midflight/runs/a/"
    assert control_settings(options).checkpoint_root == "s3://midflight/runs/a"


@pytest.mark.parametrize("url", ["s3://Not_A_Bucket/x", "s3://midflight/a/../b", "s3://"])
def test_a_malformed_s3_checkpoint_root_is_one_line_and_exit_2(url: str) -> None:
    result = runner.invoke(
        build_app(),
        ["serve", "resources", "--port", "0", "--checkpoint-root", url],
        env={"COLUMNS": "80", "MIDFLIGHT_CONTROL_TOKEN": TOKEN},
    )
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith("error: --checkpoint-root")


@asynccontextmanager
async def resources(root: Path, checkpoint_root: str) -> AsyncIterator[httpx.AsyncClient]:
    ctx = ServeContext(
        name="resources",
        port=0,
        root=root,
        cluster=default_cluster(root),
        control_token=TOKEN,
        capture_token=TOKEN,
        checkpoint_root=checkpoint_root,
    )
    app = create_resources_app(ctx)
    async with app.state.plane.running():  # ASGITransport runs no lifespan
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://resources") as client:
            yield client


async def _control(client: httpx.AsyncClient, route: str, **body: Any) -> httpx.Response:
    body.setdefault("deadline_ts", time.time() + 30)
    headers = {"authorization": f"Bearer {TOKEN}"}
    return await client.post(f"{CONTROL_PREFIX}/{route}", json=body, headers=headers)


@pytest.mark.anyio
async def test_the_resources_server_commits_into_s3_and_a_fresh_one_restores(
    tmp_path: Path, s3_root: str
) -> None:
    checkpoint = f"{s3_root}/checkpoints/c1"
    async with resources(tmp_path, s3_root) as client:
        sid = (await client.post("/ng-rollout/r1/seed_session", json=TASK)).json()["session_id"]
        added = await client.post(
            "/ng-rollout/r1/tools/add", json={"arg": 5}, headers={"cookie": f"ng_session={sid}"}
        )
        assert added.status_code == 200, added.text
        await _control(client, "prepare", checkpoint_id="c1")
        refused = await _control(
            client, "commit", checkpoint_id="c1", checkpoint_dir=str(tmp_path / "c1")
        )
        assert refused.status_code == 422 and refused.json()["error"]["code"] == "invalid_request"
        committed = await _control(client, "commit", checkpoint_id="c1", checkpoint_dir=checkpoint)
        assert committed.status_code == 200, committed.text
    share = read_participant_checkpoint(
        f"{checkpoint}/gym/resources/resources", kind="resources", instance="resources"
    )
    assert [r["state"] for r in share.records] == [{"value": 6, "notes": []}]
    async with resources(tmp_path, s3_root) as fresh:
        restored = await _control(
            fresh,
            "restore",
            checkpoint_id="r",
            checkpoint_dir=checkpoint,
            episode_ids=[{"rollout_id": "r1"}],
        )
        assert restored.json()["restored"] == ["r1-a1"], restored.text
