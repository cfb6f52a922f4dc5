"""The policy server in-process, over a real worker app: capture chains, held responses, commit,
restore into a fresh app, retire of a call in flight."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from fastapi import FastAPI

from e2e._servers.cluster import default_cluster
from e2e._servers.context import ServeContext
from e2e._servers.model import create_model_app, read_policy_evidence
from e2e._servers.policy_server import request_digest
from e2e._worker.app import WorkerSettings, create_worker_app
from participants import FileTokenStagingStore, ModelParticipant, live_ledger_keys
from protocols import encode, render_prompt

pytestmark = pytest.mark.anyio
TOKEN = "policy-test-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
CONTROL = "/ng-control/v1/checkpoint"
MANIFEST = "/training-token-capture/control/rollouts/{}/manifest"


def start_messages(rollout: str = "r1") -> list[dict[str, str]]:
    return [{"role": "system", "content": "counter"}, {"role": "user", "content": f"{rollout} 0"}]


@asynccontextmanager
async def policy(
    root: Path, *, token_delay_ms: float = 0.0
) -> AsyncIterator[tuple[httpx.AsyncClient, FastAPI]]:
    """A policy app (lifespan entered) over a real worker app sharing ``root``."""
    worker = create_worker_app(WorkerSettings(root=root, token_delay_ms=token_delay_ms))
    ctx = ServeContext("policy", 0, root, default_cluster(root), TOKEN, TOKEN)
    app = create_model_app(ctx, worker_transport=httpx.ASGITransport(app=worker))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://policy") as client:
            yield client, app


async def chat(
    client: httpx.AsyncClient, key: str, messages: list[dict[str, str]], max_tokens: int = 12
) -> httpx.Response:
    return await client.post(
        f"/ng-rollout/{key}/v1/chat/completions",
        json={"messages": messages, "max_tokens": max_tokens},
    )


def content_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


async def control(client: httpx.AsyncClient, operation: str, **body: Any) -> httpx.Response:
    body.setdefault("deadline_ts", time.time() + 60)
    return await client.post(f"{CONTROL}/{operation}", json=body, headers=AUTH)


async def until(app: FastAPI, condition: Callable[[ModelParticipant], bool]) -> None:
    participant: ModelParticipant = app.state.policy.participant
    with anyio.fail_after(30):  # bounds the wait; asserts nothing about speed
        while True:
            seen = participant.changes.version
            if condition(participant):
                return
            await participant.changes.wait_past(seen)


async def conversation(client: httpx.AsyncClient, key: str, calls: int) -> list[dict[str, str]]:
    """Run ``calls`` turns; returns the messages the next call would send."""
    messages = start_messages(key.split("-a")[0])
    for turn in range(calls):
        messages.append(
            {"role": "assistant", "content": content_of(await chat(client, key, messages))}
        )
        messages.append({"role": "tool", "content": f"add {turn} -> {turn + 2} 0"})
    return messages


def staged_tokens(root: Path, chain: list[str]) -> list[int]:
    store = FileTokenStagingStore(root / "staging")
    tokens: list[int] = []
    for key in chain:
        entry = store.get(key)
        assert entry is not None, key
        tokens += entry.record.token_ids_delta
    return tokens


async def test_three_calls_chain_in_the_ledger_and_their_staged_deltas_rebuild_the_tokens(
    tmp_path: Path,
) -> None:
    async with policy(tmp_path) as (client, _app):
        messages = await conversation(client, "r1", 2)
        last = await chat(client, "r1", messages)
        manifest = (await client.get(MANIFEST.format("r1"), headers=AUTH)).json()
    records = manifest["records"]
    assert [r["parent_call_id"] for r in records] == [
        None,
        records[0]["model_call_id"],
        records[1]["model_call_id"],
    ]
    assert records[2]["model_call_id"] == last.json()["ng_model_call_id"]
    rows = {r["model_call_id"]: r for r in records}
    chain = [rows[r["model_call_id"]]["staging_key"] for r in records]
    expected = encode(render_prompt(messages)) + encode(content_of(last))
    assert staged_tokens(tmp_path, chain) == expected
    assert records[2]["cum_len"] == len(expected)


async def test_a_response_finished_while_closed_is_held_left_out_of_the_commit_and_sent_at_resume(
    tmp_path: Path,
) -> None:
    async with policy(tmp_path, token_delay_ms=20) as (client, app):
        first = await conversation(client, "r1", 1)
        replies: list[httpx.Response] = []

        async def held_call() -> None:
            replies.append(await chat(client, "r1", first, max_tokens=10))

        async with anyio.create_task_group() as group:
            group.start_soon(held_call)
            await until(app, lambda p: len(p.gate.tickets) == 1)
            prepared = await control(client, "prepare", checkpoint_id="c1")
            assert prepared.json()["phase"] == "prepared"  # a generation never blocks prepare
            await until(app, lambda p: p.gate.held_count() == 1)
            assert replies == []
            commit = await control(
                client,
                "commit",
                checkpoint_id="c1",
                checkpoint_dir=str(tmp_path / "ckpt"),
                episode_ids=[{"rollout_id": "r1", "attempt": 0}],
            )
            assert commit.status_code == 200, commit.text
            # The held call's row is in the ledger but not in the checkpoint.
            ledger_ids = [r["model_call_id"] for r in app.state.policy.ledger.export_rows("r1")]
            assert len(ledger_ids) == 2
            assert len(commit.json()["staging_keys"]) == 1
            assert commit.json()["staging_keys_by_episode"]["r1"] == [f"r1/{ledger_ids[0]}"]
            assert replies == []
            await control(client, "resume", checkpoint_id="c1")
        assert replies[0].status_code == 200
    egress = read_policy_evidence(tmp_path)
    assert [e["held"] for e in egress] == [False, True]
    assert egress[1]["model_call_id"] == replies[0].json()["ng_model_call_id"] == ledger_ids[1]
    assert egress[1]["request_digest"] == request_digest(encode(render_prompt(first)))


async def test_a_restore_imports_rows_under_the_next_attempt_and_fences_the_crashed_one(
    tmp_path: Path,
) -> None:
    checkpoint = str(tmp_path / "ckpt")
    scope = [{"rollout_id": "r1", "attempt": 0}]
    async with policy(tmp_path) as (client, _app):
        messages = await conversation(client, "r1", 2)
        await control(client, "prepare", checkpoint_id="c1")
        await control(
            client, "commit", checkpoint_id="c1", checkpoint_dir=checkpoint, episode_ids=scope
        )
        delivered = (await client.get(MANIFEST.format("r1"), headers=AUTH)).json()["records"]
    async with policy(tmp_path) as (client, _app):  # a fresh process on the same run root
        restored = await control(
            client, "restore", checkpoint_id="c2", checkpoint_dir=checkpoint, episode_ids=scope
        )
        assert restored.json()["restored"] == ["r1-a1"], restored.text
        await control(client, "resume", checkpoint_id="c2")
        stale = await chat(client, "r1", messages)
        assert stale.status_code == 409
        assert stale.json()["error"]["code"] == "stale_attempt"
        assert (await client.get(MANIFEST.format("r1"), headers=AUTH)).status_code == 410
        again = await chat(client, "r1-a1", messages)
        manifest = (await client.get(MANIFEST.format("r1-a1"), headers=AUTH)).json()
    records = manifest["records"]
    # Carried rows keep the reference shape (D222): their staging keys name where they were staged.
    assert all("capture_key" not in r and "rollout_id" not in r for r in records)
    assert [r["staging_key"].split("/")[0] for r in records] == ["r1", "r1", "r1-a1"]
    assert records[2]["parent_call_id"] == delivered[1]["model_call_id"]
    chain = [r["staging_key"] for r in records]
    assert staged_tokens(tmp_path, chain) == encode(render_prompt(messages)) + encode(
        content_of(again)
    )


async def test_a_retire_cancels_a_call_in_flight_and_retires_its_ledgers(tmp_path: Path) -> None:
    async with policy(tmp_path, token_delay_ms=50) as (client, app):
        messages = await conversation(client, "r1", 0)
        replies: list[httpx.Response] = []

        async def doomed() -> None:
            replies.append(await chat(client, "r1", messages, max_tokens=400))

        async with anyio.create_task_group() as group:
            group.start_soon(doomed)
            await until(app, lambda p: len(p.gate.tickets) == 1)
            retired = await control(
                client,
                "retire",
                checkpoint_id="x1",
                episode_ids=[{"rollout_id": "r1", "attempt": 0}],
            )
            assert retired.status_code == 200, retired.text
            assert app.state.policy.participant.gate.tickets == {}
        assert replies[0].json()["error"]["code"] == "stale_attempt"
        assert (await client.get(MANIFEST.format("r1"), headers=AUTH)).status_code == 410
    assert read_policy_evidence(tmp_path) == []


async def test_a_restore_is_refused_by_a_server_that_served_calls(tmp_path: Path) -> None:
    async with policy(tmp_path) as (client, _app):
        await conversation(client, "r1", 1)
        refused = await control(
            client,
            "restore",
            checkpoint_id="c9",
            checkpoint_dir=str(tmp_path / "none"),
            episode_ids=[{"rollout_id": "r1", "attempt": 0}],
        )
    assert refused.json()["error"]["code"] == "checkpoint_error"


async def test_bad_requests_are_refused_before_anything_changes(tmp_path: Path) -> None:
    async with policy(tmp_path) as (client, app):
        bad_key = await chat(client, "bad key!", start_messages())
        framing = await chat(client, "r1", [{"role": "user", "content": "a\x02b"}])
        extra = await client.post(
            "/ng-rollout/r1/v1/chat/completions",
            json={"messages": start_messages(), "max_tokens": 4, "stream": True},
        )
        assert not app.state.policy.participant.served
    assert [r.status_code for r in (bad_key, framing, extra)] == [400, 422, 422]
    assert bad_key.json()["error"]["code"] == "invalid_rollout_id"
    assert "r1" not in live_ledger_keys(tmp_path / "ledger")


async def test_a_call_waiting_at_admission_when_its_attempt_is_retired_gets_stale_attempt(
    tmp_path: Path,
) -> None:
    checkpoint = str(tmp_path / "ckpt")
    scope = [{"rollout_id": "r1", "attempt": 0}]
    async with policy(tmp_path) as (client, _app):
        messages = await conversation(client, "r1", 1)
        await control(client, "prepare", checkpoint_id="c1")
        await control(
            client, "commit", checkpoint_id="c1", checkpoint_dir=checkpoint, episode_ids=scope
        )
    async with policy(tmp_path) as (client, app):
        restored = await control(
            client, "restore", checkpoint_id="c2", checkpoint_dir=checkpoint, episode_ids=scope
        )
        assert restored.status_code == 200, restored.text
        replies: list[httpx.Response] = []

        async def reissued() -> None:
            replies.append(await chat(client, "r1-a1", messages))

        # The bound turns a waiter that is never refused into a failure, not a hang.
        with anyio.fail_after(30):
            async with anyio.create_task_group() as group:
                group.start_soon(reissued)
                # Restored, not resumed: admission is closed and the call waits without a ticket.
                await until(app, lambda p: p.gate.waiting == 1)
                retired = await control(
                    client,
                    "retire",
                    checkpoint_id="c2",  # a restored process retires under its restore id
                    episode_ids=[{"rollout_id": "r1", "attempt": 1}],
                )
                assert retired.status_code == 200, retired.text
        assert app.state.policy.participant.gate.tickets == {}
    assert replies[0].status_code == 409, replies[0].text
    assert replies[0].json()["error"]["code"] == "stale_attempt"
    assert [
        e for e in read_policy_evidence(tmp_path, event="admit") if e["capture_key"] == "r1-a1"
    ] == []


async def test_a_call_validates_its_conversation_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # D261: the request digest, the lineage matcher and the custody row share one validation
    # (D430: of the whole list at once; an item validated already is passed through).
    import protocols._lineage as lineage
    from protocols import RequestItem

    async with policy(tmp_path) as (client, _app):
        messages = await conversation(client, "r1", 2)
        real = lineage._REQUEST_ITEMS
        validated: list[Any] = []

        class Counting:
            def validate_python(self, items: Any) -> Any:
                validated.extend(item for item in items if not isinstance(item, RequestItem))
                return real.validate_python(items)

        monkeypatch.setattr(lineage, "_REQUEST_ITEMS", Counting())
        content_of(await chat(client, "r1", messages))
        monkeypatch.undo()
        manifest = (await client.get(MANIFEST.format("r1"), headers=AUTH)).json()
    assert validated == messages
    assert len(manifest["records"]) == 3  # and the call was still captured, chained


async def test_a_conversation_that_is_not_request_items_is_refused_before_admission(
    tmp_path: Path,
) -> None:
    from e2e._servers.policy_apis import CHAT_API, ModelCall
    from protocols import InvalidRequestError

    async with policy(tmp_path) as (_, app):
        server = app.state.policy
        # Renders as a prompt, but an unknown key is no request item.
        message = {"role": "user", "content": "x", "foo": "bar"}
        call = ModelCall(messages=[message], max_tokens=4, constraints={})
        with pytest.raises(InvalidRequestError, match="cannot be rendered"):
            await server.serve("r1", call, CHAT_API)
        # Nothing was admitted: no ticket left behind, nothing served.
        assert server.participant.gate.tickets == {} and not server.participant.served
