"""Hostile input: schemathesis against the OpenAPI document of every reference server.

Each run builds a fresh in-process cluster for one target role (the target's peers are real apps
too, reached through ``httpx.ASGITransport`` and started with the target's lifespan), loads the
target's ``/openapi.json`` with ``schemathesis.openapi.from_asgi`` and sends every operation
generated requests, valid and invalid, with and without the bearer token. Every reply must pass
:data:`CHECKS`; the failures come back as readable lines (the operation, the check, the request).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import httpx
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.python.asgi import shutdown_lifespans
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from e2e._servers.agent import create_agent_app
from e2e._servers.cluster import default_cluster
from e2e._servers.context import ServeContext
from e2e._servers.environment import create_environment_app
from e2e._servers.model import create_model_app
from e2e._servers.resources import create_resources_app
from e2e._worker.app import WorkerSettings, create_worker_app
from participants import ControlSettings
from protocols import ERRORS_BY_CODE

TOKEN: Final = "hostile-input-token"
ROLES: Final = ("worker", "model", "resources", "agent", "environment")
Role = Literal["worker", "model", "resources", "agent", "environment"]

HOSTILE_CONTROL_SETTINGS: Final = ControlSettings(
    lease_grace_seconds=0.5, max_deadline_seconds=2.0, resume_retry_seconds=0.5
)
"""A short lease and a short deadline horizon: a prepare the fuzzer manages to open (with any
deadline: a far one is capped at the horizon) closes admission for at most ~2.5 s, so the
data-plane routes it shuts keep answering."""
EPISODE_SECONDS: Final = 1.0
"""The environment's per-attempt budget: a generated task of 1000 x 1000 turns ends quickly."""
ADMISSION_WAIT_SECONDS: Final = 3.0
"""How long the policy server holds a call while a fuzzed checkpoint is open."""
MALFORMED_KEYS: Final = (
    "r1-a",
    "r1-a-1",
    "r1-a01",
    "r1-a99999999999999999999999",
    "-a1",
    "r 1",
    "r1-a1-a2",
    "r1\u00e9",
    "x" * 300,
)
"""Capture keys that are almost right: empty attempt, negative, leading zero, huge, no rollout,
a space, two suffixes, non-ASCII, too long (no dot path: the client normalises it away)."""
REQUEST_TIMEOUT_SECONDS: Final = 30.0
"""Deadline of one generated request (a hang is a failure, not a stuck test)."""


def error_envelope(ctx: Any, response: schemathesis.Response, case: schemathesis.Case) -> None:
    """Every 4xx/5xx reply is ``{"error": {"code", "detail"}}`` with a code of the error table
    whose status is the reply's status."""
    if response.status_code < 400:
        return
    try:
        body = json.loads(response.content)
    except ValueError:
        raise AssertionError(f"HTTP {response.status_code} with a body that is not JSON") from None
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or set(error) != {"code", "detail"}:
        raise AssertionError(f"HTTP {response.status_code} without the error envelope: {body!r}")
    spec = ERRORS_BY_CODE.get(error["code"])
    if spec is None:
        raise AssertionError(f"error code {error['code']!r} is not in the error table")
    if spec.http_status != response.status_code:
        raise AssertionError(
            f"{error['code']} belongs with HTTP {spec.http_status}, sent with "
            f"{response.status_code}"
        )
    if not isinstance(error["detail"], str):
        raise AssertionError(f"error.detail is not a string: {error['detail']!r}")


CHECKS: Final[tuple[Callable[..., Any], ...]] = (
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    error_envelope,
)
"""The checks every reply must pass."""


def _server_context(root: Path, name: str) -> ServeContext:
    return ServeContext(name, 0, root, default_cluster(root), TOKEN, TOKEN)


def _with_peer_lifespans(app: FastAPI, peers: list[FastAPI]) -> FastAPI:
    """Start the peers' lifespans inside ``app``'s, on the event loop that serves ``app``."""
    own = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(target: FastAPI) -> AsyncIterator[Any]:
        async with AsyncExitStack() as stack:
            for peer in peers:
                await stack.enter_async_context(peer.router.lifespan_context(peer))
            state = await stack.enter_async_context(own(target))
            yield state

    app.router.lifespan_context = lifespan
    return app


def _shorten(app: FastAPI) -> FastAPI:
    plane = getattr(app.state, "plane", None)
    if plane is not None:
        plane.settings = HOSTILE_CONTROL_SETTINGS
    return app


def fresh_server(role: Role, root: Path) -> FastAPI:
    """A fresh app of ``role`` whose peers are fresh in-process apps (a whole little cluster)."""
    worker = create_worker_app(
        WorkerSettings(root=root, token_delay_ms=0.0, cut_timeout_ms=250.0, control_token=TOKEN)
    )
    if role == "worker":
        return worker
    worker_transport = httpx.ASGITransport(app=worker)
    model = _shorten(
        create_model_app(
            _server_context(root, "policy"),
            worker_transport=worker_transport,
            admission_wait_seconds=ADMISSION_WAIT_SECONDS,
        )
    )
    if role == "model":
        return model
    resources = _shorten(create_resources_app(_server_context(root, "resources")))
    if role == "resources":
        return resources
    agent = _shorten(
        create_agent_app(
            _server_context(root, "agent"),
            transports={
                "model": httpx.ASGITransport(app=model),
                "resources": httpx.ASGITransport(app=resources),
            },
        )
    )
    if role == "agent":
        return _with_peer_lifespans(agent, [model, resources])
    environment = _shorten(
        create_environment_app(
            _server_context(root, "environment"),
            agent_transport=httpx.ASGITransport(app=agent),
            resources_transport=httpx.ASGITransport(app=resources),
            episode_seconds=EPISODE_SECONDS,
        )
    )
    return _with_peer_lifespans(environment, [model, resources, agent])


