"""Hostile input: a bounded schemathesis run against every reference server's OpenAPI document.

Each case builds a fresh in-process cluster (see :mod:`tests.e2e.hostile`), sends every operation
generated valid and invalid requests with and without the bearer token, and requires every reply
to pass the checks :data:`tests.e2e.hostile.CHECKS` names: ``not_a_server_error``,
``status_code_conformance``, ``content_type_conformance``, ``response_schema_conformance`` and
``error_envelope`` (every 4xx/5xx is ``{"error": {"code", "detail"}}`` with a code of the error
table sent with that code's status). The soak tier runs many more examples.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from .hostile import ROLES, FuzzReport, Role, fresh_server, fuzz

FAST_EXAMPLES = 6
"""Generated requests per operation and generation mode in the fast tier."""
SOAK_EXAMPLES = 150


def _run(role: Role, tmp_path: Path, *, authenticated: bool, examples: int) -> FuzzReport:
    report = fuzz(
        fresh_server(role, tmp_path),
        root=tmp_path,
        role=role,
        authenticated=authenticated,
        examples=examples,
    )
    print(report.summary())  # the tally shows in -rA / on failure; the failures name the seed
    return report


@pytest.mark.parametrize("authenticated", [True, False], ids=["token", "no-token"])
@pytest.mark.parametrize("role", ROLES)
def test_no_reply_to_generated_input_is_a_5xx_or_outside_its_schema(
    role: Role, authenticated: bool, tmp_path: Path
) -> None:
    report = _run(role, tmp_path, authenticated=authenticated, examples=FAST_EXAMPLES)
    assert not report.failures, report.summary()
    # The run must have reached the handlers, not only the validators and the token check.
    assert report.statuses.get(200, 0) > 0, report.summary()
    if authenticated and role != "worker":
        assert report.statuses.get(422, 0) > 0, report.summary()
    if not authenticated:
        assert report.statuses.get(401, 0) > 0, report.summary()


@pytest.mark.soak
@pytest.mark.timeout(1800)  # 150 cases per operation: the policy server alone has dozens of them
@pytest.mark.parametrize("authenticated", [True, False], ids=["token", "no-token"])
@pytest.mark.parametrize("role", ROLES)
def test_many_generated_requests_soak(role: Role, authenticated: bool, tmp_path: Path) -> None:
    report = _run(role, tmp_path, authenticated=authenticated, examples=SOAK_EXAMPLES)
    assert not report.failures, report.summary()


class _Arg(BaseModel):
    model_config = ConfigDict(extra="forbid")
    arg: int


def _flawed_app() -> FastAPI:
    """A server with the two faults the suite exists to catch."""
    app = FastAPI(title="flawed")

    @app.post("/divide")
    async def divide(body: _Arg) -> JSONResponse:
        try:
            return JSONResponse({"value": 1 / (body.arg % 2)})
        except ZeroDivisionError:  # an even arg: the bug a real server reports as an enveloped 500
            error = {"code": "internal_error", "detail": "ZeroDivisionError"}
            return JSONResponse({"error": error}, status_code=500)

    @app.post("/refuse")
    async def refuse(body: _Arg) -> JSONResponse:
        # A 409 the schema does not declare, in a body that is not the envelope.
        return JSONResponse({"detail": "no"}, status_code=409)

    return app


def test_the_suite_reports_a_server_error_and_an_undeclared_refusal(tmp_path: Path) -> None:
    report = fuzz(_flawed_app(), root=tmp_path, role="flawed", authenticated=False, examples=30)
    failures = "\n".join(report.failures)
    assert "POST /divide: Server error (HTTP 500" in failures
    assert "POST /refuse: Undocumented status code (HTTP 409" in failures
    assert "POST /refuse: Custom check failed: `error_envelope` (HTTP 409" in failures
