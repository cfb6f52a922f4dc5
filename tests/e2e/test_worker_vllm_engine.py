"""The vLLM engine without vLLM: what a call becomes in vLLM's terms, how vLLM's stream is read
into the call's sink, and the registry's one line when vLLM is missing.

vLLM cannot run here (no GPU, not installed), so these tests drive the plain functions of
``e2e/_worker/vllm_mapping.py``; vLLM's outputs are stood in for by plain objects of the shape its
``RequestOutput`` has. ``scripts/gpu-check.sh`` runs the engine itself, through the drill.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from e2e._worker.engine_api import EngineOptions, GenerationRequest
from e2e._worker.engines import ENGINES, EngineError, build_engine
from e2e._worker.tiny_model import ENGINE_FILE, STOP_TOKEN
from e2e._worker.vllm_mapping import (
    engine_arg_kwargs,
    engine_prompt_ids,
    finish_reason_of,
    model_directory,
    model_output_token_ids,
    model_stop_token_ids,
    sampled_tokens,
    sampling_kwargs,
    stream_call,
)
from tests.e2e.engine_fakes import Sink

pytestmark = pytest.mark.anyio
PROMPT = tuple(b"\x02user: count\x03")
OUTPUT_IDS = frozenset(b"abc ")
STOP = frozenset({STOP_TOKEN})


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def delta(token_ids: Sequence[int], finish: str | None = None) -> Any:
    """A ``RequestOutput`` of a DELTA stream: one completion, each token's log-prob -0.25·(i+1)."""
    logprobs = [{t: SimpleNamespace(logprob=-0.25 * (i + 1))} for i, t in enumerate(token_ids)]
    completion = SimpleNamespace(token_ids=list(token_ids), logprobs=logprobs, finish_reason=finish)
    return SimpleNamespace(outputs=[completion])


def write_engine_file(model: Path, **fields: list[int]) -> None:
    model.mkdir(exist_ok=True)
    (model / ENGINE_FILE).write_text(json.dumps(fields))


# --- what a call becomes ------------------------------------------------------------------------


def test_a_continued_call_prefills_its_prompt_then_its_durable_prefix() -> None:
    request = GenerationRequest(prompt_token_ids=PROMPT, max_tokens=30, prefix_token_ids=(97, 98))
    assert engine_prompt_ids(request) == [*PROMPT, 97, 98]


def test_sampling_is_greedy_for_the_remaining_tokens_with_the_sampled_log_prob() -> None:
    request = GenerationRequest(
        prompt_token_ids=PROMPT, max_tokens=30, prefix_token_ids=tuple(b"abcabcabcabc")
    )
    kwargs = sampling_kwargs(request, OUTPUT_IDS)
    assert kwargs["temperature"] == 0.0 and kwargs["n"] == 1
    assert kwargs["max_tokens"] == 18  # the prefix counts against max_tokens
    assert kwargs["logprobs"] == 0  # the sampled token's log-prob alone
    assert kwargs["detokenize"] is False


def test_a_call_stops_on_exactly_its_stop_ids_and_never_on_vllms_own_eos() -> None:
    request = GenerationRequest(
        prompt_token_ids=PROMPT, max_tokens=8, stop_token_ids=frozenset({113, STOP_TOKEN})
    )
    kwargs = sampling_kwargs(request, OUTPUT_IDS)
    assert kwargs["stop_token_ids"] == [STOP_TOKEN, 113]
    assert kwargs["ignore_eos"] is True


def test_only_the_models_output_tokens_and_the_stop_tokens_may_be_generated() -> None:
    request = GenerationRequest(prompt_token_ids=PROMPT, max_tokens=8, stop_token_ids=STOP)
    assert sampling_kwargs(request, OUTPUT_IDS)["allowed_token_ids"] == sorted(OUTPUT_IDS | STOP)
    assert sampling_kwargs(request, None)["allowed_token_ids"] is None  # no engine file: any