@dataclass
class FuzzReport:
    """What one run sent and what failed."""

    role: str
    authenticated: bool
    requests: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line per failure, or a one-line tally."""
        head = (
            f"{self.role} ({'with' if self.authenticated else 'without'} token): "
            f"{self.requests} requests, statuses {dict(sorted(self.statuses.items()))}"
        )
        return "\n".join([head, *self.failures])


def steer(
    case: schemathesis.Case, *, near_deadline: bool, bad_key: str | None, root: Path
) -> schemathesis.Case:
    """Keep a generated control call inside the run and, half the time, inside the horizon.

    A ``checkpoint_dir`` is any absolute path to the server, so a fuzzed commit could write
    records anywhere on the machine: it is moved under ``root``. A random ``deadline_ts`` is
    almost always in the past or beyond the horizon; half the cases get one 1.5 s ahead so that
    prepare, commit and restore also run, not only their refusals. A third of the cases with a
    capture key (or ledger key) in their path get one of :data:`MALFORMED_KEYS` instead: random
    text rarely looks like a key closely enough to reach the key parser's corners.
    """
    for name in ("capture_key", "rollout_id"):
        if bad_key is not None and case.path_parameters and name in case.path_parameters:
            case.path_parameters[name] = bad_key
    body = case.body
    if isinstance(body, dict):
        directory = body.get("checkpoint_dir")
        if isinstance(directory, str) and directory.startswith("/"):
            body["checkpoint_dir"] = str(root / "checkpoints" / directory.strip("/")[:80])
        if near_deadline and isinstance(body.get("deadline_ts"), int | float):
            body["deadline_ts"] = time.time() + 1.5
    return case


def fuzz(
    app: FastAPI,
    *,
    root: Path,
    role: str,
    authenticated: bool,
    examples: int,
    run_seed: int = 0,
) -> FuzzReport:
    """Send every operation of ``app``'s OpenAPI document ``examples`` generated requests per
    generation mode (valid and invalid data) and check every reply.

    Args:
        app: A fresh server app; its lifespan is started here and stopped before returning.
        root: The run root of the app (fuzzed checkpoint directories are kept under it).
        role: For the report.
        authenticated: Whether requests carry ``Authorization: Bearer <TOKEN>``.
        examples: Generated requests per operation and mode.
        run_seed: The hypothesis seed (a failure names it so it can be replayed).
    """
    report = FuzzReport(role, authenticated)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    headers = {"authorization": f"Bearer {TOKEN}"} if authenticated else {}
    try:
        for result in schema.get_all_operations():
            operation = result.ok()
            cases = st.one_of(
                operation.as_strategy(generation_mode=schemathesis.GenerationMode.POSITIVE),
                operation.as_strategy(generation_mode=schemathesis.GenerationMode.NEGATIVE),
            )
            strategy = st.builds(
                lambda case, near, key: steer(case, near_deadline=near, bad_key=key, root=root),
                cases,
                st.booleans(),
                st.one_of(st.none(), st.none(), st.sampled_from(MALFORMED_KEYS)),
            )
            _fuzz_operation(operation.label, strategy, headers, report, examples, run_seed)
    finally:
        shutdown_lifespans()
    return report


def _fuzz_operation(
    label: str,
    strategy: st.SearchStrategy[schemathesis.Case],
    headers: dict[str, str],
    report: FuzzReport,
    examples: int,
    run_seed: int,
) -> None:
    seen: set[tuple[str, int]] = set()

    @seed(run_seed)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def send(case: schemathesis.Case) -> None:
        started = time.monotonic()
        response = case.call(headers=headers, timeout=REQUEST_TIMEOUT_SECONDS)
        report.requests += 1
        report.statuses[response.status_code] = report.statuses.get(response.status_code, 0) + 1
        try:
            case.validate_response(response, checks=list(CHECKS), headers=headers)
        except (AssertionError, FailureGroup) as error:
            failures = error.exceptions if isinstance(error, FailureGroup) else (error,)
            for failure in failures:
                title = str(getattr(failure, "title", type(failure).__name__))
                if (title, response.status_code) in seen:
                    continue
                seen.add((title, response.status_code))
                message = str(getattr(failure, "message", failure)).strip().splitlines()[:4]
                report.failures.append(
                    f"  {label}: {title} (HTTP {response.status_code}, "
                    f"{time.monotonic() - started:.1f}s, seed {run_seed})\n"
                    f"    {case.as_curl_command(headers=headers)}\n    " + "\n    ".join(message)
                )

    send()
