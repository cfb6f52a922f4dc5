"""The capture ledger's control routes under ``/training-token-capture/control``.

``POST /rollouts/retire``, ``POST /rollouts/delete`` and ``GET /rollouts/{rollout_id}/manifest``,
guarded by the capture token. A handler checks, in order: the bearer token (401), the body
(422), an open checkpoint (409, retire and delete only), the ids (400, nothing changed), then
calls the ledger (410 for the manifest of a retired key). The body is parsed here rather than by
FastAPI so that the token is checked before the body and every refusal uses the error envelope
without app-level exception handlers (the policy server mounts this router as it is).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ValidationError

from protocols import (
    LEDGER_CONTROL_PREFIX,
    CaptureLedger,
    CheckpointOpenError,
    InvalidRequestError,
    LedgerBatchRequest,
    RolloutRemoval,
    UnauthorizedError,
    WireError,
    validate_ledger_key,
    validate_ledger_keys,
)

from .._http.router import authorized, error_response, error_responses

CHECKPOINT_OPEN_DETAIL = (
    "a checkpoint is open on this model server; retry ledger retire and delete after it resumes"
)

_BATCH_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": LedgerBatchRequest.model_json_schema()}},
    }
}


def _check_token(request: Request, token: str) -> None:
    if not authorized(request.headers.get("authorization"), token):
        raise UnauthorizedError("missing or invalid capture-ledger bearer token")


def _reply(result: BaseModel) -> Response:
    """``result`` as the JSON body pydantic writes for it, encoded once (D456)."""
    return Response(result.model_dump_json(), media_type="application/json")


async def _batch(request: Request) -> list[str]:
    try:
        body = LedgerBatchRequest.model_validate_json(await request.body())
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in error['loc']) or 'body'}: {error['msg']}"
            for error in exc.errors()[:5]
        )
        raise InvalidRequestError(f"malformed ledger batch: {problems}") from None
    return body.rollout_ids


def ledger_control_router(
    ledger: CaptureLedger,
    *,
    capture_token: str,
    is_checkpoint_open: Callable[[], bool] = lambda: False,
) -> APIRouter:
    """The ledger routes as a router the policy server mounts.

    Args:
        ledger: The capture ledger the routes act on.
        capture_token: The bearer token callers must present (``MIDFLIGHT_CAPTURE_TOKEN``).
        is_checkpoint_open: Reports whether a checkpoint is open on this model server; retire
            and delete are refused (409 ``checkpoint_open``) while it is, because a commit may
            still read any live episode's ledger.

    Raises:
        ValueError: ``capture_token`` is empty.
    """
    if not capture_token:
        raise ValueError("the capture-ledger routes need a non-empty bearer token")
    router = APIRouter(prefix=LEDGER_CONTROL_PREFIX)

    def removal_route(
        operation: Callable[[list[str]], Awaitable[RolloutRemoval]],
    ) -> Callable[[Request], Awaitable[Response]]:
        async def handler(request: Request) -> Response:
            try:
                _check_token(request, capture_token)
                ids = await _batch(request)
                if is_checkpoint_open():
                    raise CheckpointOpenError(CHECKPOINT_OPEN_DETAIL)
                keys = validate_ledger_keys(ids)
                result = await operation(keys)
            except WireError as exc:
                return error_response(exc)
            return _reply(result)

        return handler

    router.add_api_route(
        "/rollouts/retire",
        removal_route(ledger.retire),
        methods=["POST"],
        response_model=RolloutRemoval,
        openapi_extra=_BATCH_BODY,
        responses=error_responses(("invalid_rollout_id", "checkpoint_open")),
        summary="Fence and remove capture ledgers",
    )
    router.add_api_route(
        "/rollouts/delete",
        removal_route(ledger.delete),
        methods=["POST"],
        response_model=RolloutRemoval,
        openapi_extra=_BATCH_BODY,
        responses=error_responses(("invalid_rollout_id", "checkpoint_open")),
        summary="Remove capture ledgers and their fences",
    )

    @router.get(
        "/rollouts/{rollout_id}/manifest",
        summary="The manifest of one capture key",
        responses=error_responses(("invalid_rollout_id", "rollout_retired")),
    )
    async def manifest(rollout_id: str, request: Request) -> Response:
        try:
            _check_token(request, capture_token)
            key = validate_ledger_key(rollout_id)
            result = await ledger.manifest(key)
        except WireError as exc:
            return error_response(exc)
        return _reply(result)

    return router
