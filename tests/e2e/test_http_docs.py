"""The reference pages stay true to the servers: every route and every metric is documented.

Each reference server is built in-process (the apps of the hostile-input suite); its OpenAPI
operations must appear in docs/http-routes.md and the metrics its ``/metrics`` exposes in
docs/metrics.md, and neither page may name a route or a metric no server has.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
import yaml
from fastapi import FastAPI
from starlette.routing import Route

from e2e._launch.loop_watch import METRIC_NAMES as LOOP_WATCH_METRICS
from participants import ProcessFanout
from participants._fanout.roster import RosterMetrics

from .hostile import ROLES, fresh_server

pytestmark = pytest.mark.anyio

DOCS = Path(__file__).resolve().parents[2] / "docs"
ROUTE = re.compile(r"`(GET|POST|PUT|PATCH|DELETE) (/[^`\s]*)`")
METRIC = re.compile(r"`(midflight_[a-z_]+)`")


def schema_operations(app: FastAPI) -> set[str]:
    """``"POST /run"`` for every operation of an app's OpenAPI document."""
    paths = app.openapi()["paths"]
    return {f"{method.upper()} {path}" for path, methods in paths.items() for method in methods}


def unlisted_operations(app: FastAPI) -> set[str]:
    """The routes an app leaves out of its OpenAPI document (``GET /openapi.json``)."""
    return {
        f"{method} {route.path}"
        for route in app.routes
        if isinstance(route, Route) and not route.include_in_schema
        for method in route.methods or ()
    }


def test_the_routes_page_lists_every_operation_of_every_reference_server(
    tmp_path: Path,
) -> None:
    page = {
        f"{method} {path}" for method, path in ROUTE.findall((DOCS / "http-routes.md").read_text())
    }
    missing: list[str] = []
    existing: set[str] = set()
    for role in ROLES:
        app = fresh_server(role, tmp_path / role)
        schema = schema_operations(app)
        missing += [f"{role}: {operation}" for operation in sorted(schema - page)]
        existing |= schema | unlisted_operations(app)
    assert not missing, f"routes missing from docs/http-routes.md: {missing}"
    unknown = sorted(page - existing)
    assert not unknown, f"docs/http-routes.md names routes no server has: {unknown}"


async def test_the_metrics_page_lists_every_metric_of_every_reference_server(
    tmp_path: Path,
) -> None:
    page = set(METRIC.findall((DOCS / "metrics.md").read_text()))
    missing: list[str] = []
    exposed: set[str] = set()
    for role in ROLES:
        app = fresh_server(role, tmp_path / role)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://server"
            ) as client,
        ):
            reply = await client.get("/metrics")
        reply.raise_for_status()
        names = set(re.findall(r"^# TYPE (\S+) ", reply.text, re.M))
        # The client library's creation-time samples are not metrics of ours.
        names = {name for name in names if not name.endswith("_created")}
        exposed |= names
        missing += [f"{role}: {name}" for name in sorted(names - page)]
    # A server with several processes adds its roster's families on its main process.
    roster = {
        family.name + ("_total" if family.type == "counter" else "")
        for family in RosterMetrics(ProcessFanout("model", "policy", expected=2)).collect()
    }
    missing += [f"several processes: {name}" for name in sorted(roster - page)]
    exposed |= roster
    # Every process `midflight serve` starts adds its loop watch's families (D406).
    watched = set(LOOP_WATCH_METRICS)
    missing += [f"every served process: {name}" for name in sorted(watched - page)]
    exposed |= watched
    assert not missing, f"metrics missing from docs/metrics.md: {missing}"
    unknown = sorted(page - exposed)
    assert not unknown, f"docs/metrics.md names metrics no server exposes: {unknown}"


def test_the_alert_rules_name_only_documented_metrics_and_parse() -> None:
    page = (DOCS / "metrics.md").read_text()
    block = page.split("## Alert rules", 1)[1].split("```yaml", 1)[1].split("```", 1)[0]
    rules = yaml.safe_load(block)["groups"][0]["rules"]
    assert {rule["alert"] for rule in rules} >= {
        "MidflightCheckpointStuck",
        "MidflightRefusalsRising",
        "MidflightShardLost",
    }
    documented = set(METRIC.findall(page.split("## Alert rules", 1)[0]))
    named = {name for rule in rules for name in re.findall(r"midflight_[a-z_]+", rule["expr"])}
    assert named, "the rules name no metric"
    assert named <= documented, f"rules name undocumented metrics: {sorted(named - documented)}"
