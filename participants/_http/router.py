"""HTTP for the control plane: the authenticated router, the error envelope, the server app.

Every control route checks the bearer token first — before the body is read — in constant time,
and answers every error, validation errors included, as ``{"error": {"code", "detail"}}``. Every
route of a server app refuses a body over its limit with ``413 request_too_large`` before the
body is parsed (:class:`BodyLimit`).
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Final

import structlog
from fastapi import APIRouter, FastAPI, Request, Response, Security
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from protocols import (
    CONTROL_PREFIX,
    ERRORS_BY_CODE,
    CheckpointRequest,
    CommitReply,
    CommitRequest,
    ErrorEnvelope,
    ForgetReply,
    ForgetRequest,
    InternalError,
    InvalidRequestError,
    PrepareReply,
    RenewReply,
    RestoreReply,
    RestoreRequest,
    ResumeReply,
    RetireReply,
    RetireRequest,
    StatusReply,
    UnauthorizedError,
    WireError,
)

from .._runtime.collector import collector_paused
from .._runtime.plane import ControlPlane
from .._tracing import SERVER_TELEMETRY
from .body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimit
from .json_body import json_body_model, prevalidating

_log = structlog.get_logger("midflight.http")

_BEARER_SCHEME = HTTPBearer(auto_error=False, description="The control token.")

ROUTE_ERROR_CODES: Final[dict[str, tuple[str, ...]]] = {
    "status": ("unauthorized", "internal_error"),
    "prepare": ("stale_checkpoint", "checkpoint_conflict", "invalid_phase"),
    "renew": ("stale_checkpoint", "checkpoint_conflict", "invalid_phase"),
    "commit": (
        "invalid_checkpoint_state",
        "stale_checkpoint",
        "checkpoint_conflict",
        "invalid_phase",
        "deadline_exceeded",
        "restart_in_scope",
    ),
    "restore": (
        "invalid_checkpoint_state",
        "stale_checkpoint",
        "checkpoint_conflict",
        "invalid_phase",
        "deadline_exceeded",
        "checkpoint_error",
    ),
    "resume": ("checkpoint_conflict", "deadline_exceeded"),
    "retire": ("checkpoint_conflict", "invalid_phase", "deadline_exceeded"),
    "forget": ("checkpoint_conflict", "invalid_phase", "deadline_exceeded", "retire_incomplete"),
}
"""Codes each control route may answer, besides 401, 422 and 500 (declared in OpenAPI)."""


def error_response(error: WireError) -> JSONResponse:
    """The envelope reply for ``error``."""
    return JSONResponse(error.envelope(), status_code=error.http_status)


def describe_validation_error(exc: RequestValidationError) -> str:
    """A one-line account of what failed validation, for the ``detail`` field."""
    parts = []
    for error in exc.errors()[:10]:
        location = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
        parts.append(f"{location or 'body'}: {error.get('msg', 'invalid')}")
    return "; ".join(parts) or "the request is invalid"


def unreadable_body_error(exc: HTTPException) -> WireError | None:
    """The typed error of a request the framework refused before our handler ran, if any.

    FastAPI raises ``HTTPException(400)`` when a body is not JSON (or not UTF-8): that is a body
    that fails validation, ``invalid_request``. Other statuses (404, 405 of the router) have no
    row in the error table and keep the framework's reply.
    """
    if exc.status_code in (400, 422):
        return InvalidRequestError(f"the body could not be read: {exc.detail}")
    return None


def error_responses(
    codes: Iterable[str], *, authenticated: bool = True
) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for the given codes plus 422 and 500, grouped by status.

    Args:
        codes: The codes the route may answer besides the ones always declared.
        authenticated: Whether the route checks a bearer token (then 401 is declared too).
    """
    always = ("unauthorized", "invalid_request") if authenticated else ("invalid_request",)
    by_status: dict[int, list[str]] = {}
    for code in (*always, *codes, "internal_error"):
        spec = ERRORS_BY_CODE[code]
        by_status.setdefault(spec.http_status, [])
        if code not in by_status[spec.http_status]:
            by_status[spec.http_status].append(code)
    return {
        status: {"model": ErrorEnvelope, "description": "error codes: " + ", ".join(codes_)}
        for status, codes_ in sorted(by_status.items())
    }


