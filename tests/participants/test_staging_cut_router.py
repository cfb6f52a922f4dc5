"""The generation-cut route a worker mounts: bearer first, inventory in, receipt out."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI

from participants import generation_cut_router
from protocols import (
    GENERATION_CUT_PATH,
    GenerationCutInventory,
    GenerationCutPrefix,
    GenerationCutPrefixAck,
    GenerationCutReceipt,
)

pytestmark = pytest.mark.anyio
TOKEN = "worker-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
PREFIX = GenerationCutPrefix(
    ticket_id="t1", rollout_id="r1", attempt=0, model_call_id="c1", admitted_at=1.5
)
INVENTORY = GenerationCutInventory.build(
    checkpoint_id="ckpt-1", server_name="policy", active_prefixes=[PREFIX]
)


class RecordingCutter:
    """Acks every listed call ``durable_failure`` and remembers the inventories it was given."""

    def __init__(self) -> None:
        self.inventories: list[GenerationCutInventory] = []

    async def __call__(self, inventory: GenerationCutInventory) -> GenerationCutReceipt:
        self.inventories.append(inventory)
        return GenerationCutReceipt(
            checkpoint_id=inventory.checkpoint_id,
            cut_id="cut-1",
            inventory_digest=inventory.inventory_digest,
            inventory=inventory,
            backend_snapshot_id="worker/cut-1",
            prefixes=[GenerationCutPrefixAck.failure(p) for p in inventory.active_prefixes],
        )


def worker_app(cutter: RecordingCutter) -> FastAPI:
    """A bare app of a worker author's: nothing but the router mounted."""
    app = FastAPI()
    app.include_router(generation_cut_router(cutter, token=TOKEN))
    return app


async def _post(app: FastAPI, content: bytes, headers: dict[str, str]) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://worker") as client:
        return await client.post(
            GENERATION_CUT_PATH,
            content=content,
            headers={"content-type": "application/json", **headers},
        )


async def test_the_inventory_goes_to_the_cutter_and_its_receipt_comes_back() -> None:
    cutter = RecordingCutter()
    reply = await _post(worker_app(cutter), INVENTORY.model_dump_json().encode(), AUTH)
    assert reply.status_code == 200, reply.text
    assert cutter.inventories == [INVENTORY]
    receipt = GenerationCutReceipt.model_validate_json(reply.content)
    receipt.validate_for(INVENTORY)
    assert receipt.cut_id == "cut-1"


@pytest.mark.parametrize(
    "headers", [{}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN}]
)
async def test_the_bearer_token_is_checked_before_the_body(headers: dict[str, str]) -> None:
    cutter = RecordingCutter()
    reply = await _post(worker_app(cutter), b"not json", headers)
    assert reply.status_code == 401
    assert reply.json()["error"]["code"] == "unauthorized"
    assert cutter.inventories == []


@pytest.mark.parametrize(
    "content",
    [b"not json", b"{}", INVENTORY.model_dump_json().replace("ckpt-1", "ckpt-2").encode()],
)
async def test_a_body_that_is_not_an_inventory_is_invalid_request(content: bytes) -> None:
    cutter = RecordingCutter()
    reply = await _post(worker_app(cutter), content, AUTH)
    assert reply.status_code == 422
    assert reply.json()["error"]["code"] == "invalid_request"
    assert cutter.inventories == []


def test_an_empty_token_is_refused() -> None:
    with pytest.raises(ValueError, match="empty token"):
        generation_cut_router(RecordingCutter(), token="")


def test_the_route_declares_its_receipt_and_refusals() -> None:
    document = worker_app(RecordingCutter()).openapi()
    operation = document["paths"][GENERATION_CUT_PATH]["post"]
    assert operation["operationId"] == "generation_cut_ng_control_v1_generation_cut_post"
    assert {"200", "401", "422", "500"} <= set(operation["responses"])
    assert operation["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/GenerationCutReceipt"
    }
