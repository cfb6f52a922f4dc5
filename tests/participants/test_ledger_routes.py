"""The ledger control routes: auth, body validation, refusal while a checkpoint is open, errors."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from participants import FileCaptureLedger, ledger_control_router
from protocols import LEDGER_CONTROL_PREFIX, MAX_LEDGER_BATCH, RolloutManifest

from .ledger_factory import commit

pytestmark = pytest.mark.anyio
TOKEN = "s3cret"
AUTH = {"authorization": f"Bearer {TOKEN}"}


class Harness:
    def __init__(self, tmp_path: Path) -> None:
        self.ledger = FileCaptureLedger(tmp_path)
        self.checkpoint_open = False
        app = FastAPI()
        app.include_router(
            ledger_control_router(
                self.ledger, capture_token=TOKEN, is_checkpoint_open=lambda: self.checkpoint_open
            )
        )
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://test" + LEDGER_CONTROL_PREFIX
        )

    async def post(self, path: str, body: Any, headers: dict[str, str] = AUTH) -> httpx.Response:
        return await self.client.post(path, json=body, headers=headers)


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    made = Harness(tmp_path)
    await made.ledger.record(commit("r1", 0))
    yield made
    await made.client.aclose()
    made.ledger.close()


def error_code(reply: httpx.Response) -> str:
    return str(reply.json()["error"]["code"])


@pytest.mark.parametrize("path", ["/rollouts/retire", "/rollouts/delete"])
async def test_removal_routes_report_removed_and_absent(harness: Harness, path: str) -> None:
    reply = await harness.post(path, {"rollout_ids": ["r1", "r2", "r1"]})
    assert reply.status_code == 200
    assert reply.json() == {"removed": ["r1"], "absent": ["r2"]}


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": "Bearer wrong"},
        {"authorization": TOKEN},
        {"authorization": f"bearer {TOKEN}"},
    ],
)
async def test_the_token_is_checked_first(harness: Harness, headers: dict[str, str]) -> None:
    for reply in (
        await harness.post("/rollouts/retire", {"nonsense": True}, headers=headers),
        await harness.client.get("/rollouts/r1/manifest", headers=headers),
    ):
        assert reply.status_code == 401 and error_code(reply) == "unauthorized"
    assert harness.ledger.export_rows("r1")


@pytest.mark.parametrize(
    "body",
    [
        {"rollout_ids": []},
        {"rollout_ids": [f"r{i}" for i in range(MAX_LEDGER_BATCH + 1)]},
        {"rollout_ids": ["r1"], "extra": 1},
        {"rollout_ids": "r1"},
        {"rollout_ids": [1]},
        {},
        [],
    ],
)
async def test_malformed_bodies_are_422(harness: Harness, body: Any) -> None:
    reply = await harness.post("/rollouts/retire", body)
    assert reply.status_code == 422 and error_code(reply) == "invalid_request"
    assert harness.ledger.export_rows("r1")


async def test_a_body_that_is_not_json_is_422(harness: Harness) -> None:
    reply = await harness.client.post("/rollouts/delete", content=b"{", headers=AUTH)
    assert reply.status_code == 422 and error_code(reply) == "invalid_request"


async def test_the_largest_batch_is_accepted(harness: Harness) -> None:
    ids = [f"r{i}" for i in range(MAX_LEDGER_BATCH)]
    reply = await harness.post("/rollouts/delete", {"rollout_ids": ids})
    assert reply.status_code == 200 and reply.json()["removed"] == ["r1"]


@pytest.mark.parametrize("path", ["/rollouts/retire", "/rollouts/delete"])
async def test_an_invalid_id_is_400_and_nothing_changes(harness: Harness, path: str) -> None:
    reply = await harness.post(path, {"rollout_ids": ["r1", "no/slash"]})
    assert reply.status_code == 400 and error_code(reply) == "invalid_rollout_id"
    assert harness.ledger.export_rows("r1")


async def test_an_open_checkpoint_refuses_removal_with_409(harness: Harness) -> None:
    harness.checkpoint_open = True
    for path in ("/rollouts/retire", "/rollouts/delete"):
        reply = await harness.post(path, {"rollout_ids": ["r1"]})
        assert reply.status_code == 409 and error_code(reply) == "checkpoint_open"
    assert harness.ledger.export_rows("r1")
    manifest = await harness.client.get("/rollouts/r1/manifest", headers=AUTH)
    assert manifest.status_code == 200  # reads stay allowed
    harness.checkpoint_open = False
    assert (await harness.post("/rollouts/retire", {"rollout_ids": ["r1"]})).status_code == 200


async def test_manifest_route_live_absent_retired_and_invalid(harness: Harness) -> None:
    live = await harness.client.get("/rollouts/r1/manifest", headers=AUTH)
    assert live.status_code == 200 and live.headers["content-type"] == "application/json"
    body = live.json()
    assert live.content == RolloutManifest.model_validate(body).model_dump_json().encode()
    assert body["rollout_id"] == "r1" and [r["model_call_id"] for r in body["records"]] == [
        "call-0"
    ]
    assert "capture_key" not in body["records"][0]
    absent = await harness.client.get("/rollouts/zz/manifest", headers=AUTH)
    assert absent.json() == {"schema_version": 2, "rollout_id": "zz", "records": [], "failures": []}
    await harness.post("/rollouts/retire", {"rollout_ids": ["r1"]})
    retired = await harness.client.get("/rollouts/r1/manifest", headers=AUTH)
    assert retired.status_code == 410 and error_code(retired) == "rollout_retired"
    invalid = await harness.client.get("/rollouts/a%20b/manifest", headers=AUTH)
    assert invalid.status_code == 400 and error_code(invalid) == "invalid_rollout_id"


def test_an_empty_token_is_refused_at_install(tmp_path: Path) -> None:
    ledger = FileCaptureLedger(tmp_path)
    try:
        with pytest.raises(ValueError, match="token"):
            ledger_control_router(ledger, capture_token="")
    finally:
        ledger.close()
