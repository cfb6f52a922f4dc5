"""The real worker process: a cut mid-decode, a SIGKILL, a fresh process continuing the cut."""

from __future__ import annotations

import functools
import time
from pathlib import Path

import anyio
import httpx
import pytest

from e2e._worker.app import read_worker_evidence
from e2e._worker.generation import generate_tokens
from protocols import (
    encode,
    render_prompt,
)
from tests.e2e.processes import cut_one_call, kill_group, serve

pytestmark = [pytest.mark.process, pytest.mark.anyio]
TOKEN = "process-test-token"
PROMPT = encode(
    render_prompt([{"role": "system", "content": "counter"}, {"role": "user", "content": "p1 3"}])
)
MAX_TOKENS = 60


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _completion(call: str, key: str) -> dict[str, object]:
    return {
        "prompt_token_ids": PROMPT,
        "max_tokens": MAX_TOKENS,
        "ng_capture": {"rollout_id": key, "model_call_id": call, "mode": "text"},
    }


async def test_a_cut_survives_sigkill_and_a_fresh_worker_generates_only_the_rest(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    args = ("--root", str(root), "--token-delay-ms", "20", "--seed", "3")
    env = {"MIDFLIGHT_CONTROL_TOKEN": TOKEN}
    log = tmp_path / "worker.log"
    with serve("worker", *args, log=log, env=env) as (url, process):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            outcome: dict[str, object] = {}

            async def doomed_call() -> None:
                try:
                    outcome["reply"] = await client.post(
                        "/v1/completions", json=_completion("c1", "p1")
                    )
                except httpx.TransportError as exc:
                    outcome["error"] = exc

            async with anyio.create_task_group() as group:
                group.start_soon(doomed_call)
                with anyio.fail_after(20):
                    while (await client.get("/healthz")).json()["in_flight"] < 1:  # noqa: ASYNC110
                        await anyio.sleep(0.01)
                await anyio.sleep(0.2)  # let a few tokens decode
                receipt = await cut_one_call(client, TOKEN, rollout_id="p1", model_call_id="c1")
                kill_group(process)  # the crash: mid-decode, right after the receipt
    [ack] = receipt.prefixes
    assert ack.disposition == "durable_prefix" and ack.cut_kind == "active_prefix"
    cut = ack.prefix_token_count or 0
    assert 0 < cut < MAX_TOKENS, "the cut must land in the middle of the decode"
    assert "error" in outcome, "the original call must have died with its worker"
    assert read_worker_evidence(root) == []  # it never finished anywhere

    with serve("worker", *args, log=log, env=env) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            replacement = _completion("c1-retry", "p1-a1")
            replacement["ng_generation_cut"] = ack.continuation().model_dump(mode="json")
            reply = await client.post("/v1/completions", json=replacement)
    assert reply.status_code == 200, reply.text
    assert reply.json()["token_ids"] == generate_tokens(3, PROMPT, 0, MAX_TOKENS)
    [event] = read_worker_evidence(root)
    assert event["model_call_id"] == "c1-retry" and event["continued_from"] == "c1"
    assert event["tokens_continued"] == cut
    assert event["tokens_generated"] == MAX_TOKENS - cut


async def test_serve_worker_reports_its_port_and_without_a_token_has_no_cut_route(
    tmp_path: Path,
) -> None:
    with serve(
        "worker",
        "--root",
        str(tmp_path),
        "--token-delay-ms",
        "0",
        log=tmp_path / "w.log",
        env={"MIDFLIGHT_CONTROL_TOKEN": ""},
    ) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            assert (await client.get("/healthz")).status_code == 200
            cut = await client.post("/ng-control/v1/generation-cut", json={})
            assert cut.status_code == 404
            reply = await client.post(
                "/v1/completions", json={"prompt_token_ids": PROMPT, "max_tokens": 4}
            )
            assert reply.json()["token_ids"] == generate_tokens(0, PROMPT, 0, 4)


async def _in_flight(client: httpx.AsyncClient) -> int:
    return int((await client.get("/healthz")).json()["in_flight"])


async def _until_in_flight(client: httpx.AsyncClient, count: int) -> None:
    with anyio.fail_after(30):  # bounds the wait; asserts nothing about speed
        while await _in_flight(client) != count:  # noqa: ASYNC110 - another process: polling its health is the only way
            await anyio.sleep(0.02)


def _staged_keys(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "staging").rglob("*") if p.is_file())


async def test_a_caller_that_disconnects_stops_the_generation(tmp_path: Path) -> None:
    root = tmp_path / "run"
    args = ("--root", str(root), "--token-delay-ms", "25")
    env = {"MIDFLIGHT_CONTROL_TOKEN": TOKEN}
    with serve("worker", *args, log=tmp_path / "worker.log", env=env) as (url, _process):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            async with anyio.create_task_group() as group:
                group.start_soon(
                    functools.partial(client.post, json=_completion("c1", "gone")),
                    "/v1/completions",
                )
                await _until_in_flight(client, 1)
                group.cancel_scope.cancel()  # the caller goes away: its connection closes
            await _until_in_flight(client, 0)  # long before the 1.5 s its tokens would take
            await anyio.sleep(MAX_TOKENS * 0.025)  # past the time the whole call would take
            events = read_worker_evidence(root)
            assert [e for e in events if e.get("capture_key") == "gone"] == []
            assert _staged_keys(root) == []


async def test_a_retire_aborts_the_call_on_the_worker_before_it_returns(tmp_path: Path) -> None:
    root = tmp_path / "run"
    env = {"MIDFLIGHT_CONTROL_TOKEN": TOKEN}
    worker_args = ("--root", str(root), "--token-delay-ms", "25")
    with serve("worker", *worker_args, log=tmp_path / "worker.log", env=env) as (w, _):
        policy_args = ("--root", str(root), "--worker-url", w)
        with serve("model", *policy_args, log=tmp_path / "policy.log", env=env) as (url, _p):
            async with (
                httpx.AsyncClient(base_url=w, timeout=30) as worker,
                httpx.AsyncClient(base_url=url, timeout=30) as policy,
            ):
                messages = [{"role": "user", "content": "r1 0"}]
                chat = {"messages": messages, "max_tokens": MAX_TOKENS}
                async with anyio.create_task_group() as group:
                    call = functools.partial(policy.post, json=chat)
                    group.start_soon(call, "/ng-rollout/r1/v1/chat/completions")
                    await _until_in_flight(worker, 1)
                    body = {
                        "checkpoint_id": "retire-1",
                        "deadline_ts": time.time() + 30,
                        "episode_ids": [{"rollout_id": "r1", "attempt": 0}],
                    }
                    retired = await policy.post(
                        "/ng-control/v1/checkpoint/retire",
                        json=body,
                        headers={"authorization": f"Bearer {TOKEN}"},
                    )
                    assert retired.status_code == 200, retired.text
                    # The retire returned: the worker has already stopped the call (D245).
                    assert await _in_flight(worker) == 0
                await anyio.sleep(MAX_TOKENS * 0.025)  # past the time the whole call would take
                events = read_worker_evidence(root)
                assert [e for e in events if e.get("capture_key") == "r1"] == []
                assert _staged_keys(root) == []
