"""Control bodies validated from their bytes (D450): taken where valid, refused as before."""

from __future__ import annotations

import json
import types
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import starlette.requests
from fastapi.routing import APIRoute
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from participants import ControlPlane, ManualClock, generation_cut_router, participant_app
from participants._http.json_body import json_body_model
from participants._http.router import control_router
from protocols import (
    CONTROL_PREFIX,
    CheckpointRequest,
    CommitRequest,
    ForgetRequest,
    GenerationCutInventory,
    RestoreRequest,
    RetireRequest,
)

from .fakes import FakeParticipant
from .runtime_support import NOW
from .test_http import TOKEN, VALID_BODY
from .test_staging_cut_router import RecordingCutter

pytestmark = pytest.mark.anyio
HEADERS = {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"}


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    plane = ControlPlane(FakeParticipant(), clock=ManualClock(NOW))
    transport = httpx.ASGITransport(app=participant_app(plane, token=TOKEN))
    async with plane.running(), httpx.AsyncClient(transport=transport, base_url="http://p") as c:
        yield c


@pytest.fixture
def no_json_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starlette's ``json.loads`` fails: a body FastAPI parses itself comes back 422."""

    def refuse(_body: bytes) -> Any:
        raise RuntimeError("json.loads was called")

    monkeypatch.setattr(starlette.requests, "json", types.SimpleNamespace(loads=refuse))


async def _post(http: httpx.AsyncClient, route: str, body: dict[str, Any]) -> httpx.Response:
    return await http.post(f"{CONTROL_PREFIX}/{route}", json=body, headers=HEADERS)


@pytest.mark.usefixtures("no_json_loads")
async def test_every_valid_control_body_is_served_without_json_loads(
    http: httpx.AsyncClient, tmp_path: Path
) -> None:
    assert (await _post(http, "prepare", VALID_BODY["prepare"])).status_code == 200
    assert (await _post(http, "renew", VALID_BODY["renew"])).status_code == 200
    commit = {**VALID_BODY["commit"], "checkpoint_dir": str(tmp_path), "episode_ids": []}
    assert (await _post(http, "commit", commit)).status_code == 200
    assert (await _post(http, "resume", VALID_BODY["resume"])).status_code == 200
    for route in ("retire", "forget"):
        reply = await _post(http, route, VALID_BODY[route])
        assert reply.status_code == 200, reply.text
    restore = {**VALID_BODY["restore"], "checkpoint_dir": str(tmp_path)}
    reply = await _post(http, "restore", restore)
    assert reply.status_code != 422, reply.text  # refused by the restore, not by the parse


async def test_a_body_that_fails_validation_keeps_fastapis_refusal(
    http: httpx.AsyncClient,
) -> None:
    body = {"checkpoint_id": "c1", "deadline_ts": "soon"}
    reply = await _post(http, "prepare", body)
    assert reply.status_code == 422
    detail = reply.json()["error"]["detail"]
    assert detail.startswith("deadline_ts: ") and "body" not in detail
    malformed = await http.post(
        f"{CONTROL_PREFIX}/prepare", content=b'{"checkpoint_id": ', headers=HEADERS
    )
    assert malformed.status_code == 422
    assert malformed.json()["error"]["code"] == "invalid_request"


async def test_a_body_that_is_not_declared_json_is_still_refused(
    http: httpx.AsyncClient,
) -> None:
    reply = await http.post(
        f"{CONTROL_PREFIX}/prepare",
        content=json.dumps(VALID_BODY["prepare"]).encode(),
        headers={**HEADERS, "content-type": "text/plain"},
    )
    assert reply.status_code == 422 and reply.json()["error"]["code"] == "invalid_request"


def _prevalidated_models() -> set[type[BaseModel]]:
    """The body models the control routes, and the worker's generation-cut route, prevalidate."""
    plane = ControlPlane(FakeParticipant(), clock=ManualClock(NOW))
    routers = [control_router(plane, TOKEN), generation_cut_router(RecordingCutter(), token=TOKEN)]
    return {
        model
        for router in routers
        for route in router.routes
        if isinstance(route, APIRoute) and (model := json_body_model(route)) is not None
    }


def test_a_body_with_a_model_validator_is_left_to_fastapi() -> None:
    # FastAPI runs a model validator again on the instance it is handed, so the inventory's
    # digest would be checked twice (pinned in tests/e2e/test_worker.py); every other control
    # body is prevalidated, and is what the property below covers.
    assert GenerationCutInventory.__pydantic_decorators__.model_validators
    assert _prevalidated_models() == set(_MODELS)


# Values of every kind a request's fields might be sent, valid or not.
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(["c1", "r-1", "a", "", "../c", "bad id", "r1-a3", "/tmp/x", "1.5"]),
    st.text(max_size=8),
)


