"""The engine interface: its contract on the deterministic engine, the worker's side of it
(finished prefixes, finish reasons), the registry and ``serve worker --engine``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
from typer.testing import CliRunner

from e2e import build_app
from e2e._worker.app import WorkerSettings, create_worker_app, read_worker_evidence
from e2e._worker.deterministic import DeterministicEngine
from e2e._worker.engine_api import GenerationRequest, prefix_finish
from e2e._worker.engines import ENGINES, EngineEntry, EngineError, load_engine_factory
from e2e._worker.generation import generate_tokens
from tests.e2e.engine_fakes import RECORDING_ENTRY, STOP_TOKEN, RecordingEngine, Sink
from tests.e2e.test_worker import PROMPT, _body, _cut, worker

pytestmark = pytest.mark.anyio
PROMPT_IDS = tuple(PROMPT)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# --- the contract on the deterministic engine ---------------------------------------------------


async def test_the_tokens_so_far_are_in_the_sink_while_the_call_still_decodes() -> None:
    engine = DeterministicEngine(seed=3, token_delay_ms=5)
    sink = Sink()
    request = GenerationRequest(prompt_token_ids=PROMPT_IDS, max_tokens=400)
    async with anyio.create_task_group() as group:
        group.start_soon(engine.generate, request, sink)
        with anyio.fail_after(10):
            while len(sink.token_ids) < 3:  # noqa: ASYNC110 - the sink announces nothing
                await anyio.sleep(0.002)
        so_far = list(sink.token_ids)
        group.cancel_scope.cancel()  # stopping a call is cancelling its generate
    assert so_far == generate_tokens(3, PROMPT, 0, len(so_far))
    assert len(so_far) < 400 and len(sink.log_probs) >= len(so_far)


async def test_a_continuation_decodes_only_after_its_prefix_and_ends_at_max_tokens() -> None:
    engine = DeterministicEngine(token_delay_ms=0)
    whole = generate_tokens(0, PROMPT, 0, 30)
    sink = Sink()
    request = GenerationRequest(
        prompt_token_ids=PROMPT_IDS, max_tokens=30, prefix_token_ids=tuple(whole[:12])
    )
    assert request.remaining_tokens == 18
    assert await engine.generate(request, sink) == "length"
    assert sink.token_ids == whole[12:]  # the prefix is not repeated; the rest is uninterrupted


async def test_a_stop_token_ends_the_call_with_stop_and_is_part_of_it() -> None:
    tokens = generate_tokens(0, PROMPT, 0, 400)
    stop = tokens.index(STOP_TOKEN)
    engine = DeterministicEngine(token_delay_ms=0, stop_token_ids=frozenset({STOP_TOKEN}))
    sink = Sink()
    request = GenerationRequest(
        prompt_token_ids=PROMPT_IDS, max_tokens=400, stop_token_ids=engine.stop_token_ids
    )
    assert await engine.generate(request, sink) == "stop"
    assert sink.token_ids == tokens[: stop + 1]


def test_a_prefix_that_already_finished_needs_no_decoding() -> None:
    def finish(prefix: list[int], max_tokens: int = 10) -> str | None:
        request = GenerationRequest(
            prompt_token_ids=PROMPT_IDS,
            max_tokens=max_tokens,
            prefix_token_ids=tuple(prefix),
            stop_token_ids=frozenset({STOP_TOKEN}),
        )
        return prefix_finish(request)

    assert finish([1] * 10) == "length"
    assert finish([1, 2, STOP_TOKEN]) == "stop"
    assert finish([1] * 9 + [STOP_TOKEN]) == "stop"  # both: the stop token is what ended it
    assert finish([STOP_TOKEN, 1, 2]) is None  # only the last token of a prefix can end it
    assert finish([]) is None and finish([1] * 9) is None


# --- the worker's side: finished prefixes never reach the engine, finish reasons ------------------


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> None:
    """Register the recording engine under its name, as an optional engine would be."""
    monkeypatch.setitem(ENGINES, "recording", RECORDING_ENTRY)


@pytest.mark.usefixtures("recording")
async def test_a_stopped_call_continued_from_its_terminal_cut_is_not_decoded_again(
    tmp_path: Path,
) -> None:
    tokens = generate_tokens(0, PROMPT, 0, 400)
    stop = tokens.index(STOP_TOKEN)
    async with worker(tmp_path, engine="recording", token_delay_ms=0) as (client, engine):
        inference = engine.inference
        assert isinstance(inference, RecordingEngine)
        done = (await client.post("/v1/completions", json=_body(max_tokens=stop + 10))).json()
        assert done["finish_reason"] == "stop" and done["token_ids"] == tokens[: stop + 1]
        [terminal] = (await _cut(client, ("c1", "r1", 0))).prefixes
        assert terminal.cut_kind == "terminal_completion"
        assert terminal.terminal_finish_reason == "stop"
        assert terminal.prefix_token_count == stop + 1
        replacement = _body("c1-retry", "r1-a1", max_tokens=stop + 10)
        replacement["ng_generation_cut"] = terminal.continuation().model_dump(mode="json")
        reply = (await client.post("/v1/completions", json=replacement)).json()
    assert reply["finish_reason"] == "stop" and reply["token_ids"] == done["token_ids"]
    assert len(inference.requests) == 1, "the finished prefix was handed to the engine"
    [event] = [e for e in read_worker_evidence(tmp_path) if e["model_call_id"] == "c1-retry"]
    assert (event["tokens_generated"], event["tokens_continued"]) == (0, stop + 1)


@pytest.mark.usefixtures("recording")
async def test_a_prefix_at_max_tokens_finishes_with_length_without_the_engine(
    tmp_path: Path,
) -> None:
    async with worker(tmp_path, engine="recording", token_delay_ms=0) as (client, engine):
        inference = engine.inference
        assert isinstance(inference, RecordingEngine)
        # Short enough that the stop token is not drawn: the call ends on max_tokens.
        max_tokens = generate_tokens(0, PROMPT, 0, 400).index(STOP_TOKEN)
        done = (await client.post("/v1/completions", json=_body(max_tokens=max_tokens))).json()
        assert done["finish_reason"] == "length"
        [terminal] = (await _cut(client, ("c1", "r1", 0))).prefixes
        assert terminal.terminal_finish_reason == "length"
        replacement = _body("c1-retry", "r1-a1", max_tokens=max_tokens)
        replacement["ng_generation_cut"] = terminal.continuation().model_dump(mode="json")
        reply = (await client.post("/v1/completions", json=replacement)).json()
        continued = inference.requests[1:]
    assert reply["finish_reason"] == "length" and reply["token_ids"] == done["token_ids"]
    assert continued == [], "a prefix at max_tokens was handed to the engine"


@pytest.mark.usefixtures("recording")
async def test_a_continued_call_hands_the_engine_its_durable_prefix_and_its_version(
    tmp_path: Path,
) -> None:
    tokens = generate_tokens(0, PROMPT, 0, 400)
    max_tokens = tokens.index(STOP_TOKEN)  # the stop token is never drawn: it ends on length
    async with (
        worker(tmp_path, engine="recording", token_delay_ms=5) as (client, engine),
        anyio.create_task_group() as group,
    ):
        body = _body(max_tokens=max_tokens)
        group.start_soon(lambda: client.post("/v1/completions", json=body))
        with anyio.fail_after(10):
            while "c1" not in engine.live or len(engine.live["c1"].generated) < 3:  # noqa: ASYNC110
                await anyio.sleep(0.002)
        [ack] = (await _cut(client, ("c1", "r1", 0))).prefixes
        await engine.abort(["c1"])
    count = ack.prefix_token_count or 0
    assert ack.cut_kind == "active_prefix" and 3 <= count < max_tokens
    async with worker(tmp_path, engine="recording", token_delay_ms=0) as (client, engine):
        replacement = _body("c1-retry", "r1-a1", max_tokens=max_tokens)
        replacement["ng_generation_cut"] = ack.continuation().model_dump(mode="json")
        reply = (await client.post("/v1/completions", json=replacement)).json()
        [request] = engine.inference.requests
    assert request.prompt_token_ids == PROMPT_IDS
    assert request.prefix_token_ids == tuple(tokens[:count])
    assert request.remaining_tokens == max_tokens - count
    assert request.prefix_weight_version == 0 and request.stop_token_ids == {STOP_TOKEN}
    assert reply["finish_reason"] == "length" and reply["token_ids"] == tokens[:max_tokens]


# --- the registry and the command line ----------------------------------------------------------


def _serve(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *args: str) -> tuple[Any, list[Any]]:
    """Run ``serve worker`` up to the point it would serve; the apps it would have served."""
    started: list[Any] = []
    monkeypatch.setattr("e2e._cli.serve.run_server", lambda app, options, role: started.append(app))
    result = CliRunner().invoke(
        build_app(), ["serve", "worker", "--port", "0", "--root", str(tmp_path), *args]
    )
    return result, started


def test_serve_worker_runs_the_deterministic_engine_by_default_and_the_one_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(ENGINES, "recording", RECORDING_ENTRY)
    result, [default_app] = _serve(monkeypatch, tmp_path)
    assert result.exit_code == 0, result.output
    result, [named_app] = _serve(monkeypatch, tmp_path, "--engine", "recording")
    assert result.exit_code == 0, result.output
    default, named = default_app.state.engine.inference, named_app.state.engine.inference
    assert isinstance(default, DeterministicEngine)
    assert isinstance(named, RecordingEngine)
    assert WorkerSettings(root=tmp_path).engine == "deterministic"


def test_an_unknown_engine_is_one_line_exit_2_listing_the_known_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    result, started = _serve(monkeypatch, tmp_path, "--engine", "no-such-engine")
    assert result.exit_code == 2 and started == []
    (line,) = result.output.strip().splitlines()
    assert "unknown engine 'no-such-engine'" in line and "known engines: deterministic" in line
    with pytest.raises(EngineError, match="known engines"):
        create_worker_app(WorkerSettings(root=tmp_path, engine="no-such-engine"))


def test_an_engine_whose_packages_are_missing_names_the_extra_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A real engine module whose import fails, as one whose optional packages are not installed.
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "midflight_test_absent_engine.py").write_text(
        "import midflight_test_absent_package  # not installed anywhere\ndef build(options): ...\n"
    )
    monkeypatch.syspath_prepend(str(modules))
    entry = EngineEntry("midflight_test_absent_engine:build", extra="engine", summary="absent")
    monkeypatch.setitem(ENGINES, "absent", entry)
    with pytest.raises(EngineError) as raised:
        load_engine_factory("absent")
    assert "midflight_test_absent_package" in str(raised.value)
    assert "pip install -e '.[engine]'" in str(raised.value)
    result, started = _serve(monkeypatch, tmp_path, "--engine", "absent")
    assert result.exit_code == 2 and started == []
    (line,) = result.output.strip().splitlines()
    assert "the absent engine needs" in line and "pip install -e '.[engine]'" in line
