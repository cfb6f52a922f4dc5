"""The control routes over HTTP (in-process): auth first, envelopes always, never a 500."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from participants import ControlPlane, ManualClock, participant_app
from protocols import CONTROL_PREFIX
from protocols._ids import MAX_ATTEMPT
from tests.adapter_count import adapters_built

from .fakes import FakeParticipant
from .runtime_support import NOW, commit_req, ep, harness, req

pytestmark = pytest.mark.anyio
TOKEN = "s3cret-token"
GOLDEN = Path(__file__).parent.parent / "golden" / "openapi" / "participant.json"

ROUTES = ["status", "prepare", "renew", "commit", "restore", "resume", "retire", "forget"]
VALID_BODY: dict[str, dict[str, Any]] = {
    "prepare": {"checkpoint_id": "c1", "deadline_ts": NOW + 60},
    "renew": {"checkpoint_id": "c1", "deadline_ts": NOW + 60},
    "resume": {"checkpoint_id": "c1", "deadline_ts": NOW + 60},
    "commit": {"checkpoint_id": "c1", "deadline_ts": NOW + 60, "checkpoint_dir": "/tmp/x"},
    "restore": {
        "checkpoint_id": "r1",
        "deadline_ts": NOW + 60,
        "checkpoint_dir": "/tmp/x",
        "episode_ids": [],
    },
    "retire": {
        "checkpoint_id": "c1",
        "deadline_ts": NOW + 60,
        "episode_ids": [{"rollout_id": "a"}],
    },
    "forget": {"checkpoint_id": "c1", "deadline_ts": NOW + 60, "rollout_ids": ["a"]},
}


class Client:
    def __init__(self, http: httpx.AsyncClient, plane: ControlPlane, fake: FakeParticipant) -> None:
        self.http, self.plane, self.fake = http, plane, fake

    async def call(self, route: str, body: Any = None, token: str | None = TOKEN) -> httpx.Response:
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        if route == "status":
            return await self.http.get(f"{CONTROL_PREFIX}/status", headers=headers)
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers["content-type"] = "application/json"
        return await self.http.post(f"{CONTROL_PREFIX}/{route}", content=content, headers=headers)


@pytest.fixture
async def client() -> AsyncIterator[Client]:
    fake = FakeParticipant()
    plane = ControlPlane(fake, clock=ManualClock(NOW))
    app = participant_app(plane, token=TOKEN)
    transport = httpx.ASGITransport(app=app)
    async with plane.running(), httpx.AsyncClient(transport=transport, base_url="http://p") as http:
        yield Client(http, plane, fake)


def _error(response: httpx.Response) -> tuple[int, str]:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "detail"}
    return response.status_code, body["error"]["code"]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    "header",
    [
        None,
        "Bearer wrong",
        "bearer s3cret-token",
        "Bearer  s3cret-token",
        "s3cret-token",
        "Bearer ",
    ],
)
@pytest.mark.parametrize("body", ["valid", b"{not json", b"", "missing-fields"])
async def test_every_route_answers_401_without_the_token_whatever_the_body(
    client: Client, route: str, header: str | None, body: str | bytes
) -> None:
    payload: Any = (
        VALID_BODY.get(route) if body == "valid" else {} if body == "missing-fields" else body
    )
    headers = {} if header is None else {"Authorization": header}
    if route == "status":
        response = await client.http.get(f"{CONTROL_PREFIX}/status", headers=headers)
    else:
        content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        response = await client.http.post(
            f"{CONTROL_PREFIX}/{route}", content=content, headers=headers
        )
    assert _error(response) == (401, "unauthorized")
    assert client.plane.phase.value == "idle" and client.fake.admission_open


@pytest.mark.parametrize("route", [r for r in ROUTES if r != "status"])
@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"\xef\x6f\xff\xfe",  # not UTF-8: FastAPI's own 400, which must not become a 500
        b"",
        b"[]",
        b'"text"',
        b'{"checkpoint_id": "c1"}',
        b'{"checkpoint_id": "c1", "deadline_ts": NaN}',
        b'{"checkpoint_id": "c1", "deadline_ts": "soon"}',
        b'{"checkpoint_id": "../c", "deadline_ts": 1800000060}',
        b'{"checkpoint_id": "c1", "deadline_ts": 1800000060, "unknown": 1}',
    ],
)
async def test_malformed_bodies_get_422_in_the_envelope(
    client: Client, route: str, body: bytes
) -> None:
    response = await client.call(route, body)
    assert _error(response) == (422, "invalid_request")
    assert client.plane.phase.value == "idle" and client.fake.admission_open


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("retire", {"checkpoint_id": "c", "deadline_ts": NOW, "episode_ids": []}),
        ("forget", {"checkpoint_id": "c", "deadline_ts": NOW, "rollout_ids": ["bad id"]}),
        ("forget", {"checkpoint_id": "c", "deadline_ts": NOW, "rollout_ids": "a"}),
        ("restore", {"checkpoint_id": "c", "deadline_ts": NOW, "checkpoint_dir": "/x"}),
        ("commit", {"checkpoint_id": "c", "deadline_ts": NOW, "checkpoint_dir": ""}),
    ],
)
async def test_route_specific_invalid_requests(client: Client, route: str, body: Any) -> None:
    assert _error(await client.call(route, body)) == (422, "invalid_request")


async def test_a_deadline_hours_ahead_is_accepted(client: Client) -> None:
    # Any finite deadline, as in the reference (D225): the lease is capped at the horizon.
    reply = await client.call("prepare", {"checkpoint_id": "c", "deadline_ts": NOW + 7200})
    assert reply.status_code == 200 and reply.json()["phase"] == "prepared", reply.text
    assert client.plane.lease_expires_at == NOW + 3600 + 600


async def test_a_full_cycle_over_http(client: Client, tmp_path: Path) -> None:
    client.fake.start(__import__("protocols").EpisodeId(rollout_id="a"))
    prepared = await client.call("prepare", {"checkpoint_id": "c1", "deadline_ts": NOW + 60})
    assert prepared.status_code == 200 and prepared.json()["phase"] == "prepared"
    commit = await client.call(
        "commit",
        {
            "checkpoint_id": "c1",
            "deadline_ts": NOW + 60,
            "checkpoint_dir": str(tmp_path),
            "episode_ids": [{"rollout_id": "a"}],
        },
    )
    assert commit.status_code == 200, commit.text
    assert commit.json()["episode_ids"] == ["a"]
    assert (tmp_path / "gym/environment/fake/manifest.json").exists()
    status = (await client.call("status")).json()
    assert status["phase"] == "committed" and status["restored_pending"] == []
    assert (
        await client.call("resume", {"checkpoint_id": "c1", "deadline_ts": NOW + 60})
    ).json() == {
        "phase": "idle",
        "idempotent": False,
    }
    again = await client.call("prepare", {"checkpoint_id": "c1", "deadline_ts": NOW + 60})
    assert _error(again) == (409, "stale_checkpoint")


async def test_corrupt_records_give_422_over_http(client: Client, tmp_path: Path) -> None:
    directory = tmp_path / "gym/environment/fake"
    directory.mkdir(parents=True)
    (directory / "manifest.json").write_text("{broken")
    response = await client.call(
        "restore",
        {
            "checkpoint_id": "r1",
            "deadline_ts": NOW + 60,
            "checkpoint_dir": str(tmp_path),
            "episode_ids": [{"rollout_id": "a"}],
        },
    )
    assert _error(response) == (422, "invalid_checkpoint_state")
    assert client.fake.installed == [] and client.fake.admission_open


async def test_a_restore_of_the_last_attempt_is_a_422_and_installs_nothing(
    client: Client, tmp_path: Path
) -> None:
    # A checkpoint that continued attempt 9,999: restoring it would need attempt 10,000 (D361).
    async with harness(tmp_path) as h:
        h.fake.start(ep("a", MAX_ATTEMPT))
        await h.plane.prepare(req("c1"))
        await h.plane.commit(commit_req(h.directory(), [ep("a", MAX_ATTEMPT)]))
        directory = h.directory()
    response = await client.call(
        "restore",
        {
            "checkpoint_id": "r1",
            "deadline_ts": NOW + 60,
            "checkpoint_dir": directory,
            "episode_ids": [{"rollout_id": "a", "attempt": MAX_ATTEMPT}],
        },
    )
    assert _error(response) == (422, "invalid_request")
    assert "a-a9999 is attempt 9999" in response.json()["error"]["detail"]
    assert client.fake.installed == [] and client.fake.admission_open
    assert client.plane.phase.value == "idle"


async def test_a_restore_of_two_attempts_of_one_rollout_is_a_422_and_installs_nothing(
    client: Client, tmp_path: Path
) -> None:
    # It used to answer 200 with "a-a1" restored, which the fence of a-a1 then refused (D365).
    async with harness(tmp_path) as h:
        h.fake.start(ep("a"))
        await h.plane.prepare(req("c1"))
        await h.plane.commit(commit_req(h.directory(), [ep("a")]))
        directory = h.directory()
    scope = [{"rollout_id": "a"}, {"rollout_id": "a", "attempt": 1}]
    body = VALID_BODY["restore"] | {"checkpoint_dir": directory, "episode_ids": scope}
    response = await client.call("restore", body)
    assert _error(response) == (422, "invalid_request")
    assert "two attempts of rollout 'a' (a and a-a1)" in response.json()["error"]["detail"]
    assert client.fake.installed == [] and client.plane.phase.value == "idle"


@pytest.mark.parametrize("route", ["commit", "restore"])
async def test_a_checkpoint_dir_with_a_nul_is_a_422(
    client: Client, tmp_path: Path, route: str
) -> None:
    if route == "commit":
        client.fake.start(__import__("protocols").EpisodeId(rollout_id="a"))
        await client.call("prepare", {"checkpoint_id": "c1", "deadline_ts": NOW + 60})
    body = VALID_BODY[route] | {"checkpoint_dir": f"{tmp_path}/c\u00001"}
    response = await client.call(route, body)
    assert _error(response) == (422, "invalid_request")
    assert "NUL character" in response.json()["error"]["detail"]
    assert list(tmp_path.iterdir()) == []


async def test_an_unexpected_participant_error_is_an_enveloped_500(client: Client) -> None:
    client.fake.fail_close = RuntimeError("boom")
    response = await client.call("prepare", {"checkpoint_id": "c1", "deadline_ts": NOW + 60})
    assert _error(response) == (500, "internal_error")
    assert client.fake.admission_open


async def test_a_data_plane_body_that_cannot_be_read_is_422_in_the_envelope() -> None:
    plane = ControlPlane(FakeParticipant(), clock=ManualClock(NOW))
    app = participant_app(plane, token=TOKEN)

    @app.post("/data")
    async def data(body: dict[str, int]) -> dict[str, int]:
        return body

    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://p"
    ) as http:
        unreadable = await http.post(
            "/data", content=b"\xef\x6f\xff", headers={"content-type": "application/json"}
        )
        assert _error(unreadable) == (422, "invalid_request")
        # A route that does not exist has no row in the error table: the framework's 404 stays.
        assert (await http.post("/nowhere", json={})).status_code == 404


async def test_health_and_metrics(client: Client) -> None:
    health = await client.http.get("/healthz")
    assert health.json() == {
        "status": "ok",
        "kind": "environment",
        "instance": "fake",
        "phase": "idle",
    }
    await client.call("prepare", {"checkpoint_id": "c1", "deadline_ts": NOW + 60})
    metrics = (await client.http.get("/metrics")).text
    assert 'midflight_checkpoint_operations_total{operation="prepare",outcome="ok"} 1.0' in metrics
    assert 'midflight_checkpoint_phase{phase="prepared"} 1.0' in metrics
    assert TOKEN not in metrics


async def test_no_token_installs_no_control_route() -> None:
    plane = ControlPlane(FakeParticipant(), clock=ManualClock(NOW))
    app = participant_app(plane, token=None)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://p"
    ) as http:
        assert (await http.get(f"{CONTROL_PREFIX}/status")).status_code == 404
        assert (await http.get("/healthz")).status_code == 200


def test_an_empty_token_is_refused_at_start() -> None:
    plane = ControlPlane(FakeParticipant(), clock=ManualClock(NOW))
    with pytest.raises(ValueError, match="empty token"):
        participant_app(plane, token="")


def test_the_openapi_document_is_snapshotted() -> None:
    plane = ControlPlane(FakeParticipant(), clock=ManualClock(NOW))
    document = participant_app(plane, token=TOKEN).openapi()
    if os.environ.get("MIDFLIGHT_UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
    assert document == json.loads(GOLDEN.read_text()), (
        "the wire changed: review the diff, then regenerate with MIDFLIGHT_UPDATE_GOLDEN=1"
    )
    for route in ROUTES:
        method = "get" if route == "status" else "post"
        responses = document["paths"][f"{CONTROL_PREFIX}/{route}"][method]["responses"]
        assert {"200", "401", "500"} <= set(responses)
        if route != "status":
            assert "409" in responses and "422" in responses


@pytest.fixture
async def small_limit() -> AsyncIterator[tuple[httpx.AsyncClient, FakeParticipant]]:
    fake = FakeParticipant()
    plane = ControlPlane(fake, clock=ManualClock(NOW))
    app = participant_app(plane, token=TOKEN, max_body_bytes=1024)
    transport = httpx.ASGITransport(app=app)
    async with plane.running(), httpx.AsyncClient(transport=transport, base_url="http://p") as http:
        yield http, fake


def _too_large(body: int = 4096) -> dict[str, Any]:
    return {**VALID_BODY["prepare"], "checkpoint_id": "c" + "x" * body}


@pytest.mark.parametrize("route", ["prepare", "commit", "restore", "retire", "forget"])
async def test_a_body_over_the_limit_is_refused_with_413_before_it_is_parsed(
    small_limit: tuple[httpx.AsyncClient, FakeParticipant], route: str
) -> None:
    http, fake = small_limit
    reply = await http.post(
        f"{CONTROL_PREFIX}/{route}",
        content=json.dumps(_too_large()).encode(),
        headers={"Authorization": f"Bearer {TOKEN}", "content-type": "application/json"},
    )
    assert _error(reply) == (413, "request_too_large")
    assert "1024 bytes" in reply.json()["error"]["detail"]
    assert fake.admission_open  # nothing changed


async def test_a_streamed_body_without_a_length_is_counted(
    small_limit: tuple[httpx.AsyncClient, FakeParticipant],
) -> None:
    http, fake = small_limit
    chunk = json.dumps(_too_large()).encode()

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(chunk), 100):
            yield chunk[start : start + 100]

    reply = await http.post(
        f"{CONTROL_PREFIX}/prepare",
        content=chunks(),
        headers={"Authorization": f"Bearer {TOKEN}", "content-type": "application/json"},
    )
    assert "content-length" not in reply.request.headers
    assert _error(reply) == (413, "request_too_large")
    assert "streamed" in reply.json()["error"]["detail"]
    assert fake.admission_open


async def test_a_body_under_the_limit_is_served(
    small_limit: tuple[httpx.AsyncClient, FakeParticipant],
) -> None:
    http, _fake = small_limit
    reply = await http.post(
        f"{CONTROL_PREFIX}/prepare",
        json=VALID_BODY["prepare"],
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert reply.status_code == 200, reply.text


async def test_a_restore_body_is_parsed_and_served_with_the_collector_paused(
    client: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gc

    seen: dict[str, bool] = {}
    real_restore, real_prepare = client.plane.restore, client.plane.prepare

    async def restore(request: Any) -> Any:
        seen["restore"] = gc.isenabled()  # the body was parsed inside the same pause
        return await real_restore(request)

    async def prepare(request: Any) -> Any:
        seen["prepare"] = gc.isenabled()
        return await real_prepare(request)

    monkeypatch.setattr(client.plane, "restore", restore)
    monkeypatch.setattr(client.plane, "prepare", prepare)
    gc.enable()
    await client.call("restore", {**VALID_BODY["restore"], "checkpoint_dir": str(tmp_path)})
    await client.call("prepare", VALID_BODY["prepare"])
    assert seen == {"restore": False, "prepare": True}  # D271: batch routes only
    await client.call("resume", VALID_BODY["resume"])
    assert gc.isenabled()  # given back once the request is served


async def _adapters_built_by_first_status(*, started: bool) -> int:
    """How many ``TypeAdapter``s a fresh app builds while it serves its first control call."""
    fake = FakeParticipant()
    plane = ControlPlane(fake, clock=ManualClock(NOW))
    app = participant_app(plane, token=TOKEN)
    transport = httpx.ASGITransport(app=app)
    lifespan = app.router.lifespan_context(app) if started else plane.running()
    async with lifespan, httpx.AsyncClient(transport=transport, base_url="http://p") as http:
        with adapters_built() as built:
            reply = await http.get(
                f"{CONTROL_PREFIX}/status", headers={"Authorization": f"Bearer {TOKEN}"}
            )
    assert reply.status_code == 200, reply.text
    return len(built)


async def test_a_started_server_has_built_its_routes_before_the_first_control_call() -> None:
    # D440: FastAPI builds an included router's models at the first request through it, so
    # without the build at start-up a fresh server's first restore or prepare paid for it.
    assert await _adapters_built_by_first_status(started=False) > 8
    assert await _adapters_built_by_first_status(started=True) == 0
