"""The transformers engine on the tiny model: reproducible model, batched greedy decoding that
equals decoding alone, continuations from a durable prefix, cancellation, bad input, and a cut on
the real model surviving a SIGKILL of the worker process.

``make test`` installs the ``engine`` extra first, so none of this is skipped there.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import anyio
import httpx
import pytest

from e2e._worker.app import WorkerSettings, create_worker_app, read_worker_evidence
from e2e._worker.engine_api import GenerationRequest
from e2e._worker.tiny_model import ENGINE_FILE, STOP_TOKEN, build_tiny_model
from e2e._worker.transformers_decode import LoadedModel, greedy_decode
from e2e._worker.transformers_engine import TransformersEngine
from participants import FileTokenStagingStore, rebuild_generation_cut
from protocols import (
    encode,
    render_prompt,
)
from tests.e2e.engine_fakes import Sink
from tests.e2e.processes import cut_one_call, kill_group, serve

pytestmark = pytest.mark.anyio
TOKEN = "engine-test-token"
MAX_TOKENS = 60


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model").directory


@pytest.fixture(scope="module")
def model(model_dir: Path) -> LoadedModel:
    return LoadedModel(model_dir, "float64")


def _prompt(user: str) -> list[int]:
    return encode(
        render_prompt([{"role": "system", "content": "counter"}, {"role": "user", "content": user}])
    )


def test_the_tiny_model_is_reproducible_byte_for_byte_and_its_tokens_are_bytes(
    tmp_path: Path, model_dir: Path
) -> None:
    from transformers import AutoTokenizer

    again = build_tiny_model(tmp_path / "again")
    other = build_tiny_model(tmp_path / "other", seed=1)
    first = build_tiny_model(tmp_path / "first")
    assert again.digest == first.digest != other.digest
    for name in ("model.safetensors", "config.json", "tokenizer.json", ENGINE_FILE):
        assert (again.directory / name).read_bytes() == (model_dir / name).read_bytes()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = "\x02user\x03ab 7\x04\n"
    assert tokenizer.encode(text, add_special_tokens=False) == encode(text)
    engine_file = json.loads((model_dir / ENGINE_FILE).read_text())
    assert engine_file["stop_token_ids"] == [STOP_TOKEN]
    # Rebuilding over an existing model replaces it whole and leaves no temporary directory.
    build_tiny_model(tmp_path / "first", seed=1)
    assert build_tiny_model(tmp_path / "first", seed=1).digest == other.digest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again", "first", "other"]


async def test_calls_decoded_together_get_what_each_decodes_alone(
    tmp_path: Path, model_dir: Path, model: LoadedModel
) -> None:
    # max_batch 3 for 9 staggered calls: calls join a running batch and wait for a free row.
    app = create_worker_app(
        WorkerSettings(root=tmp_path, engine="transformers", model=model_dir, max_batch=3)
    )
    prompts = [_prompt(f"p{i} {i % 4}") for i in range(9)]
    replies: dict[int, dict[str, object]] = {}
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://worker") as client:

            async def call(index: int) -> None:
                await anyio.sleep(index * 0.004)
                reply = await client.post(
                    "/v1/completions",
                    json={"prompt_token_ids": prompts[index], "max_tokens": 24 + index},
                )
                assert reply.status_code == 200, reply.text
                replies[index] = reply.json()

            async with anyio.create_task_group() as group:
                for index in range(9):
                    group.start_soon(call, index)
    finishes = set()
    for index, reply in replies.items():
        alone = greedy_decode(model, prompts[index], 24 + index, model.stop_token_ids)
        assert reply["token_ids"] == alone, index
        finishes.add(reply["finish_reason"])
        assert reply["finish_reason"] == ("stop" if alone[-1] == STOP_TOKEN else "length")
    assert finishes, replies


async def test_a_continuation_decodes_only_after_prompt_plus_prefix(model: LoadedModel) -> None:
    engine = TransformersEngine(model)
    prompt = _prompt("p0 3")
    whole = greedy_decode(model, prompt, MAX_TOKENS, model.stop_token_ids)
    assert len(whole) == MAX_TOKENS  # this prompt runs to max_tokens (the tiny model is seeded)
    sink = Sink()
    request = GenerationRequest(
        prompt_token_ids=tuple(prompt),
        max_tokens=MAX_TOKENS,
        prefix_token_ids=tuple(whole[:17]),
        stop_token_ids=model.stop_token_ids,
    )
    async with engine.running():
        assert await engine.generate(request, sink) == "length"
    assert sink.token_ids == whole[17:]  # exactly the rest: max_tokens counts the prefix
    # A token's log-prob is its log-softmax over the tokens the model may output (D313).
    import torch

    with torch.inference_mode():
        logits = model.model(input_ids=torch.tensor([prompt + whole[:17]])).logits[0, -1]
    allowed = model.output_token_ids
    assert allowed is not None and STOP_TOKEN in allowed.tolist() and len(allowed) == 38
    expected = torch.log_softmax(logits[allowed], dim=-1)[allowed.tolist().index(whole[17])]
    assert sink.log_probs[0] == pytest.approx(float(expected), abs=1e-9)


async def test_a_cancelled_call_leaves_the_batch_before_its_cancellation_propagates(
    model: LoadedModel,
) -> None:
    engine = TransformersEngine(model, step_delay_s=0.01)
    requests = [
        GenerationRequest(
            prompt_token_ids=tuple(_prompt(f"p{i} 3")),
            max_tokens=MAX_TOKENS,
            stop_token_ids=frozenset(),
        )
        for i in range(2)
    ]
    sinks = [Sink(), Sink()]
    async with engine.running():
        doomed = anyio.CancelScope()

        async def cancelled_call() -> None:
            with doomed:
                await engine.generate(requests[0], sinks[0])

        async with anyio.create_task_group() as group:
            group.start_soon(cancelled_call)
            group.start_soon(functools.partial(engine.generate, requests[1], sinks[1]))
            with anyio.fail_after(30):
                while len(sinks[0].token_ids) < 3:  # noqa: ASYNC110 - the scheduler's own pace
                    await anyio.sleep(0.005)
            doomed.cancel()
            with anyio.fail_after(30):
                while not doomed.cancelled_caught:  # noqa: ASYNC110
                    await anyio.sleep(0.005)
            rows = [slot.request for slot in engine._rows]
            assert requests[0] not in rows  # freed before the cancellation reached its caller
            assert engine._batch is not None and engine._batch.rows == 1
            stopped_at = len(sinks[0].token_ids)
    assert len(sinks[1].token_ids) == MAX_TOKENS
    assert len(sinks[0].token_ids) == stopped_at < MAX_TOKENS


async def test_a_call_longer_than_the_models_positions_is_a_typed_422(
    tmp_path: Path, model_dir: Path
) -> None:
    app = create_worker_app(WorkerSettings(root=tmp_path, engine="transformers", model=model_dir))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://worker") as client:
            reply = await client.post(
                "/v1/completions", json={"prompt_token_ids": _prompt("p0 1"), "max_tokens": 5000}
            )
            healthy = await client.get("/healthz")
    assert reply.status_code == 422, reply.text
    assert reply.json()["error"]["code"] == "invalid_request"
    assert "4096 positions" in reply.json()["error"]["detail"]
    assert healthy.json()["in_flight"] == 0


def test_a_model_engine_without_a_model_or_with_an_unknown_dtype_is_refused(
    tmp_path: Path, model_dir: Path
) -> None:
    from e2e._worker.engines import EngineError

    with pytest.raises(EngineError, match="needs --model DIR"):
        create_worker_app(WorkerSettings(root=tmp_path, engine="transformers"))
    with pytest.raises(EngineError, match="unknown dtype"):
        create_worker_app(
            WorkerSettings(root=tmp_path, engine="transformers", model=model_dir, dtype="int3")
        )
    with pytest.raises(EngineError, match="no model loads"):
        create_worker_app(WorkerSettings(root=tmp_path, engine="transformers", model=tmp_path))


def _completion(call: str, key: str, prompt: list[int]) -> dict[str, object]:
    return {
        "prompt_token_ids": prompt,
        "max_tokens": MAX_TOKENS,
        "ng_capture": {"rollout_id": key, "model_call_id": call, "mode": "text"},
    }


@pytest.mark.process
async def test_a_cut_of_the_real_model_survives_sigkill_and_continues_from_its_exact_prefix(
    tmp_path: Path, model_dir: Path, model: LoadedModel
) -> None:
    prompt = _prompt("p0 3")
    root = tmp_path / "run"
    args = ("--root", str(root), "--engine", "transformers", "--model", str(model_dir))
    args += ("--token-delay-ms", "20")  # a pause per decode step: the cut lands mid-generation
    env = {"MIDFLIGHT_CONTROL_TOKEN": TOKEN}
    log = tmp_path / "worker.log"
    with serve("worker", *args, log=log, env=env) as (url, process):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            outcome: dict[str, object] = {}

            async def doomed_call() -> None:
                try:
                    outcome["reply"] = await client.post(
                        "/v1/completions", json=_completion("c1", "p1", prompt)
                    )
                except httpx.TransportError as exc:
                    outcome["error"] = exc

            async with anyio.create_task_group() as group:
                group.start_soon(doomed_call)
                with anyio.fail_after(30):
                    while (await client.get("/healthz")).json()["in_flight"] < 1:  # noqa: ASYNC110
                        await anyio.sleep(0.01)
                await anyio.sleep(0.3)  # let some tokens decode
                receipt = await cut_one_call(client, TOKEN, rollout_id="p1", model_call_id="c1")
                kill_group(process)  # the crash: mid-decode, right after the receipt
    [ack] = receipt.prefixes
    assert ack.disposition == "durable_prefix" and ack.cut_kind == "active_prefix"
    cut = ack.prefix_token_count or 0
    assert 0 < cut < MAX_TOKENS, "the cut must land in the middle of the decode"
    assert "error" in outcome and read_worker_evidence(root) == []
    continuation = ack.continuation()
    store = FileTokenStagingStore(root / "staging")
    records = [store.get(key) for key in continuation.staging_keys]
    snapshot = rebuild_generation_cut([entry.record for entry in records if entry is not None])
    durable = [
        t
        for t, mask in zip(snapshot.token_ids_delta, snapshot.token_mask_delta, strict=True)
        if mask
    ]
    assert len(durable) == cut

    with serve("worker", *args, log=log, env=env) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            replacement = _completion("c1-retry", "p1-a1", prompt)
            replacement["ng_generation_cut"] = continuation.model_dump(mode="json")
            reply = await client.post("/v1/completions", json=replacement)
    assert reply.status_code == 200, reply.text
    tokens = reply.json()["token_ids"]
    assert tokens[:cut] == durable  # the exact durable prefix, unchanged
    assert len(tokens) <= MAX_TOKENS
    # The rest is what the model decodes from prompt + prefix, and here (float64) what the
    # uninterrupted call decodes.
    rest = greedy_decode(model, prompt + durable, MAX_TOKENS - cut, model.stop_token_ids)
    assert tokens[cut:] == rest
    assert tokens == greedy_decode(model, prompt, MAX_TOKENS, model.stop_token_ids)
    [event] = read_worker_evidence(root)
    assert event["continued_from"] == "c1" and event["tokens_continued"] == cut
    assert event["tokens_generated"] == len(tokens) - cut