@pytest.mark.parametrize(
    ("vllm_reason", "ours"),
    [
        (None, None),
        ("length", "length"),
        ("stop", "stop"),
        ("abort", "abort"),
        ("error", "abort"),
        ("repetition", "abort"),
    ],
)
def test_vllms_finish_reasons_map_to_ours(vllm_reason: str | None, ours: str | None) -> None:
    assert finish_reason_of(vllm_reason) == ours


# --- the engine's arguments and the model's files -----------------------------------------------


def test_the_engine_loads_the_model_directory_with_the_workers_options(tmp_path: Path) -> None:
    options = EngineOptions(seed=7, model=tmp_path, dtype="bfloat16", max_batch=12)
    kwargs = engine_arg_kwargs(tmp_path, options)
    assert kwargs["model"] == kwargs["tokenizer"] == str(tmp_path)
    assert (kwargs["dtype"], kwargs["seed"], kwargs["max_num_seqs"]) == ("bfloat16", 7, 12)
    assert kwargs["enforce_eager"] is True
    assert kwargs["logprobs_mode"] == "processed_logprobs"  # after the allowed-token mask
    assert 0 < kwargs["gpu_memory_utilization"] <= 0.25  # room for a restarted worker's engine


def test_float64_the_default_runs_in_float32_and_an_unknown_dtype_is_refused(
    tmp_path: Path,
) -> None:
    assert EngineOptions().dtype == "float64"
    assert engine_arg_kwargs(tmp_path, EngineOptions())["dtype"] == "float32"
    with pytest.raises(EngineError, match="float32"):
        engine_arg_kwargs(tmp_path, EngineOptions(dtype="int8"))


def test_the_vllm_engine_refuses_a_missing_model_directory_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="needs --model DIR"):
        model_directory(EngineOptions())
    with pytest.raises(EngineError, match="is not a directory"):
        model_directory(EngineOptions(model=tmp_path / "absent"))
    assert model_directory(EngineOptions(model=tmp_path)) == tmp_path


def test_the_stop_and_output_tokens_are_the_engine_files(tmp_path: Path) -> None:
    write_engine_file(tmp_path, output_token_ids=sorted(OUTPUT_IDS | STOP), stop_token_ids=[10])
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert model_stop_token_ids(tmp_path) == frozenset({10})
    assert model_output_token_ids(tmp_path) == OUTPUT_IDS | STOP


def test_without_an_engine_file_the_stop_tokens_are_the_models_eos_ids(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert model_stop_token_ids(tmp_path) == frozenset({7})
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 4]}))
    assert model_stop_token_ids(tmp_path) == frozenset({3, 4})  # the generation config first
    assert model_output_token_ids(tmp_path) is None
    assert model_stop_token_ids(tmp_path / "empty") == frozenset()


# --- reading vLLM's stream ----------------------------------------------------------------------


def test_each_sampled_token_comes_with_its_own_log_prob() -> None:
    assert sampled_tokens(delta([97, 98])) == [(97, -0.25), (98, -0.5)]
    assert sampled_tokens(delta([])) == []  # a delta may carry only the finish


def test_a_delta_whose_log_probs_do_not_cover_its_tokens_is_refused() -> None:
    short = delta([97, 98])
    short.outputs[0].logprobs = short.outputs[0].logprobs[:1]
    with pytest.raises(ValueError, match="2 tokens carried 1 log-probs"):
        sampled_tokens(short)
    other = delta([97])
    other.outputs[0].logprobs = [{98: SimpleNamespace(logprob=-1.0)}]
    with pytest.raises(ValueError, match="sampled token 97"):
        sampled_tokens(other)
    two = delta([97])
    two.outputs.append(two.outputs[0])
    with pytest.raises(ValueError, match="held 2 completions"):
        sampled_tokens(two)


