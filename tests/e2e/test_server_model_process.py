"""Real worker and policy processes: a 3-call chain token for token, then a SIGKILL of the
policy server with a call undelivered (and cut) at the checkpoint, and a fresh process whose
re-issued call continues the cut."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from e2e._servers.model import read_policy_evidence
from e2e._worker.app import read_worker_evidence
from participants import FileTokenStagingStore
from protocols import encode, render_prompt
from tests.e2e.processes import kill_group, serve

pytestmark = [pytest.mark.process, pytest.mark.anyio]
TOKEN = "policy-process-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
CONTROL = "/ng-control/v1/checkpoint"
MANIFEST = "/training-token-capture/control/rollouts/{}/manifest"


async def _chat(client: httpx.AsyncClient, key: str, messages: list[dict[str, str]]) -> str:
    reply = await client.post(
        f"/ng-rollout/{key}/v1/chat/completions", json={"messages": messages, "max_tokens": 16}
    )
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["message"]["content"])


async def _control(client: httpx.AsyncClient, operation: str, **body: Any) -> dict[str, Any]:
    body["deadline_ts"] = time.time() + 60
    reply = await client.post(f"{CONTROL}/{operation}", json=body, headers=AUTH)
    assert reply.status_code == 200, reply.text
    result: dict[str, Any] = reply.json()
    return result


def _staged(root: Path, records: list[dict[str, Any]]) -> list[int]:
    store = FileTokenStagingStore(root / "staging")
    tokens: list[int] = []
    for record in records:
        entry = store.get(record["staging_key"])
        assert entry is not None
        tokens += entry.record.token_ids_delta
    return tokens


async def _status(client: httpx.AsyncClient) -> dict[str, Any]:
    reply = await client.get(f"{CONTROL}/status", headers=AUTH)
    counts: dict[str, Any] = reply.json()["report"]["counts"]
    return counts


async def _until_counts(client: httpx.AsyncClient, name: str, value: int) -> None:
    with anyio.fail_after(30):  # bounds the wait; asserts nothing about speed
        while True:
            if (await _status(client))[name] == value:
                return
            await anyio.sleep(0.02)  # another process: polling its status is the only way


async def test_a_three_call_chain_then_sigkill_with_a_held_call_and_a_fresh_process_continuing(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    env = {"MIDFLIGHT_CONTROL_TOKEN": TOKEN}
    checkpoint = str(root / "checkpoints" / "ckpt")  # under the run root (D240)
    scope = [{"rollout_id": "r1", "attempt": 0}]
    worker_args = ("--root", str(root), "--token-delay-ms", "30")
    with serve("worker", *worker_args, log=tmp_path / "worker.log", env=env) as (w, _):
        policy_args = ("--root", str(root), "--worker-url", w)
        messages = [{"role": "system", "content": "counter"}, {"role": "user", "content": "r1 0"}]
        with serve("model", *policy_args, log=tmp_path / "policy.log", env=env) as (url, first):
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                for turn in range(3):
                    completion = await _chat(client, "r1", messages)
                    if turn < 2:
                        messages.append({"role": "assistant", "content": completion})
                        messages.append({"role": "tool", "content": f"add {turn} -> {turn} 0"})
                chain = (await client.get(MANIFEST.format("r1"), headers=AUTH)).json()["records"]
                # The decisive check: 3 records chained parent to child, and the staged deltas
                # along the last call's chain are its prompt plus its completion, token for token.
                assert [r["parent_call_id"] for r in chain] == [
                    None,
                    chain[0]["model_call_id"],
                    chain[1]["model_call_id"],
                ]
                assert _staged(root, chain) == encode(render_prompt(messages)) + encode(completion)
                messages.append({"role": "assistant", "content": completion})
                messages.append({"role": "tool", "content": "add 2 -> 2 0"})
                async with anyio.create_task_group() as group:
                    group.start_soon(_doomed_call, client, messages)
                    await _until_counts(client, "inflight", 1)
                    await _until_worker_busy(w)
                    await anyio.sleep(0.15)  # lets a few tokens exist; nothing asserts on timing
                    await _control(client, "prepare", checkpoint_id="c1")
                    await _until_counts(client, "held", 1)
                    committed = await _control(
                        client,
                        "commit",
                        checkpoint_id="c1",
                        checkpoint_dir=checkpoint,
                        episode_ids=scope,
                    )
                    kill_group(first)
        # The held call's row stays out; its cut's staged prefix is kept besides the chain.
        chain_keys = {r["staging_key"] for r in chain}
        assert chain_keys < set(committed["staging_keys"])
        with serve("model", *policy_args, log=tmp_path / "policy.log", env=env) as (url, _):
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                restored = await _control(
                    client,
                    "restore",
                    checkpoint_id="c2",
                    checkpoint_dir=checkpoint,
                    episode_ids=scope,
                )
                assert restored["restored"] == ["r1-a1"]
                status = (await client.get(f"{CONTROL}/status", headers=AUTH)).json()
                assert status["restored_generation_cuts"] == ["r1-a1"], status
                await _control(client, "resume", checkpoint_id="c2")
                stale = await client.post(
                    "/ng-rollout/r1/v1/chat/completions",
                    json={"messages": messages, "max_tokens": 16},
                )
                assert stale.json()["error"]["code"] == "stale_attempt"
                fourth = await _chat(client, "r1-a1", messages)
                manifest = (await client.get(MANIFEST.format("r1-a1"), headers=AUTH)).json()
    records = manifest["records"]
    assert [r["model_call_id"] for r in records[:3]] == [r["model_call_id"] for r in chain]
    assert records[3]["parent_call_id"] == chain[2]["model_call_id"]  # the last delivered call
    assert _staged(root, records) == encode(render_prompt(messages)) + encode(fourth)
    egress = read_policy_evidence(root)
    delivered = [e["model_call_id"] for e in egress]
    assert len(delivered) == len(set(delivered)) == 4  # no delivered call was executed again
    assert [e["capture_key"] for e in egress] == ["r1", "r1", "r1", "r1-a1"]
    assert [e["continued_cut"] for e in egress] == [False, False, False, True]
    # The re-issued call continued the held call's durable prefix and generated only the rest.
    held_id = [e for e in read_policy_evidence(root, event="admit") if e["capture_key"] == "r1"][3][
        "model_call_id"
    ]
    (reissued,) = [e for e in read_worker_evidence(root) if e["capture_key"] == "r1-a1"]
    assert reissued["continued_from"] == held_id
    assert reissued["tokens_continued"] + reissued["tokens_generated"] == 16


async def _until_worker_busy(worker_url: str) -> None:
    async with httpx.AsyncClient(base_url=worker_url, timeout=10) as worker:
        with anyio.fail_after(30):  # bounds the wait; asserts nothing about speed
            while True:
                if (await worker.get("/healthz")).json()["in_flight"] >= 1:
                    return
                await anyio.sleep(0.02)  # another process: polling is the only way


async def _doomed_call(client: httpx.AsyncClient, messages: list[dict[str, str]]) -> None:
    """The call held at the checkpoint; the SIGKILL ends it without a response."""
    with contextlib.suppress(httpx.TransportError):
        await client.post(
            "/ng-rollout/r1/v1/chat/completions", json={"messages": messages, "max_tokens": 16}
        )
