"""The policy server in-process over a worker that serves cuts: constrained calls stay uncut, a
restored cut is continued, ledger removal waits out a checkpoint, repeated restores."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from e2e._servers.cluster import default_cluster
from e2e._servers.context import ServeContext
from e2e._servers.model import create_model_app, read_policy_evidence
from e2e._worker.app import WorkerSettings, create_worker_app, read_worker_evidence
from participants import FileTokenStagingStore
from protocols import LEDGER_CONTROL_PREFIX
from tests.e2e.test_server_model import (
    AUTH,
    MANIFEST,
    TOKEN,
    content_of,
    control,
    conversation,
)

pytestmark = pytest.mark.anyio
SCOPE = [{"rollout_id": "r1", "attempt": 0}]


@asynccontextmanager
async def cutting_policy(
    root: Path, *, token_delay_ms: float = 0.0
) -> AsyncIterator[tuple[httpx.AsyncClient, FastAPI]]:
    """A policy app over a worker app whose cut route is installed (same control token)."""
    settings = WorkerSettings(root=root, token_delay_ms=token_delay_ms, control_token=TOKEN)
    worker = create_worker_app(settings)
    ctx = ServeContext("policy", 0, root, default_cluster(root), TOKEN, TOKEN)
    app = create_model_app(ctx, worker_transport=httpx.ASGITransport(app=worker))
    app.state.worker_engine = worker.state.engine
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://policy") as client:
            yield client, app


async def _chat(
    client: httpx.AsyncClient, key: str, messages: list[dict[str, str]], **extra: Any
) -> httpx.Response:
    body = {"messages": messages, "max_tokens": 40, **extra}
    return await client.post(f"/ng-rollout/{key}/v1/chat/completions", json=body)


async def _checkpoint_with_a_held_call(
    root: Path, **extra: Any
) -> tuple[dict[str, Any], list[dict[str, str]]]:
    """One delivered call, then one held through a commit; returns the commit and its request."""
    async with cutting_policy(root, token_delay_ms=20) as (client, app):
        messages = await conversation(client, "r1", 1)
        async with anyio.create_task_group() as group:
            group.start_soon(functools.partial(_chat, client, "r1", messages, **extra))
            await _until_generating(app)
            prepared = await control(client, "prepare", checkpoint_id="c1")
            assert prepared.status_code == 200, prepared.text
            counts = (await client.get("/ng-control/v1/checkpoint/status", headers=AUTH)).json()
            committed = await control(
                client,
                "commit",
                checkpoint_id="c1",
                checkpoint_dir=str(root / "ckpt"),
                episode_ids=SCOPE,
            )
            assert committed.status_code == 200, committed.text
            group.cancel_scope.cancel()  # the crash: the held call never answers
    return {**committed.json(), "counts": counts["report"]["counts"]}, messages


async def _until_generating(app: FastAPI) -> None:
    """Until the worker decodes the call (a cut of a call not there yet is a failure)."""
    engine = app.state.worker_engine
    with anyio.fail_after(30):  # bounds the wait; asserts nothing about speed
        while True:
            if any(live.generated for live in engine.live.values()):
                return
            await anyio.sleep(0.005)  # the worker has no change feed to wait on


async def _restore(client: httpx.AsyncClient, root: Path, checkpoint_id: str) -> None:
    restored = await control(
        client,
        "restore",
        checkpoint_id=checkpoint_id,
        checkpoint_dir=str(root / "ckpt"),
        episode_ids=SCOPE,
    )
    assert restored.status_code == 200, restored.text
    assert (await control(client, "resume", checkpoint_id=checkpoint_id)).status_code == 200


async def _cut_outcomes(client: httpx.AsyncClient) -> dict[str, float]:
    """``midflight_generation_cuts_total`` by outcome, as ``/metrics`` shows it."""
    text = (await client.get("/metrics")).text
    return {
        sample.labels["outcome"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "midflight_generation_cuts_total"
    }


async def test_a_held_call_is_cut_and_its_reissue_continues_only_the_remainder(
    tmp_path: Path,
) -> None:
    committed, messages = await _checkpoint_with_a_held_call(tmp_path)
    assert committed["counts"]["cut"] == 1, committed["counts"]
    assert any(
        k.startswith("__generation_cut__/") or k.startswith("r1/")
        for k in committed["staging_keys"]
    )
    async with cutting_policy(tmp_path) as (client, _app):
        await _restore(client, tmp_path, "c2")
        reissued = await _chat(client, "r1-a1", messages)
        content_of(reissued)
        outcomes = await _cut_outcomes(client)
    assert (outcomes["continued"], outcomes["refused"]) == (1, 0)
    (generation,) = [e for e in read_worker_evidence(tmp_path) if e["capture_key"] == "r1-a1"]
    assert generation["continued_from"] is not None
    assert generation["tokens_continued"] >= 1  # the worker had decoded tokens at the cut
    assert generation["tokens_continued"] + generation["tokens_generated"] == 40
    assert read_policy_evidence(tmp_path)[-1]["continued_cut"] is True


async def test_a_constrained_call_is_never_cut_nor_continues_a_cut(tmp_path: Path) -> None:
    constrained = tmp_path / "constrained"
    committed, _ = await _checkpoint_with_a_held_call(constrained, tool_choice="required")
    counts = committed["counts"]
    assert (counts["cut"], counts["cut_skipped"]) == (0, 1)
    assert not any(k.startswith("__generation_cut__/") for k in committed["staging_keys"])
    # A plain call is cut; its re-issue under constrained decoding regenerates from scratch.
    plain = tmp_path / "plain"
    committed, messages = await _checkpoint_with_a_held_call(plain)
    assert committed["counts"]["cut"] == 1
    async with cutting_policy(plain) as (client, _app):
        await _restore(client, plain, "c2")
        content_of(await _chat(client, "r1-a1", messages, tool_choice="required"))
    (generation,) = [e for e in read_worker_evidence(plain) if e["capture_key"] == "r1-a1"]
    assert generation["continued_from"] is None and generation["tokens_continued"] == 0
    assert read_policy_evidence(plain)[-1]["continued_cut"] is False


async def test_ledger_removal_waits_out_an_open_checkpoint_and_retire_covers_earlier_attempts(
    tmp_path: Path,
) -> None:
    async with cutting_policy(tmp_path) as (client, _app):
        await conversation(client, "r1", 1)
        assert (await control(client, "prepare", checkpoint_id="c1")).status_code == 200
        for path in ("/rollouts/retire", "/rollouts/delete"):
            refused = await client.post(
                LEDGER_CONTROL_PREFIX + path, json={"rollout_ids": ["r1"]}, headers=AUTH
            )
            assert refused.status_code == 409, refused.text
            assert refused.json()["error"]["code"] == "checkpoint_open"
        assert (await client.get(MANIFEST.format("r1"), headers=AUTH)).status_code == 200
        assert (await control(client, "resume", checkpoint_id="c1")).status_code == 200
        retired = await control(
            client, "retire", checkpoint_id="x1", episode_ids=[{"rollout_id": "r1", "attempt": 1}]
        )
        assert retired.status_code == 200, retired.text
        # Retiring attempt 1 retired the ledger of attempt 0 too.
        assert (await client.get(MANIFEST.format("r1"), headers=AUTH)).status_code == 410


async def test_restoring_the_same_checkpoint_again_drops_the_dead_runs_calls(
    tmp_path: Path,
) -> None:
    async with cutting_policy(tmp_path) as (client, app):
        messages = await conversation(client, "r1", 1)
        assert (await control(client, "prepare", checkpoint_id="c1")).status_code == 200
        committed = await control(
            client,
            "commit",
            checkpoint_id="c1",
            checkpoint_dir=str(tmp_path / "ckpt"),
            episode_ids=SCOPE,
        )
        assert committed.status_code == 200, committed.text
        checkpointed = [r["model_call_id"] for r in app.state.policy.ledger.export_rows("r1")]
    async with cutting_policy(tmp_path) as (client, app):  # the run that dies
        await _restore(client, tmp_path, "c2")
        dead = content_of(await _chat(client, "r1-a1", messages))
        assert dead
        dead_ids = [r["model_call_id"] for r in app.state.policy.ledger.export_rows("r1-a1")]
        assert len(dead_ids) == 2
    async with cutting_policy(tmp_path) as (client, _app):  # the same checkpoint again
        await _restore(client, tmp_path, "c3")
        content_of(await _chat(client, "r1-a1", messages))
        manifest = (await client.get(MANIFEST.format("r1-a1"), headers=AUTH)).json()
    ids = [r["model_call_id"] for r in manifest["records"]]
    assert ids[:1] == checkpointed and len(ids) == 2
    assert dead_ids[1] not in ids
    assert manifest["records"][1]["parent_call_id"] == checkpointed[0]


async def test_a_continuation_the_worker_refuses_regenerates_from_scratch(tmp_path: Path) -> None:
    committed, messages = await _checkpoint_with_a_held_call(tmp_path)
    cut_keys = [k for k in committed["staging_keys"] if k.startswith("__generation_cut__/")]
    assert committed["counts"]["cut"] == 1 and cut_keys
    store = FileTokenStagingStore(tmp_path / "staging")
    for key in cut_keys:  # the prefix is lost: the worker cannot rebuild the cut and refuses it
        assert store.delete(key)
    async with cutting_policy(tmp_path) as (client, _app):
        await _restore(client, tmp_path, "c2")
        reissued = await _chat(client, "r1-a1", messages)
        content_of(reissued)
        outcomes = await _cut_outcomes(client)
    assert (outcomes["continued"], outcomes["refused"]) == (0, 1)
    (generation,) = [e for e in read_worker_evidence(tmp_path) if e["capture_key"] == "r1-a1"]
    assert generation["continued_from"] is None
    assert (generation["tokens_continued"], generation["tokens_generated"]) == (0, 40)
    assert read_policy_evidence(tmp_path)[-1]["continued_cut"] is False