def authorized(header: str | None, token: str) -> bool:
    """Whether an Authorization header is exactly ``Bearer <token>`` (constant-time compare)."""
    expected = f"Bearer {token}".encode()
    return hmac.compare_digest((header or "").encode(), expected)


def authenticated_route_class(token: str) -> type[APIRoute]:
    """A route class that checks the bearer token first and speaks only in envelopes.

    Raises:
        ValueError: The token is empty: the routes would be open to anyone.
    """
    if not token:
        raise ValueError("refusing to install control routes with an empty token")

    class AuthenticatedRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()
            body_model = json_body_model(self)
            if body_model is not None:
                handler = prevalidating(handler, body_model)

            async def guarded(request: Request) -> Response:
                if not authorized(request.headers.get("authorization"), token):
                    return error_response(UnauthorizedError("missing or wrong bearer token"))
                if request.url.path.endswith(BATCH_ROUTES):
                    # Parsing a scope of thousands of episode ids allocates enough to set off
                    # full collections of the whole heap before the restore's own pause (D271).
                    with collector_paused():
                        return await envelope_errors(handler, request)
                return await envelope_errors(handler, request)

            return guarded

    return AuthenticatedRoute


async def envelope_errors(
    handler: Callable[[Request], Awaitable[Response]], request: Request
) -> Response:
    """Run ``handler``; turn every error it raises into the envelope."""
    try:
        return await handler(request)
    except RequestValidationError as exc:
        return error_response(InvalidRequestError(describe_validation_error(exc)))
    except WireError as exc:
        return error_response(exc)
    except HTTPException as exc:
        refusal = unreadable_body_error(exc)
        if refusal is None:
            raise
        return error_response(refusal)
    except Exception as exc:
        _log.exception("http.unhandled_error", path=request.url.path)
        return error_response(
            InternalError(f"{type(exc).__name__} while serving {request.url.path}")
        )


BATCH_ROUTES: Final = ("/checkpoint/restore", "/checkpoint/commit")
"""Control routes whose body names a whole scope: parsed and served with the collector paused."""


def control_router(plane: ControlPlane, token: str) -> APIRouter:
    """The eight routes under ``/ng-control/v1/checkpoint``, guarded by ``token``."""
    router = APIRouter(
        prefix=CONTROL_PREFIX,
        route_class=authenticated_route_class(token),
        tags=["checkpoint control"],
        # Declares the bearer scheme in OpenAPI; the route class has already checked it.
        dependencies=[Security(_BEARER_SCHEME)],
    )

    def responses(operation: str) -> dict[int | str, dict[str, Any]]:
        return error_responses(ROUTE_ERROR_CODES[operation])

    @router.get("/status", response_model=StatusReply, responses=responses("status"))
    async def status() -> StatusReply:
        """Phase, lease, retire marks and readiness; also how coordinators discover us."""
        return await plane.status()

    @router.post("/prepare", response_model=PrepareReply, responses=responses("prepare"))
    async def prepare(body: CheckpointRequest) -> PrepareReply:
        """Close admission and wait until every episode is parked, or the deadline."""
        return await plane.prepare(body)

    @router.post("/renew", response_model=RenewReply, responses=responses("renew"))
    async def renew(body: CheckpointRequest) -> RenewReply:
        """Extend the lease of the active checkpoint."""
        return await plane.renew(body)

    @router.post("/commit", response_model=CommitReply, responses=responses("commit"))
    async def commit(body: CommitRequest) -> CommitReply:
        """Export the parked work once and publish records and manifest."""
        return await plane.commit(body)

    @router.post("/restore", response_model=RestoreReply, responses=responses("restore"))
    async def restore(body: RestoreRequest) -> RestoreReply:
        """Install a checkpoint's records under their next attempts, all or nothing."""
        return await plane.restore(body)

    @router.post("/resume", response_model=ResumeReply, responses=responses("resume"))
    async def resume(body: CheckpointRequest) -> ResumeReply:
        """Reopen admission (also aborts an unpublished checkpoint)."""
        return await plane.resume(body)

    @router.post("/retire", response_model=RetireReply, responses=responses("retire"))
    async def retire(body: RetireRequest) -> RetireReply:
        """Refuse, stop and free attempts; they stay refused until forget."""
        return await plane.retire(body)

    @router.post("/forget", response_model=ForgetReply, responses=responses("forget"))
    async def forget(body: ForgetRequest) -> ForgetReply:
        """Remove the retire marks of finished rollouts."""
        return await plane.forget(body)

    return router


