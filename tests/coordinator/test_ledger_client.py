"""The ledger client: whole-list validation, batching, typed errors, manifest identity, retries."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio
import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from tenacity import wait_none
from tenacity.wait import wait_base

from coordinator import LedgerClient
from participants import MemoryCaptureLedger, ledger_control_router
from protocols import (
    CheckpointOpenError,
    InvalidRolloutIdError,
    RolloutRemoval,
    RolloutRetiredError,
    UnauthorizedError,
)
from tests.participants.ledger_factory import commit

pytestmark = pytest.mark.anyio
TOKEN = "tok"


class Recorder(httpx.AsyncBaseTransport):
    """Passes requests to the app and remembers their bodies."""

    def __init__(self, app: FastAPI) -> None:
        self.inner = httpx.ASGITransport(app=app)
        self.bodies: list[object] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            self.bodies.append(json.loads(request.content))
        return await self.inner.handle_async_request(request)


@pytest.fixture
async def setup() -> AsyncIterator[
    tuple[LedgerClient, MemoryCaptureLedger, Recorder, dict[str, bool]]
]:
    ledger = MemoryCaptureLedger()
    state = {"open": False}
    app = FastAPI()
    app.include_router(
        ledger_control_router(ledger, capture_token=TOKEN, is_checkpoint_open=lambda: state["open"])
    )
    recorder = Recorder(app)
    client = LedgerClient("http://policy/", capture_token=TOKEN, batch_size=3, transport=recorder)
    yield client, ledger, recorder, state
    await client.aclose()


async def test_lists_are_validated_and_deduplicated_before_anything_is_sent(setup) -> None:  # type: ignore[no-untyped-def]
    client, ledger, recorder, _ = setup
    await ledger.record(commit("a", 0))
    with pytest.raises(TypeError):
        await client.retire("a")
    with pytest.raises(InvalidRolloutIdError):
        await client.retire(["a", "b", "c", "d", "e", "bad id"])  # bad id in the 2nd batch
    assert recorder.bodies == []
    assert await client.retire([]) == RolloutRemoval()
    assert recorder.bodies == []
    result = await client.retire(["a", "b", "a", "c", "d", "e", "b", "f"])
    assert recorder.bodies == [
        {"rollout_ids": ["a", "b", "c"]},
        {"rollout_ids": ["d", "e", "f"]},
    ]
    assert result == RolloutRemoval(removed=["a"], absent=["b", "c", "d", "e", "f"])


async def test_manifest_and_its_typed_errors(setup) -> None:  # type: ignore[no-untyped-def]
    client, ledger, _, state = setup
    await ledger.record(commit("a", 0))
    assert [r.model_call_id for r in (await client.manifest("a")).records] == ["call-0"]
    with pytest.raises(InvalidRolloutIdError):
        await client.manifest("../rollouts/a")
    state["open"] = True
    with pytest.raises(CheckpointOpenError):
        await client.delete(["a"])
    state["open"] = False
    await client.retire(["a"])
    with pytest.raises(RolloutRetiredError):
        await client.manifest("a")


async def test_a_manifest_for_another_rollout_is_rejected() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200, json={"schema_version": 2, "rollout_id": "other", "records": [], "failures": []}
        )

    client = LedgerClient("http://x", capture_token=TOKEN, transport=httpx.MockTransport(handler))
    try:
        with pytest.raises(ValueError, match="other"):
            await client.manifest("mine")
    finally:
        await client.aclose()


REFERENCE_RECORD = {
    "schema_version": 2,
    "digest_version": 2,
    "extras_digest_version": 1,
    "model_call_id": "c1",
    "parent_call_id": None,
    "staging_key": "mine/c1",
    "weight_version": 0,
    "prev_len": 0,
    "delta_len": 3,
    "cum_len": 3,
    "digest": "ab" * 32,
    "extras_digest": "cd" * 32,
    "mode": "text",
    "admitted_at": 1.5,
    "chain_hash": "ef" * 32,
    "cumulative_hash": "01" * 32,
    "response_id": "resp-c1",
    "output_fingerprint": None,
    "continuation_fingerprint": None,
    "fingerprint_version": 1,
}
"""A manifest record as the reference's ``CallRecord`` writes it: no ``rollout_id`` (D221)."""


async def test_a_manifest_shaped_as_the_references_is_read() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        body = {"schema_version": 2, "rollout_id": "mine", "records": [REFERENCE_RECORD]}
        return httpx.Response(200, json={**body, "failures": []})

    client = LedgerClient("http://x", capture_token=TOKEN, transport=httpx.MockTransport(handler))
    try:
        manifest = await client.manifest("mine")
    finally:
        await client.aclose()
    assert manifest.records[0].model_dump(mode="json") == REFERENCE_RECORD


async def test_a_wrong_token_is_unauthorized(setup) -> None:  # type: ignore[no-untyped-def]
    _, _, recorder, _ = setup
    client = LedgerClient("http://policy", capture_token="nope", transport=recorder)
    try:
        with pytest.raises(UnauthorizedError):
            await client.delete(["a"])
    finally:
        await client.aclose()


