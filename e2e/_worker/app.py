"""The deterministic inference worker as an HTTP server (e2e-contract §2, §4).

Routes: ``POST /v1/completions``, ``POST /ng-control/v1/generation-cut`` (the participants'
:func:`~participants.generation_cut_router`) and ``POST /ng-control/v1/abort`` (bearer token;
installed only when a control token is configured), ``GET /healthz``, ``GET /metrics`` and
FastAPI's ``/openapi.json``. Errors use the project's envelope ``{"error": {"code", "detail"}}``;
the bearer token of every ``/ng-control/`` path is checked before the body is read.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any, Final

import anyio
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)
from starlette.types import ASGIApp, Receive, Scope, Send

from participants import (
    SERVER_TELEMETRY,
    BodyLimit,
    FileTokenStagingStore,
    authorized,
    build_routes,
    error_response,
    error_responses,
    generation_cut_router,
    install_error_envelope,
)
from protocols import (
    ABORT_CALLS_PATH,
    AbortCallsReply,
    AbortCallsRequest,
    CompletionReply,
    CompletionRequest,
    GenerationCutInventory,
    GenerationCutReceipt,
    InternalError,
    StaleAttemptError,
    TokenStagingStore,
    UnauthorizedError,
)

from .._servers.evidence import EvidenceLog, read_evidence
from .engine import WorkerEngine
from .engine_api import EngineOptions
from .engines import DEFAULT_ENGINE, build_engine

CONTROL_ROUTE_PREFIX: Final = "/ng-control/"
DEFAULT_WORKER_PORT: Final = 8701
CONTINUE_WITHOUT_PREFIX: Final = "continue-without-prefix"
"""The worker's fault switch: continued calls decode without their durable prefix."""


@dataclass(frozen=True)
class WorkerSettings:
    """How one worker runs.

    Attributes:
        root: The run root: records are staged under ``<root>/staging/`` and evidence appended to
            ``<root>/evidence/worker.jsonl``.
        seed: The generation seed.
        token_delay_ms: Delay before each generated token.
        cut_timeout_ms: How long a cut round may take; a call its round has not made durable by
            then is acked ``durable_failure``.
        control_token: The bearer token of the cut route; ``None`` installs no control route.
        name: The server's name.
        engine: The inference engine's name in :data:`~e2e._worker.engines.ENGINES`.
        model: The model directory of an engine that loads one.
        dtype: The floating-point type of a model engine.
        max_batch: Most calls a batching engine decodes together.
        fault: The drill fault switch the worker runs with (``continue-without-prefix``).
    """

    root: Path
    seed: int = 0
    token_delay_ms: float = 2.0
    cut_timeout_ms: float = 5000.0
    control_token: str | None = None
    name: str = "worker"
    engine: str = DEFAULT_ENGINE
    model: Path | None = None
    dtype: str = "float64"
    max_batch: int = 64
    fault: str | None = None