def _mostly(valid: st.SearchStrategy[Any], other: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``valid`` four times in five, else ``other``: bodies near the edge of validity."""
    return st.integers(0, 4).flatmap(lambda n: other if n == 0 else valid)


_EPISODE = st.fixed_dictionaries(
    {"rollout_id": st.sampled_from(["a", "b", "c"])}, optional={"attempt": st.integers(0, 5)}
)
_EPISODES = _mostly(
    st.lists(_EPISODE, min_size=1, max_size=3),
    st.lists(
        st.one_of(
            st.fixed_dictionaries(
                {"rollout_id": st.sampled_from(["a", "r1-a2", "", 1])},
                optional={
                    "attempt": st.one_of(st.integers(-1, 10_001), st.just(1.0), st.just("1"))
                },
            ),
            _SCALARS,
        ),
        max_size=3,
    ),
)


_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "checkpoint_id": _mostly(st.sampled_from(["c1", "r-2"]), _SCALARS),
    "deadline_ts": _mostly(st.sampled_from([NOW + 60, int(NOW), 0.5]), _SCALARS),
    "checkpoint_dir": _mostly(st.just("/tmp/x"), _SCALARS),
    "episode_ids": _mostly(_EPISODES, _SCALARS),
    "rollout_ids": _mostly(
        st.lists(st.sampled_from(["a", "b"]), min_size=1, max_size=3),
        st.one_of(st.lists(st.sampled_from(["a", "bad id", 3]), max_size=2), _SCALARS),
    ),
    "stop": _mostly(st.booleans(), _SCALARS),
    "unknown": _SCALARS,
}
_MODELS: list[type[BaseModel]] = [
    CheckpointRequest,
    CommitRequest,
    RestoreRequest,
    RetireRequest,
    ForgetRequest,
]


@st.composite
def _bodies(draw: st.DrawFn) -> tuple[type[BaseModel], dict[str, Any]]:
    """A request model, and a body of mostly its own fields, each mostly valid."""
    model = draw(st.sampled_from(_MODELS))
    own = [name for name in _FIELDS if name in model.model_fields]
    names = draw(_mostly(st.just([]), st.lists(st.sampled_from(list(_FIELDS)), max_size=2)))
    dropped = draw(_mostly(st.just([]), st.lists(st.sampled_from(own), max_size=1)))
    return model, {name: draw(_FIELDS[name]) for name in [*own, *names] if name not in dropped}


def _outcome(validate: Any, body: Any) -> BaseModel | None:
    try:
        model: BaseModel = validate(body)
    except ValidationError:
        return None
    return model


@settings(max_examples=500, deadline=None)
@given(drawn=_bodies())
def test_bytes_and_parsed_json_validate_alike(
    drawn: tuple[type[BaseModel], dict[str, Any]],
) -> None:
    # Validating the bytes may only ever take what validating FastAPI's parse would take, as
    # the same model: the fast path must never accept a body the framework would refuse.
    model, body = drawn
    raw = json.dumps(body).encode()
    from_bytes = _outcome(model.model_validate_json, raw)
    from_parsed = _outcome(model.model_validate, json.loads(raw))
    assert from_bytes == from_parsed