def test_constructor_refuses_bad_settings() -> None:
    with pytest.raises(ValueError):
        LedgerClient("http://x", capture_token="")
    with pytest.raises(ValueError):
        LedgerClient("http://x", capture_token="t", request_timeout_s=0)
    with pytest.raises(ValueError):
        LedgerClient("http://x", capture_token="t", batch_size=4097)


async def test_a_timeout_names_the_request(tmp_path: Path) -> None:
    import anyio

    async def slow(request: httpx.Request) -> httpx.Response:
        await anyio.sleep(5)
        return httpx.Response(200, json={})

    client = LedgerClient(
        "http://x", capture_token=TOKEN, request_timeout_s=0.05, transport=httpx.MockTransport(slow)
    )
    try:
        with pytest.raises(TimeoutError, match="POST /rollouts/retire"):
            await client.retire(["a"])
    finally:
        await client.aclose()


# ---------------------------------------------------------------- retries at the shared boundary


def ledger_app(ledger: MemoryCaptureLedger, is_checkpoint_open: Callable[[], bool]) -> FastAPI:
    app = FastAPI()
    app.include_router(
        ledger_control_router(ledger, capture_token=TOKEN, is_checkpoint_open=is_checkpoint_open)
    )
    return app


class LoseFirstReply(Recorder):
    """The app does the work, then the first reply is lost on the way back."""

    lost = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        reply = await super().handle_async_request(request)
        if not self.lost:
            self.lost = True
            await reply.aread()
            raise httpx.ReadError("reply lost", request=request)
        return reply


async def test_a_ledger_call_whose_reply_was_lost_is_sent_again() -> None:
    ledger = MemoryCaptureLedger()
    await ledger.record(commit("a", 0))
    transport = LoseFirstReply(ledger_app(ledger, lambda: False))
    async with LedgerClient(
        "http://policy", capture_token=TOKEN, transport=transport, wait=wait_none()
    ) as client:
        result = await client.retire(["a"])
        with pytest.raises(RolloutRetiredError):  # the first attempt did the work
            await client.manifest("a")
    assert transport.bodies == [{"rollout_ids": ["a"]}] * 2
    # The repeat finds nothing left to remove: retire is idempotent, its reply says what it did.
    assert result == RolloutRemoval(removed=[], absent=["a"])


async def test_a_ledger_call_refused_with_a_retryable_code_is_sent_again() -> None:
    ledger = MemoryCaptureLedger()
    await ledger.record(commit("a", 0))
    answers = iter([True])  # a checkpoint is open for the first request only
    recorder = Recorder(ledger_app(ledger, lambda: next(answers, False)))
    async with LedgerClient(
        "http://policy", capture_token=TOKEN, transport=recorder, wait=wait_none()
    ) as client:
        result = await client.delete(["a"])
    assert recorder.bodies == [{"rollout_ids": ["a"]}] * 2
    assert result == RolloutRemoval(removed=["a"])


async def test_a_final_refusal_is_sent_once_and_a_retryable_one_stops_at_the_limit() -> None:
    ledger = MemoryCaptureLedger()
    recorder = Recorder(ledger_app(ledger, lambda: True))  # a checkpoint stays open
    async with LedgerClient(
        "http://policy", capture_token="nope", transport=recorder, wait=wait_none()
    ) as client:
        with pytest.raises(UnauthorizedError):
            await client.retire(["a"])
    assert len(recorder.bodies) == 1
    async with LedgerClient(
        "http://policy", capture_token=TOKEN, transport=recorder, wait=wait_none(), attempts=4
    ) as client:
        with pytest.raises(CheckpointOpenError, match="retry ledger retire and delete"):
            await client.retire(["a"])
    assert len(recorder.bodies) == 1 + 4


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class PauseAfterRefusal(wait_base):
    """A short pause between attempts that tells the test an attempt has failed."""

    def __init__(self) -> None:
        self.failed = anyio.Event()
        self.pauses = 0

    def __call__(self, retry_state: object) -> float:
        self.pauses += 1
        self.failed.set()
        return 0.05


async def test_a_ledger_call_reaches_a_server_that_was_not_up_yet() -> None:
    ledger = MemoryCaptureLedger()
    await ledger.record(commit("a", 0))
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            ledger_app(ledger, lambda: False),
            host="127.0.0.1",
            port=port,
            log_level="warning",
            lifespan="off",
        )
    )
    pause = PauseAfterRefusal()

    async def serve_once_refused() -> None:
        await pause.failed.wait()  # the first attempt found nothing listening
        await server.serve()

    client = LedgerClient(f"http://127.0.0.1:{port}", capture_token=TOKEN, attempts=200, wait=pause)
    async with client, anyio.create_task_group() as group:
        group.start_soon(serve_once_refused)
        try:
            with anyio.fail_after(20):
                result = await client.retire(["a"])
        finally:
            server.should_exit = True
            pause.failed.set()  # never left waiting, even when the call failed
    assert result == RolloutRemoval(removed=["a"])
    assert pause.pauses >= 1
