"""A route's JSON body validated straight from its bytes, in one pydantic call (D450).

FastAPI reads a JSON body with ``json.loads`` and then validates the Python objects that made,
which at thousands of episode ids costs about half as much again as pydantic validating the
bytes themselves. :func:`prevalidating` validates the bytes first and hands FastAPI the model,
which it takes as it is. A body that does not validate this way is left to FastAPI's own parse,
so every refusal, and its detail, is the one FastAPI has always given.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError


def json_body_model(route: APIRoute) -> type[BaseModel] | None:
    """The model of ``route``'s body, where prevalidating it saves work; else ``None``.

    That is where the whole body is one pydantic model without model validators. FastAPI
    validates the instance it is handed again, and a model validator (before, after or wrap)
    runs again on an instance, where field validation does not: the generation-cut inventory's
    digest check would run twice (D450).
    """
    params = route.dependant.body_params
    if len(params) != 1 or route._embed_body_fields:
        return None
    model = params[0].field_info.annotation
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return None
    if model.__pydantic_decorators__.model_validators:
        return None
    return model


def prevalidating(
    handler: Callable[[Request], Awaitable[Response]], model: type[BaseModel]
) -> Callable[[Request], Coroutine[Any, Any, Response]]:
    """``handler``, with each request's body prevalidated as ``model`` first."""

    async def prevalidated(request: Request) -> Response:
        await _prevalidate(request, model)
        return await handler(request)

    return prevalidated


async def _prevalidate(request: Request, model: type[BaseModel]) -> None:
    """Validate ``request``'s body as ``model`` from its bytes, where it validates.

    FastAPI asks the request for its JSON only when the content type says JSON and the body is
    not empty, and validates what it gets; an instance of the model passes that validation as it
    is. So the model is cached where Starlette caches a request's parsed JSON. A body that does
    not validate is not cached: FastAPI parses and refuses it as it always has.
    """
    body = await request.body()
    try:
        parsed = model.model_validate_json(body)
    except ValidationError:
        return
    request._json = parsed  # Starlette's cache of ``Request.json()``
