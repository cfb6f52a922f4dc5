"""The policy server (``midflight serve model``): model calls captured through the ledger.

The app mounts the data plane of :mod:`e2e._servers.policy_server` (one handler,
:meth:`~e2e._servers.policy_server.PolicyServer.serve`, behind the chat completions, Responses and
Messages routes, each under ``/ng-rollout/<capture_key>/`` and plain), the control routes and the
ledger routes. The capture protocol a call follows (admission, then custody) is the participants'
:func:`participants.resolve_admission` / :func:`participants.record_custody`.

When admission closes, the participant asks the worker (:mod:`e2e._servers.worker_client`) to cut the
calls in flight.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Final

import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from participants import (
    DEFAULT_ADMISSION_WAIT_SECONDS,
    ControlPlane,
    ControlTelemetry,
    FileCaptureLedger,
    ModelParticipant,
    SqliteCaptureLedger,
    error_responses,
    ledger_control_router,
    participant_app,
)
from participants.testing import MODEL_FAULTS
from protocols import CaptureLedger

from .context import ServeContext, active_fault, control_settings
from .evidence import EvidenceLog, read_evidence
from .policy_apis import (
    CHAT_API,
    MESSAGES_API,
    RESPONSES_API,
    ROLLOUT_PREFIX,
    ChatCompletionRequest,
    MessagesRequest,
    ResponsesRequest,
    chat_call,
    messages_call,
    responses_call,
)
from .policy_server import PolicyServer
from .worker_client import HttpCutRequester

MODEL_CALL_ERRORS: Final = error_responses(
    (
        "invalid_rollout_id",
        "stale_attempt",
        "admission_closed",
        "checkpoint_coordinator_unavailable",
    ),
    authenticated=False,
)
"""The refusals of a model call (declared in OpenAPI)."""


def policy_evidence_path(root: Path, name: str = "policy") -> Path:
    """Where the policy server ``name`` with this run root appends its evidence."""
    return root / "evidence" / f"{name}.jsonl"


def read_policy_evidence(
    root: Path, name: str = "policy", event: str = "egress"
) -> list[dict[str, Any]]:
    """The policy server's evidence events of one kind (``egress`` or ``admit``), in order."""
    return [e for e in read_evidence(policy_evidence_path(root, name)) if e.get("event") == event]


LEDGER_LAYOUTS: Final = ("sqlite", "file")
DEFAULT_LEDGER_LAYOUT: Final = "sqlite"
"""The capture ledger's on-disk layout when ``--ledger-layout`` is not given (D340)."""


def open_capture_ledger(directory: Path, layout: str) -> FileCaptureLedger | SqliteCaptureLedger:
    """The capture ledger of a policy server in ``directory``, in ``layout``.

    Raises:
        ValueError: ``layout`` is not one of ``LEDGER_LAYOUTS``.
        LedgerLayoutError: ``directory`` holds the other layout's ledgers.
    """
    if layout == "sqlite":
        return SqliteCaptureLedger(directory)
    if layout == "file":
        return FileCaptureLedger(directory)
    raise ValueError(f"ledger layout must be one of {', '.join(LEDGER_LAYOUTS)}, not {layout!r}")


def create_model_app(
    ctx: ServeContext,
    *,
    ledger: CaptureLedger | None = None,
    worker_url: str | None = None,
    worker_transport: httpx.AsyncBaseTransport | None = None,
    admission_wait_seconds: float | None = None,
    ledger_layout: str = DEFAULT_LEDGER_LAYOUT,
) -> FastAPI:
    """The policy server's app: chat completions, control routes, ledger routes.

    Args:
        ctx: Name, run root, peers and tokens.
        ledger: The capture ledger; by default one of ``ledger_layout`` under ``<root>/ledger/``.
        worker_url: The worker's base URL; the cluster's ``worker`` by default.
        worker_transport: Transport of the worker client (tests).
        admission_wait_seconds: Bound of a call waiting for resume (the gate's default if None).
        ledger_layout: ``sqlite`` (one database file, D340) or ``file`` (a file per key).
    """
    capture = (
        ledger if ledger is not None else open_capture_ledger(ctx.root / "ledger", ledger_layout)
    )
    fault = active_fault()
    requester = HttpCutRequester(ctx.control_token, worker_transport)
    # One registry for the control plane and the cut counter: /metrics shows both.
    telemetry = ControlTelemetry("model", ctx.name)
    participant = ModelParticipant(
        capture,
        ctx.name,
        registry=telemetry.registry,
        faults=[fault] if fault in MODEL_FAULTS else [],
        cut_requester=requester,
        call_aborter=requester.abort,
        admission_wait_seconds=(
            DEFAULT_ADMISSION_WAIT_SECONDS
            if admission_wait_seconds is None
            else admission_wait_seconds
        ),
    )
    server = PolicyServer(
        participant,
        EvidenceLog(policy_evidence_path(ctx.root, ctx.name)),
        worker_url or ctx.peer_url("worker"),
        worker_transport,
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        async with server.running(), requester.running():
            yield

    plane = ControlPlane(participant, settings=control_settings(ctx), telemetry=telemetry)
    app = participant_app(
        plane, token=ctx.control_token, title="midflight policy server", lifespan=lifespan
    )
    app.state.policy = server
    app.state.plane = plane
    if ctx.capture_token:
        app.include_router(
            ledger_control_router(
                capture,
                capture_token=ctx.capture_token,
                is_checkpoint_open=participant.is_checkpoint_open,
            )
        )

    # One handler, three thin adapters, each under the rollout prefix (a call of an episode)
    # and plain (an untagged call: served and gated, never captured).
    @app.post(
        ROLLOUT_PREFIX + CHAT_API.path,
        summary="A chat completion of one episode's attempt",
        responses=MODEL_CALL_ERRORS,
    )
    async def chat_completions(capture_key: str, body: ChatCompletionRequest) -> JSONResponse:
        return await server.serve(capture_key, chat_call(body), CHAT_API)

    @app.post(
        CHAT_API.path,
        summary="An untagged chat completion (captured by no episode)",
        responses=MODEL_CALL_ERRORS,
    )
    async def untagged_chat_completions(body: ChatCompletionRequest) -> JSONResponse:
        return await server.serve(None, chat_call(body), CHAT_API)

    @app.post(
        ROLLOUT_PREFIX + RESPONSES_API.path,
        summary="A response of one episode's attempt",
        responses=MODEL_CALL_ERRORS,
    )
    async def responses(capture_key: str, body: ResponsesRequest) -> JSONResponse:
        return await server.serve(capture_key, responses_call(body), RESPONSES_API)

    @app.post(
        RESPONSES_API.path,
        summary="An untagged response (captured by no episode)",
        responses=MODEL_CALL_ERRORS,
    )
    async def untagged_responses(body: ResponsesRequest) -> JSONResponse:
        return await server.serve(None, responses_call(body), RESPONSES_API)

    @app.post(
        ROLLOUT_PREFIX + MESSAGES_API.path,
        summary="A message of one episode's attempt",
        responses=MODEL_CALL_ERRORS,
    )
    async def messages(capture_key: str, body: MessagesRequest) -> JSONResponse:
        return await server.serve(capture_key, messages_call(body), MESSAGES_API)

    @app.post(
        MESSAGES_API.path,
        summary="An untagged message (captured by no episode)",
        responses=MODEL_CALL_ERRORS,
    )
    async def untagged_messages(body: MessagesRequest) -> JSONResponse:
        return await server.serve(None, messages_call(body), MESSAGES_API)

    return app
