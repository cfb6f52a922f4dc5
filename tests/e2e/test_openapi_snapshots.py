"""The reference worker's and policy server's OpenAPI documents are snapshotted: a wire change
shows up as a reviewed diff (regenerate with ``MIDFLIGHT_UPDATE_GOLDEN=1``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from e2e._servers.cluster import default_cluster
from e2e._servers.context import ServeContext
from e2e._servers.model import create_model_app
from e2e._worker.app import WorkerSettings, create_worker_app

GOLDEN = Path(__file__).parent.parent / "golden" / "openapi"
TOKEN = "snapshot-token"


def _worker_document(root: Path) -> dict[str, Any]:
    return create_worker_app(WorkerSettings(root=root, control_token=TOKEN)).openapi()


def _policy_document(root: Path) -> dict[str, Any]:
    ctx = ServeContext("policy", 0, root, default_cluster(root), TOKEN, TOKEN)
    return create_model_app(ctx).openapi()


@pytest.mark.parametrize(
    ("name", "document_of"), [("worker", _worker_document), ("policy", _policy_document)]
)
def test_the_openapi_document_is_snapshotted(tmp_path: Path, name: str, document_of: Any) -> None:
    document = document_of(tmp_path)
    golden = GOLDEN / f"{name}.json"
    if os.environ.get("MIDFLIGHT_UPDATE_GOLDEN") == "1":
        golden.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
    assert document == json.loads(golden.read_text()), (
        f"the {name}'s wire changed: review the diff, then regenerate with MIDFLIGHT_UPDATE_GOLDEN=1"
    )
