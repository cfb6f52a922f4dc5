"""The drill's controller reads each accepted rollout's manifest as a training controller would:
through ``coordinator.LedgerClient``, whose wire model forbids extra fields (D379)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from pydantic import ValidationError

from coordinator import LedgerClient
from e2e._drill.control import ControlSession
from e2e._servers.cluster import Cluster, ServerEntry
from participants import SqliteCaptureLedger, ledger_control_router
from protocols import LEDGER_CONTROL_PREFIX
from tests.participants.ledger_factory import commit

pytestmark = pytest.mark.anyio
TOKEN = "drill-token"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _session(tmp_path: Path, app: FastAPI) -> ControlSession:
    """A controller's session whose ledger reads go to ``app`` (in process)."""
    url = "http://policy.test"
    cluster = Cluster(tmp_path, (ServerEntry(name="policy", role="model", url=url),))
    session = ControlSession(cluster, TOKEN)
    session._ledger = LedgerClient(
        url, capture_token=TOKEN, transport=httpx.ASGITransport(app=app), attempts=1
    )
    return session


async def test_a_manifest_is_read_as_the_route_answers_it_and_a_retired_one_is_none(
    tmp_path: Path,
) -> None:
    ledger = SqliteCaptureLedger(tmp_path / "ledger")
    app = FastAPI()
    app.include_router(
        ledger_control_router(ledger, capture_token=TOKEN, is_checkpoint_open=lambda: False)
    )
    session = _session(tmp_path, app)
    try:
        await ledger.record(commit("r1", 0, rollout="r1"))
        await ledger.record(commit("r1", 1, rollout="r1"))
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://policy.test"
        ) as raw:
            route = await raw.get(
                f"{LEDGER_CONTROL_PREFIX}/rollouts/r1/manifest",
                headers={"authorization": f"Bearer {TOKEN}"},
            )
        read = await session.ledger_manifest("r1")
        assert read == route.json() and len(read["records"]) == 2  # what the evidence logs
        await ledger.retire(["r1"])
        assert await session.ledger_manifest("r1") is None  # 410: the rollout reruns
    finally:
        await session.aclose()
        ledger.close()


async def test_a_manifest_with_a_field_the_reference_lacks_fails_the_read(tmp_path: Path) -> None:
    app = FastAPI()

    @app.get(f"{LEDGER_CONTROL_PREFIX}/rollouts/{{key}}/manifest")
    async def manifest(key: str) -> dict[str, Any]:
        return {"schema_version": 2, "rollout_id": key, "records": [], "failures": [], "x": 1}

    session = _session(tmp_path, app)
    try:
        with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
            await session.ledger_manifest("r1")
    finally:
        await session.aclose()