class _BearerGuard:
    """Refuses ``/ng-control/`` requests without the right bearer token, before any body is read."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self._token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(CONTROL_ROUTE_PREFIX):
            given: str | None = None
            for name, value in scope["headers"]:
                if name == b"authorization":
                    given = value.decode("latin-1")
            if not authorized(given, self._token):
                refusal = UnauthorizedError("missing or invalid control-plane bearer token")
                await error_response(refusal)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_worker_app(
    settings: WorkerSettings, *, store: TokenStagingStore | None = None
) -> FastAPI:
    """The worker's ASGI app.

    Args:
        settings: How the worker runs.
        store: The staging store; a :class:`~participants.FileTokenStagingStore` under
            ``<root>/staging/`` when omitted (tests inject failing or hanging stores).

    Raises:
        EngineError: ``settings.engine`` names no engine, or its packages are not installed.
    """
    inference = build_engine(
        settings.engine,
        EngineOptions(
            seed=settings.seed,
            token_delay_ms=settings.token_delay_ms,
            model=settings.model,
            dtype=settings.dtype,
            max_batch=settings.max_batch,
        ),
    )
    engine = WorkerEngine(
        store=store or FileTokenStagingStore(settings.root / "staging"),
        evidence=EvidenceLog(worker_evidence_path(settings.root)),
        inference=inference,
        cut_timeout_ms=settings.cut_timeout_ms,
        name=settings.name,
        forget_prefix=settings.fault == CONTINUE_WITHOUT_PREFIX,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        build_routes(app)  # the cut route is built before the first cut round needs it (D440)
        async with inference.running():  # a batching engine's scheduler, for the server's life
            yield

    app = FastAPI(
        title="midflight deterministic inference worker",  # the OpenAPI title, kept as it was
        version=package_version("midflight"),  # as in every participant's document
        docs_url=None,
        redoc_url=None,
        lifespan=lifespan,
        telemetry=SERVER_TELEMETRY,  # a traced cut or completion continues its caller's trace
    )
    app.state.engine = engine
    metrics = WorkerMetrics(engine)
    app.state.metrics_registry = metrics.registry  # the loop watch's families go there (D406)
    app.add_middleware(BodyLimit)  # every route, the cut route included (D241)

    install_error_envelope(app)

    @app.exception_handler(Exception)
    async def bug(request: Request, exc: Exception) -> JSONResponse:
        return error_response(InternalError(f"{type(exc).__name__}: {exc}"[:2000]))

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "name": settings.name, "in_flight": len(engine.live)}

    @app.post(
        "/v1/completions",
        response_model=CompletionReply,
        responses=error_responses((), authenticated=False),
    )
    async def completions(body: CompletionRequest, request: Request) -> CompletionReply:
        # A caller that goes away (a retired or cancelled call) stops the generation (D245).
        outcome: list[CompletionReply | Exception] = []
        async with anyio.create_task_group() as group:
            # The watcher stops inside a scope of its own and ends normally: a task that ends
            # cancelled leaves its error, its frames and anyio's ``task_done`` in a cycle that
            # only the garbage collector frees, once per completion (D414).
            watching = anyio.CancelScope()

            async def until_disconnected() -> None:
                with watching:
                    while (await request.receive())["type"] != "http.disconnect":
                        pass
                    group.cancel_scope.cancel()

            group.start_soon(until_disconnected)
            try:
                outcome.append(await engine.complete(body))
            except Exception as exc:  # raised below, outside the task group's exception group
                outcome.append(exc)
            watching.cancel()
        if not outcome:
            raise StaleAttemptError("the caller went away; the generation was stopped")
        if isinstance(outcome[0], Exception):
            raise outcome[0]
        metrics.completed(len(outcome[0].token_ids))
        return outcome[0]

    @app.get("/metrics", tags=["operations"], response_class=Response)
    async def metrics_route() -> Response:
        """Prometheus metrics: completions, tokens returned, calls generating, cuts."""
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    if settings.control_token:

        async def cut_and_count(inventory: GenerationCutInventory) -> GenerationCutReceipt:
            receipt = await engine.cut(inventory)
            metrics.cut(len(inventory.active_prefixes))
            return receipt

        app.include_router(generation_cut_router(cut_and_count, token=settings.control_token))

        @app.post(ABORT_CALLS_PATH, response_model=AbortCallsReply, responses=error_responses(()))
        async def abort(body: AbortCallsRequest) -> AbortCallsReply:
            """Stop these calls; answers once they have left (nothing more of them is staged)."""
            return AbortCallsReply(aborted=await engine.abort(body.model_call_ids))

        # The cut route checks the token itself; the guard covers every other control path.
        app.add_middleware(_BearerGuard, token=settings.control_token)
    return app


class WorkerMetrics:
    """``/metrics`` of the worker, like every participant's: a registry of its own.

    Args:
        engine: The worker whose calls in flight the gauge reads.
    """

    def __init__(self, engine: WorkerEngine) -> None:
        self.registry = CollectorRegistry()
        self._completions = Counter(
            "midflight_worker_completions",
            "Completions answered.",
            registry=self.registry,
        )
        self._tokens = Counter(
            "midflight_worker_tokens_returned",
            "Tokens in the completions answered (a continued cut's prefix included).",
            registry=self.registry,
        )
        self._cut_requests = Counter(
            "midflight_worker_cut_requests",
            "Generation-cut inventories answered.",
            registry=self.registry,
        )
        self._cut_calls = Counter(
            "midflight_worker_cut_calls",
            "Calls listed in the generation-cut inventories answered.",
            registry=self.registry,
        )
        in_flight = Gauge(
            "midflight_worker_calls_in_flight",
            "Calls generating now.",
            registry=self.registry,
        )
        in_flight.set_function(lambda: len(engine.live))

    def completed(self, tokens: int) -> None:
        """Count one completion answered with ``tokens`` tokens."""
        self._completions.inc()
        self._tokens.inc(tokens)

    def cut(self, calls: int) -> None:
        """Count one inventory answered, listing ``calls`` calls."""
        self._cut_requests.inc()
        self._cut_calls.inc(calls)


def worker_evidence_path(root: Path) -> Path:
    """Where a worker with this run root appends its evidence."""
    return root / "evidence" / "worker.jsonl"


def read_worker_evidence(root: Path) -> list[dict[str, Any]]:
    """The worker's evidence events under ``root`` (for tests and the drill)."""
    return read_evidence(worker_evidence_path(root))
