"""The deterministic worker in-process: completions, auth and envelopes, cuts mid-decode,
terminal races, hung and failing cuts, continuations and staging chains."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import types
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from e2e._worker.app import WorkerSettings, create_worker_app, read_worker_evidence
from e2e._worker.generation import generate_tokens
from participants import FileTokenStagingStore
from protocols import (
    GenerationCutInventory,
    GenerationCutPrefix,
    GenerationCutReceipt,
    StagedEntry,
    encode,
    hash_token_ids,
    render_prompt,
)
from protocols._staging import GENERATION_CUT_KEY_PREFIX
from tests.adapter_count import adapters_built

pytestmark = pytest.mark.anyio
TOKEN = "secret-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
PROMPT = encode(
    render_prompt([{"role": "system", "content": "counter"}, {"role": "user", "content": "r1 0"}])
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@asynccontextmanager
async def worker(
    root: Path, *, store: Any = None, token: str | None = TOKEN, **settings: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    app = create_worker_app(WorkerSettings(root=root, control_token=token, **settings), store=store)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://worker") as client:
        yield client, app.state.engine


def _body(call: str = "c1", key: str = "r1", max_tokens: int = 24, **extra: Any) -> dict[str, Any]:
    capture = {"rollout_id": key, "model_call_id": call, "mode": "text"}
    capture.update(extra.pop("capture", {}))
    return {"prompt_token_ids": PROMPT, "max_tokens": max_tokens, "ng_capture": capture, **extra}


def _inventory(*calls: tuple[str, str, int]) -> dict[str, Any]:
    prefixes = [
        GenerationCutPrefix(
            ticket_id=f"t-{call}",
            rollout_id=rollout,
            attempt=attempt,
            model_call_id=call,
            admitted_at=1.5,
        )
        for call, rollout, attempt in calls
    ]
    inventory = GenerationCutInventory.build(
        checkpoint_id="ckpt-1", server_name="policy", active_prefixes=prefixes
    )
    return inventory.model_dump(mode="json")


async def _cut(client: httpx.AsyncClient, *calls: tuple[str, str, int]) -> GenerationCutReceipt:
    inventory = _inventory(*calls)
    reply = await client.post("/ng-control/v1/generation-cut", json=inventory, headers=AUTH)
    assert reply.status_code == 200, reply.text
    receipt = GenerationCutReceipt.model_validate_json(reply.content)
    receipt.validate_for(GenerationCutInventory.model_validate(inventory))
    return receipt


async def _until(predicate: Callable[[], bool]) -> None:
    with anyio.fail_after(10):
        while not predicate():  # noqa: ASYNC110 - polls engine state no event announces
            await anyio.sleep(0.002)


def _generated(engine: Any, call: str) -> int:
    live = engine.live.get(call)
    return 0 if live is None else len(live.generated)


async def test_a_completion_is_the_contract_generation_staged_and_evidenced(tmp_path: Path) -> None:
    async with worker(tmp_path, seed=7, token_delay_ms=0) as (client, _):
        reply = await client.post("/v1/completions", json=_body(max_tokens=12))
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["token_ids"] == generate_tokens(7, PROMPT, 0, 12)
    assert body["finish_reason"] == "length"
    coords = body["ng_commit_coords"]
    assert coords["disposition"] == "staged" and coords["staging_key"] == "r1/c1"
    entry = FileTokenStagingStore(tmp_path / "staging").get("r1/c1")
    assert entry is not None and entry.record.digest == coords["digest"]
    assert entry.record.cumulative_hash == hash_token_ids(PROMPT + body["token_ids"])
    [event] = read_worker_evidence(tmp_path)
    assert (event["capture_key"], event["model_call_id"]) == ("r1", "c1")
    assert (event["tokens_generated"], event["tokens_continued"]) == (12, 0)


async def test_an_uncaptured_completion_stages_nothing(tmp_path: Path) -> None:
    async with worker(tmp_path, token_delay_ms=0) as (client, _):
        reply = await client.post(
            "/v1/completions", json={"prompt_token_ids": PROMPT, "max_tokens": 3}
        )
    assert reply.json() == {
        "token_ids": generate_tokens(0, PROMPT, 0, 3),
        "finish_reason": "length",
        "ng_commit_coords": None,
    }
    assert FileTokenStagingStore(tmp_path / "staging").keys() == []


async def test_the_bearer_token_is_checked_before_the_body(tmp_path: Path) -> None:
    async with worker(tmp_path) as (client, _):
        route = "/ng-control/v1/generation-cut"
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN}):
            reply = await client.post(route, content=b"not json", headers=headers)
            assert reply.status_code == 401
            assert reply.json()["error"]["code"] == "unauthorized"
        reply = await client.post(route, content=b"not json", headers=AUTH)
        assert reply.status_code == 422 and reply.json()["error"]["code"] == "invalid_request"


async def test_without_a_control_token_there_is_no_cut_route(tmp_path: Path) -> None:
    async with worker(tmp_path, token=None) as (client, _):
        reply = await client.post("/ng-control/v1/generation-cut", json=_inventory(), headers=AUTH)
        assert reply.status_code == 404
        assert (
            "/ng-control/v1/generation-cut"
            not in (await client.get("/openapi.json")).json()["paths"]
        )


async def test_health_and_openapi(tmp_path: Path) -> None:
    async with worker(tmp_path) as (client, _):
        assert (await client.get("/healthz")).json()["status"] == "ok"
        paths = (await client.get("/openapi.json")).json()["paths"]
        assert {"/v1/completions", "/ng-control/v1/generation-cut", "/healthz"} <= set(paths)


@pytest.mark.parametrize(
    "body",
    [
        {**_body(), "max_tokens": 2.0},
        {**_body(), "max_tokens": 0},
        {**_body(), "prompt_token_ids": [256]},
        {**_body(), "prompt_token_ids": []},
        {**_body(), "unknown": 1},
        {
            "prompt_token_ids": PROMPT,
            "max_tokens": 2,
            "ng_generation_cut": {"source_capture_key": "r"},
        },
        _body(capture={"mode": "token_in"}),
    ],
)
async def test_bad_completion_bodies_get_the_invalid_request_envelope(
    tmp_path: Path, body: dict[str, Any]
) -> None:
    async with worker(tmp_path, token_delay_ms=0) as (client, _):
        reply = await client.post("/v1/completions", json=body)
    assert reply.status_code == 422
    assert set(reply.json()) == {"error"} and reply.json()["error"]["code"] == "invalid_request"


async def test_a_cut_mid_decode_then_a_replacement_continues_token_for_token(
    tmp_path: Path,
) -> None:
    async with (
        worker(tmp_path, token_delay_ms=5) as (client, engine),
        anyio.create_task_group() as group,
    ):
        replies: dict[str, httpx.Response] = {}

        async def call() -> None:
            replies["c1"] = await client.post("/v1/completions", json=_body(max_tokens=40))

        group.start_soon(call)
        await _until(lambda: _generated(engine, "c1") >= 5)
        receipt = await _cut(client, ("c1", "r1", 0))
        [ack] = receipt.prefixes
        assert ack.disposition == "durable_prefix" and ack.cut_kind == "active_prefix"
        assert ack.staging_keys == [f"{GENERATION_CUT_KEY_PREFIX}/c1/1"]
        assert 5 <= (ack.prefix_token_count or 0) < 40
        assert ack.effective_output_limit == 40
    uninterrupted = generate_tokens(0, PROMPT, 0, 40)
    assert replies["c1"].json()["token_ids"] == uninterrupted  # the cut never disturbed the decode

    async with worker(tmp_path, token_delay_ms=0) as (client, _):
        replacement = _body("c1-retry", "r1-a1", max_tokens=40)
        replacement["ng_generation_cut"] = ack.continuation().model_dump(mode="json")
        reply = await client.post("/v1/completions", json=replacement)
    assert reply.status_code == 200, reply.text
    assert reply.json()["token_ids"] == uninterrupted
    events = {e["model_call_id"]: e for e in read_worker_evidence(tmp_path)}
    assert events["c1-retry"]["tokens_continued"] == ack.prefix_token_count
    assert events["c1-retry"]["tokens_generated"] == 40 - (ack.prefix_token_count or 0)
    assert events["c1-retry"]["continued_from"] == "c1"
    entry = FileTokenStagingStore(tmp_path / "staging").get("r1-a1/c1-retry")
    assert entry is not None and entry.record.cumulative_hash == hash_token_ids(
        PROMPT + uninterrupted
    )


async def test_a_second_cut_stages_only_a_chunk_and_still_continues(tmp_path: Path) -> None:
    async with (
        worker(tmp_path, token_delay_ms=5) as (client, engine),
        anyio.create_task_group() as group,
    ):
        done = anyio.Event()

        async def call() -> None:
            await client.post("/v1/completions", json=_body(max_tokens=60))
            done.set()

        group.start_soon(call)
        await _until(lambda: _generated(engine, "c1") >= 3)
        first = (await _cut(client, ("c1", "r1", 0))).prefixes[0]
        count = first.prefix_token_count or 0
        await _until(lambda: _generated(engine, "c1") >= count + 3)
        second = (await _cut(client, ("c1", "r1", 0))).prefixes[0]
        again = (await _cut(client, ("c1", "r1", 0))).prefixes[0]
        await done.wait()
    assert len(second.staging_keys or []) == 2 and (second.prefix_token_count or 0) > count
    chunk = FileTokenStagingStore(tmp_path / "staging").get((second.staging_keys or [])[1])
    assert chunk is not None and set(chunk.record.token_mask_delta) == {1.0}
    assert len(again.staging_keys or []) in (2, 3)
    async with worker(tmp_path, token_delay_ms=0) as (client, _):
        replacement = _body("c1-retry", "r1-a1", max_tokens=60)
        replacement["ng_capture"]["generation_cut"] = second.continuation().model_dump(mode="json")
        reply = await client.post("/v1/completions", json=replacement)
    assert reply.json()["token_ids"] == generate_tokens(0, PROMPT, 0, 60)
    [event] = [e for e in read_worker_evidence(tmp_path) if e["model_call_id"] == "c1-retry"]
    assert event["tokens_generated"] == 60 - (second.prefix_token_count or 0)


async def test_a_call_that_finished_before_the_cut_answers_its_terminal_completion(
    tmp_path: Path,
) -> None:
    async with worker(tmp_path, token_delay_ms=0) as (client, _):
        done = (await client.post("/v1/completions", json=_body(max_tokens=16))).json()
        receipt = await _cut(client, ("c1", "r1", 0), ("c9", "r1", 0))
        terminal, unknown = receipt.prefixes
        assert terminal.cut_kind == "terminal_completion"
        assert terminal.staging_keys == ["r1/c1"] and terminal.frozen_buffer_id == "terminal/ckpt-1"
        assert terminal.prefix_token_count == 16 and terminal.terminal_finish_reason == "length"
        assert terminal.prefix_digest == done["ng_commit_coords"]["digest"]
        assert unknown.disposition == "durable_failure"
        replacement = _body("c1-retry", "r1-a1", max_tokens=16)
        replacement["ng_generation_cut"] = terminal.continuation().model_dump(mode="json")
        reply = await client.post("/v1/completions", json=replacement)
    assert reply.json()["token_ids"] == done["token_ids"]
    [event] = [e for e in read_worker_evidence(tmp_path) if e["model_call_id"] == "c1-retry"]
    assert (event["tokens_generated"], event["tokens_continued"]) == (0, 16)


async def test_a_cut_naming_another_attempt_is_a_durable_failure(tmp_path: Path) -> None:
    async with (
        worker(tmp_path, token_delay_ms=5) as (client, engine),
        anyio.create_task_group() as group,
    ):

        async def call() -> None:
            await client.post("/v1/completions", json=_body(max_tokens=20))

        group.start_soon(call)
        await _until(lambda: _generated(engine, "c1") >= 1)
        [ack] = (await _cut(client, ("c1", "r1", 2))).prefixes
        assert ack.disposition == "durable_failure"


class CutFaultStore(FileTokenStagingStore):
    """Stages completed calls normally; cut records hang (until released) or fail."""

    def __init__(self, root: Path, *, hang: bool) -> None:
        super().__init__(root)
        self.hang = hang
        self.release = threading.Event()

    def put(self, entry: StagedEntry) -> None:
        if entry.staging_key.startswith(GENERATION_CUT_KEY_PREFIX):
            if not self.hang:
                raise OSError("staging backend unavailable")
            self.release.wait(timeout=30)
            raise OSError("released")
        super().put(entry)

    def put_many(self, entries: Sequence[StagedEntry]) -> None:
        # A cut round stages its records as one batch: the fault hits the batch.
        for entry in entries:
            if entry.staging_key.startswith(GENERATION_CUT_KEY_PREFIX):
                self.put(entry)
        super().put_many(entries)


@pytest.mark.parametrize("hang", [True, False])
async def test_a_hung_or_failing_cut_is_a_durable_failure_and_never_blocks_decoding(
    tmp_path: Path, hang: bool
) -> None:
    store = CutFaultStore(tmp_path / "staging", hang=hang)
    try:
        async with (
            worker(tmp_path, store=store, token_delay_ms=5, cut_timeout_ms=150) as (client, engine),
            anyio.create_task_group() as group,
        ):
            replies: dict[str, httpx.Response] = {}

            async def call() -> None:
                replies["c1"] = await client.post("/v1/completions", json=_body(max_tokens=200))

            group.start_soon(call)
            await _until(lambda: _generated(engine, "c1") >= 2)
            before = _generated(engine, "c1")
            with anyio.fail_after(5):  # the cut answers within its own deadline, never hangs
                [ack] = (await _cut(client, ("c1", "r1", 0))).prefixes
            assert ack.disposition == "durable_failure" and ack.staging_keys is None
            if hang:
                assert _generated(engine, "c1") > before  # decoding went on during the hung cut
            store.release.set()
        assert replies["c1"].status_code == 200
        assert replies["c1"].json()["token_ids"] == generate_tokens(0, PROMPT, 0, 200)
        assert replies["c1"].json()["ng_commit_coords"]["disposition"] == "staged"
    finally:
        store.release.set()


async def test_a_continuation_that_does_not_fit_is_refused(tmp_path: Path) -> None:
    async with worker(tmp_path, token_delay_ms=0) as (client, _):
        await client.post("/v1/completions", json=_body(max_tokens=8))
        [ack] = (await _cut(client, ("c1", "r1", 0))).prefixes
        good = ack.continuation().model_dump(mode="json")
        cases = {
            "digest": {**good, "prefix_digest": "0" * 64},
            "missing key": {**good, "staging_keys": ["nowhere/none"]},
            "count": {**good, "prefix_token_count": 7},
        }
        for name, cut in cases.items():
            body = _body("c1-retry", "r1-a1", max_tokens=8, ng_generation_cut=cut)
            reply = await client.post("/v1/completions", json=body)
            assert reply.status_code == 422, name
        other_prompt = {**_body("c1-retry", "r1-a1", max_tokens=8, ng_generation_cut=good)}
        other_prompt["prompt_token_ids"] = [*PROMPT[:-1], 120]
        assert (await client.post("/v1/completions", json=other_prompt)).status_code == 422
        too_short = _body("c1-retry", "r1-a1", max_tokens=4, ng_generation_cut=good)
        assert (await client.post("/v1/completions", json=too_short)).status_code == 422
        conflicting = _body("c1-retry", "r1-a1", max_tokens=8, ng_generation_cut=good)
        conflicting["ng_capture"]["generation_cut"] = cases["count"]
        assert (await client.post("/v1/completions", json=conflicting)).status_code == 422


async def test_a_child_call_resolves_its_prefix_from_the_staging_chain(tmp_path: Path) -> None:
    async with worker(tmp_path, token_delay_ms=0) as (client, _):
        parent = (await client.post("/v1/completions", json=_body(max_tokens=6))).json()
        parent_tokens = PROMPT + parent["token_ids"]
        child_prompt = parent_tokens + encode("\x04\x02tool\x03add 3 -> 4 0\x04\x02assistant\x03")
        capture = {
            "mode": "token_in",
            "model_call_id": "c2",
            "parent_call_id": "c1",
            "prev_len": len(parent_tokens),
            "staging_chain": ["r1/c1"],
            "parent_chain_hash": parent["ng_commit_coords"]["chain_hash"],
        }
        body = {**_body("c2", max_tokens=6, capture=capture), "prompt_token_ids": child_prompt}
        reply = await client.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["token_ids"] == generate_tokens(0, child_prompt, 0, 6)
        coords = reply.json()["ng_commit_coords"]
        assert coords["prev_len"] == len(parent_tokens) and coords["parent_call_id"] == "c1"
        broken = {**capture, "model_call_id": "c3", "parent_chain_hash": "0" * 64}
        reply = await client.post(
            "/v1/completions", json={**body, "ng_capture": {**body["ng_capture"], **broken}}
        )
        assert reply.status_code == 422 and "chain" in reply.json()["error"]["detail"]
        wrong_prompt = {
            **body,
            "prompt_token_ids": [0, *child_prompt[1:]],
            "ng_capture": {**body["ng_capture"], "model_call_id": "c4"},
        }
        assert (await client.post("/v1/completions", json=wrong_prompt)).status_code == 422


async def test_metrics_count_completions_and_the_version_is_every_server_s(tmp_path: Path) -> None:
    from participants import ControlPlane, participant_app
    from tests.coordinator.deployment import Logged

    async with worker(tmp_path, token_delay_ms=0) as (client, _):
        reply = await client.post("/v1/completions", json=_body(max_tokens=5))
        assert reply.status_code == 200
        metrics = await client.get("/metrics")
        assert metrics.status_code == 200
        assert metrics.headers["content-type"].startswith("text/plain")
        text = metrics.text
        assert "midflight_worker_completions_total 1.0" in text
        assert "midflight_worker_tokens_returned_total 5.0" in text
        assert "midflight_worker_calls_in_flight 0.0" in text
        document = (await client.get("/openapi.json")).json()
        assert "/metrics" in document["paths"]
    participant = participant_app(ControlPlane(Logged("model", "policy", [])), token=None)
    assert document["info"]["version"] == participant.openapi()["info"]["version"]


async def test_metrics_count_the_cut_inventories_answered_and_their_calls(tmp_path: Path) -> None:
    async with worker(tmp_path, token_delay_ms=0) as (client, _):
        await _cut(client, ("c1", "r1", 0), ("c2", "r2", 1))
        await _cut(client)
        text = (await client.get("/metrics")).text
    assert "midflight_worker_cut_requests_total 2.0" in text
    assert "midflight_worker_cut_calls_total 2.0" in text


async def test_a_completion_body_over_the_limit_is_refused_with_413(tmp_path: Path) -> None:
    from participants._http.body_limit import DEFAULT_MAX_BODY_BYTES

    async with worker(tmp_path) as (client, engine):
        huge = b'{"prompt_token_ids": [' + b"1," * (DEFAULT_MAX_BODY_BYTES // 2) + b"1]}"
        reply = await client.post(
            "/v1/completions", content=huge, headers={"content-type": "application/json"}
        )
        assert reply.status_code == 413
        assert reply.json()["error"]["code"] == "request_too_large"
        assert engine.live == {}


async def test_a_cut_round_stages_its_calls_in_batches_each_one_segment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("e2e._worker.engine.CUT_BATCH", 2)
    store = FileTokenStagingStore(tmp_path / "staging")
    calls = [f"c{i}" for i in range(5)]
    async with (
        worker(tmp_path, store=store, token_delay_ms=5) as (client, engine),
        anyio.create_task_group() as group,
    ):
        for call in calls:
            body = _body(call=call, key=f"r-{call}", max_tokens=400)
            group.start_soon(lambda b=body: client.post("/v1/completions", json=b))
        await _until(lambda: all(_generated(engine, call) >= 2 for call in calls))
        receipt = await _cut(client, *[(call, f"r-{call}", 0) for call in calls])
        assert [ack.disposition for ack in receipt.prefixes] == ["durable_prefix"] * 5
        assert len(store.segment_names()) == 3  # five calls, two per batch
        fresh = FileTokenStagingStore(tmp_path / "staging")  # what a restored worker reads
        for ack in receipt.prefixes:
            assert ack.staging_keys is not None and ack.prefix_token_count is not None
            [key] = ack.staging_keys
            entry = fresh.get(key)
            assert entry is not None and entry.record.digest == ack.prefix_digest
            assert entry.record.generated_token_count == ack.prefix_token_count
        await _until(lambda: all(_generated(engine, call) > 80 for call in calls))
        again = await _cut(client, *[(call, f"r-{call}", 0) for call in calls])
        assert len(store.segment_names()) == 6  # each call's next cut stages a chunk
        assert all(len(ack.staging_keys or []) == 2 for ack in again.prefixes)
        await engine.abort(calls)
        group.cancel_scope.cancel()


async def test_unpaced_decoding_yields_once_per_chunk_not_per_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import e2e._worker.engine as engine_module

    yields: list[None] = []
    real = engine_module.anyio.lowlevel.checkpoint

    async def counted() -> None:
        yields.append(None)
        await real()

    monkeypatch.setattr(engine_module.anyio.lowlevel, "checkpoint", counted)
    async with worker(tmp_path, token_delay_ms=0) as (client, _):
        reply = await client.post("/v1/completions", json=_body(max_tokens=200))
    assert reply.status_code == 200
    assert reply.json()["token_ids"] == generate_tokens(0, PROMPT, 0, 200)
    assert len(yields) == 4  # 200 tokens, one yield per 64 (D253)


async def test_the_worker_digests_a_cut_inventory_once_when_it_parses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import protocols._cuts as cuts

    digests: list[str] = []
    real = cuts.inventory_digest

    def counting(*args: Any) -> str:
        digests.append(real(*args))
        return digests[-1]

    async with worker(tmp_path, token_delay_ms=0) as (client, _engine):
        inventory = _inventory(("c1", "r1", 0), ("c2", "r2", 0))
        monkeypatch.setattr(cuts, "inventory_digest", counting)
        reply = await client.post("/ng-control/v1/generation-cut", json=inventory, headers=AUTH)
        assert reply.status_code == 200, reply.text
        assert len(digests) == 1  # the request's parse; the receipt embeds it unchecked
        receipt = GenerationCutReceipt.model_validate_json(reply.content)
        assert len(digests) == 2  # a reader without the verified inventory still checks
        assert receipt.inventory.inventory_digest == inventory["inventory_digest"]


async def test_a_finished_completion_leaves_no_cancelled_watcher_for_the_collector(
    tmp_path: Path,
) -> None:
    """The disconnect watcher of a completion that finished stops without a reference cycle.

    A cancelled task's ``CancelledError`` holds its frames and anyio's ``task_done`` holds the
    error: about a hundred objects per completion that only the cyclic collector frees, and
    what set off nearly all of the worker's collections at 4,000 rollouts in flight (D414).
    """
    async with worker(tmp_path, token_delay_ms=0) as (client, _):
        body = {"prompt_token_ids": PROMPT, "max_tokens": 3}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        gc.collect()
        gc.disable()
        try:
            for _ in range(20):
                assert (await client.post("/v1/completions", json=body)).status_code == 200
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            cancelled = [o for o in gc.garbage if isinstance(o, asyncio.CancelledError)]
            frames = [o.f_code.co_name for o in gc.garbage if isinstance(o, types.FrameType)]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
    assert cancelled == []
    assert "until_disconnected" not in frames


async def test_a_started_worker_has_built_its_cut_route_before_the_first_cut(
    tmp_path: Path,
) -> None:
    # D440: FastAPI builds an included router's models at the first request through it; the
    # worker's lifespan builds them, so the first cut round of a checkpoint does not.
    async def adapters_built_by_first_cut(started: bool) -> int:
        app = create_worker_app(WorkerSettings(root=tmp_path / str(started), control_token=TOKEN))
        lifespan = app.router.lifespan_context(app) if started else contextlib.nullcontext()
        transport = httpx.ASGITransport(app=app)
        async with lifespan, httpx.AsyncClient(transport=transport, base_url="http://w") as http:
            with adapters_built() as built:
                reply = await http.post(
                    "/ng-control/v1/generation-cut", json=_inventory(), headers=AUTH
                )
        assert reply.status_code == 200, reply.text
        return len(built)

    assert await adapters_built_by_first_cut(started=False) > 0
    assert await adapters_built_by_first_cut(started=True) == 0