def install_error_envelope(app: FastAPI) -> None:
    """Make the app's own routes (the data plane) answer errors in the envelope too."""

    async def on_midflight_error(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, WireError)
        return error_response(exc)

    async def on_validation_error(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return error_response(InvalidRequestError(describe_validation_error(exc)))

    async def on_http_exception(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        refusal = unreadable_body_error(exc)
        if refusal is None:
            return await http_exception_handler(request, exc)
        return error_response(refusal)

    app.add_exception_handler(WireError, on_midflight_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(HTTPException, on_http_exception)


_NO_ROUTE_SCOPE: Final[dict[str, Any]] = {
    "type": "http",
    "method": "GET",
    "path": "/.no-such-route",
    "root_path": "",
    "query_string": b"",
    "headers": [],
}


def build_routes(app: FastAPI) -> None:
    """Have FastAPI build every route's validators and serializers now, before any request.

    FastAPI builds an included router's routes (a ``TypeAdapter`` per body, reply and error
    model) the first time a request passes through that router. A fresh server's first control
    call, the restore after a crash or the prepare of its first checkpoint, paid for all eight
    control routes: about 14 ms per participant, four times over in one process (D440).
    Matching a path that no route has walks every router, and so builds them; a route added
    later is built at its first request, as before.
    """
    for route in app.router.routes:
        route.matches(dict(_NO_ROUTE_SCOPE))


def participant_app(
    plane: ControlPlane,
    *,
    token: str | None,
    title: str | None = None,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """A server app for one participant: control routes, ``/healthz``, ``/metrics``.

    Args:
        plane: The participant's control plane; it runs for the app's lifetime.
        token: The control token. ``None`` installs no control route (checkpointing off);
            an empty string is refused.
        title: The OpenAPI title; ``"<kind> participant"`` by default.
        lifespan: The server's own start-up and shut-down (its data plane), run inside the
            control plane's lifetime.
        max_body_bytes: Every route refuses a larger body with ``413 request_too_large``.
    """
    participant = plane.participant

    @asynccontextmanager
    async def run(app: FastAPI) -> AsyncIterator[None]:
        build_routes(app)  # every route is complete by now: the server's own were added too
        async with plane.running():
            if lifespan is None:
                yield
            else:
                async with lifespan(app):
                    yield

    app = FastAPI(
        title=title or f"midflight {participant.kind} participant",
        lifespan=run,
        telemetry=SERVER_TELEMETRY,
    )
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    install_error_envelope(app)
    if token is not None:
        app.include_router(control_router(plane, token))

    @app.get("/healthz", tags=["operations"])
    async def healthz() -> dict[str, str]:
        """Liveness: answers whenever the server process runs."""
        return {
            "status": "ok",
            "kind": participant.kind,
            "instance": participant.instance,
            "phase": plane.phase.value,
        }

    @app.get("/metrics", tags=["operations"], response_class=Response)
    async def metrics() -> Response:
        """Prometheus metrics of the control plane."""
        return Response(generate_latest(plane.telemetry.registry), media_type=CONTENT_TYPE_LATEST)

    return app