class Aborts:
    """The engine's abort of one call, recording that it ran to the end."""

    def __init__(self, *, hang: bool = False) -> None:
        self.completed = 0
        self.hang = hang

    async def __call__(self) -> None:
        await anyio.sleep(0.01)  # a real abort sends a message: it can be cancelled mid-way
        if self.hang:
            await anyio.sleep_forever()
        self.completed += 1


async def test_each_token_is_in_the_sink_as_soon_as_vllm_streams_it() -> None:
    released = anyio.Event()

    async def outputs() -> AsyncGenerator[Any, None]:
        yield delta([97, 98])
        await released.wait()
        yield delta([99, STOP_TOKEN], finish="stop")

    sink, abort, finished = Sink(), Aborts(), []

    async def call() -> None:
        finished.append(await stream_call(outputs(), sink, abort))

    async with anyio.create_task_group() as group:
        group.start_soon(call)
        with anyio.fail_after(10):
            while len(sink.token_ids) < 2:  # noqa: ASYNC110 - the sink announces nothing
                await anyio.sleep(0.002)
        assert sink.token_ids == [97, 98] and not finished  # the call still decodes
        released.set()
    assert finished == ["stop"]
    assert sink.token_ids == [97, 98, 99, STOP_TOKEN]  # the stop token is part of the completion
    assert sink.log_probs == [-0.25, -0.5, -0.25, -0.5]
    assert abort.completed == 0  # vLLM finished the request itself


async def test_a_call_ends_with_vllms_finish_and_an_abort_of_vllms_is_ours() -> None:
    async def outputs(finish: str) -> AsyncGenerator[Any, None]:
        yield delta([97])
        yield delta([98], finish=finish)

    for finish, ours in (("length", "length"), ("abort", "abort")):
        abort = Aborts()
        assert await stream_call(outputs(finish), Sink(), abort) == ours
        assert abort.completed == 0


async def test_a_cancelled_call_frees_its_vllm_request_before_it_propagates() -> None:
    async def outputs() -> AsyncGenerator[Any, None]:
        yield delta([97])
        await anyio.sleep_forever()
        yield delta([98], finish="length")  # never reached

    sink, abort = Sink(), Aborts()
    async with anyio.create_task_group() as group:
        group.start_soon(stream_call, outputs(), sink, abort)
        with anyio.fail_after(10):
            while not sink.token_ids:  # noqa: ASYNC110 - the sink announces nothing
                await anyio.sleep(0.002)
        group.cancel_scope.cancel()  # stopping a call is cancelling it
    assert abort.completed == 1  # shielded: the cancellation did not cut the abort short
    assert sink.token_ids == [97]


async def test_a_failed_stream_frees_its_vllm_request_and_raises() -> None:
    async def outputs() -> AsyncGenerator[Any, None]:
        yield delta([97])
        raise RuntimeError("engine core died")

    abort = Aborts()
    with pytest.raises(RuntimeError, match="engine core died"):
        await stream_call(outputs(), Sink(), abort)
    assert abort.completed == 1


async def test_an_abort_that_hangs_is_given_up_after_its_deadline() -> None:
    async def outputs() -> AsyncGenerator[Any, None]:
        yield delta([97])
        await anyio.sleep_forever()
        yield delta([98], finish="length")  # never reached

    sink, abort = Sink(), Aborts(hang=True)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(lambda: stream_call(outputs(), sink, abort, abort_deadline_s=0.05))
            while not sink.token_ids:  # noqa: ASYNC110 - the sink announces nothing
                await anyio.sleep(0.002)
            group.cancel_scope.cancel()
    assert abort.completed == 0  # the call left without it


# --- the registry -------------------------------------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_the_vllm_engine_without_vllm_installed_is_one_line_naming_the_extra(
    tmp_path: Path,
) -> None:
    entry = ENGINES["vllm"]
    assert (entry.factory, entry.extra) == ("e2e._worker.vllm_engine:build_vllm_engine", "vllm")
    with pytest.raises(EngineError, match=r"needs 'vllm'.*pip install -e '\.\[vllm\]'"):
        build_engine("vllm", EngineOptions(model=tmp_path))
