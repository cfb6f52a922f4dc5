"""A control call one shard received over HTTP, run by the fan-out's control plane."""

from __future__ import annotations

import json
from typing import Any, Final

from pydantic import BaseModel, ValidationError

from protocols import (
    CheckpointRequest,
    CommitRequest,
    ForgetRequest,
    InvalidRequestError,
    RestoreRequest,
    RetireRequest,
)

from .._runtime.plane import ControlPlane
from .messages import Control

CONTROL_BODIES: Final[dict[str, type[BaseModel] | None]] = {
    "status": None,
    "prepare": CheckpointRequest,
    "renew": CheckpointRequest,
    "commit": CommitRequest,
    "restore": RestoreRequest,
    "resume": CheckpointRequest,
    "retire": RetireRequest,
    "forget": ForgetRequest,
}
"""Control operations a shard may relay, and the body each one takes."""


async def relay_control(plane: ControlPlane, message: Control) -> dict[str, Any]:
    """Run one relayed control call; the reply body as JSON data.

    Raises:
        InvalidRequestError: The operation is unknown, or its body fails validation.
    """
    operation = message.operation
    if operation not in CONTROL_BODIES:
        raise InvalidRequestError(f"unknown control operation {operation!r}")
    model = CONTROL_BODIES[operation]
    if model is None:
        return (await plane.status()).model_dump(mode="json")
    try:
        request = model.model_validate_json(message.body or "")
    except ValidationError as exc:
        first = exc.errors()[0] if exc.errors() else {"msg": "invalid"}
        location = ".".join(str(p) for p in first.get("loc", ()))
        raise InvalidRequestError(f"{location or 'body'}: {first.get('msg')}") from None
    method = getattr(plane, operation)
    reply: BaseModel = await method(request)
    parsed: dict[str, Any] = json.loads(reply.model_dump_json())
    return parsed
