"""The three model APIs of the policy server, under the rollout prefix and plain."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from e2e._servers.model import read_policy_evidence
from e2e._servers.policy_apis import (
    MessagesRequest,
    ResponsesRequest,
    messages_call,
    responses_call,
)
from e2e._worker.app import read_worker_evidence
from participants import generation_cut_restart_reason, live_ledger_keys
from tests.e2e.test_server_model import (
    AUTH,
    MANIFEST,
    content_of,
    control,
    policy,
    start_messages,
    until,
)

pytestmark = pytest.mark.anyio
SYSTEM, FIRST = start_messages()


def _body(api: str, messages: list[dict[str, str]], max_tokens: int = 8) -> dict[str, Any]:
    """The same conversation in each API's request shape."""
    if api == "chat/completions":
        return {"messages": messages, "max_tokens": max_tokens}
    if api == "responses":
        rest = [{"role": m["role"], "content": m["content"]} for m in messages[1:]]
        return {
            "instructions": messages[0]["content"],
            "input": rest,
            "max_output_tokens": max_tokens,
        }
    return {"system": messages[0]["content"], "messages": messages[1:], "max_tokens": max_tokens}


def _content(api: str, response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    reply = response.json()
    if api == "chat/completions":
        return content_of(response)
    if api == "responses":
        assert reply["object"] == "response" and reply["status"] == "incomplete"
        return str(reply["output"][0]["content"][0]["text"])
    assert reply["type"] == "message" and reply["stop_reason"] == "max_tokens"
    return str(reply["content"][0]["text"])


APIS = ["chat/completions", "responses", "messages"]
PREFIXES = {"chat/completions": "chatcmpl-", "responses": "resp_", "messages": "msg_"}


async def test_every_api_is_captured_into_one_lineage_under_the_rollout_prefix(
    tmp_path: Path,
) -> None:
    messages = [SYSTEM, FIRST]
    replies: list[httpx.Response] = []
    async with policy(tmp_path) as (client, _app):
        for turn, api in enumerate(APIS):
            response = await client.post(f"/ng-rollout/r1/v1/{api}", json=_body(api, messages))
            replies.append(response)
            messages = [
                *messages,
                {"role": "assistant", "content": _content(api, response)},
                {"role": "user", "content": f"r1 {turn + 1}"},
            ]
        manifest = (await client.get(MANIFEST.format("r1"), headers=AUTH)).json()
    records = manifest["records"]
    call_ids = [r.json()["ng_model_call_id"] for r in replies]
    assert [r["model_call_id"] for r in records] == call_ids
    assert [r["parent_call_id"] for r in records] == [None, *call_ids[:2]]
    assert [r["response_id"] for r in records] == [
        PREFIXES[api] + call_id for api, call_id in zip(APIS, call_ids, strict=True)
    ]
    assert [r.json()["id"] for r in replies] == [r["response_id"] for r in records]


@pytest.mark.parametrize("api", APIS)
async def test_an_untagged_call_is_gated_served_and_never_captured(
    tmp_path: Path, api: str
) -> None:
    async with policy(tmp_path) as (client, app):
        assert (await control(client, "prepare", checkpoint_id="c1")).status_code == 200
        replies: list[httpx.Response] = []

        async def untagged() -> None:
            replies.append(await client.post(f"/v1/{api}", json=_body(api, [SYSTEM, FIRST])))

        async with anyio.create_task_group() as group:
            group.start_soon(untagged)
            await until(app, lambda p: p.gate.waiting == 1)  # gated: it waits for resume
            assert replies == []
            assert (await control(client, "resume", checkpoint_id="c1")).status_code == 200
        assert _content(api, replies[0])
        assert app.state.policy.participant.served  # restore now refuses this process
    assert read_policy_evidence(tmp_path) == [] and read_worker_evidence(tmp_path) == []
    assert live_ledger_keys(tmp_path / "ledger") == []


@pytest.mark.parametrize("key", ["bad key!", "k" * 300])  # the second: too long a file name
@pytest.mark.parametrize("api", APIS)
async def test_an_invalid_capture_key_is_refused_400_on_every_api(
    tmp_path: Path, api: str, key: str
) -> None:
    async with policy(tmp_path) as (client, app):
        refused = await client.post(f"/ng-rollout/{key}/v1/{api}", json=_body(api, [SYSTEM, FIRST]))
        assert not app.state.policy.participant.served
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "invalid_rollout_id"


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"text": {"format": {"type": "text"}}}, None),
        ({"text": {"format": {"type": "json_schema"}}}, "response_format:json_schema"),
        ({"tool_choice": "required"}, "tool_choice:required"),
        ({"tool_choice": "auto"}, None),
    ],
)
def test_responses_constraints_read_as_chat_completions_do(
    body: dict[str, Any], reason: str | None
) -> None:
    request = ResponsesRequest.model_validate({"input": "hi", "max_output_tokens": 4, **body})
    assert generation_cut_restart_reason(responses_call(request).constraints) == reason


@pytest.mark.parametrize(
    ("tool_choice", "reason"),
    [
        ({"type": "auto"}, None),
        ({"type": "none"}, None),
        ({"type": "any"}, "tool_choice:any"),
        ({"type": "tool", "name": "add"}, "tool_choice:constrained"),
    ],
)
def test_messages_tool_choice_reads_as_chat_completions_does(
    tool_choice: dict[str, Any], reason: str | None
) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    request = MessagesRequest.model_validate({**body, "tool_choice": tool_choice})
    assert generation_cut_restart_reason(messages_call(request).constraints) == reason


def test_a_string_input_and_instructions_become_system_and_user_messages() -> None:
    request = ResponsesRequest.model_validate(
        {"instructions": "be brief", "input": "hi", "max_output_tokens": 4}
    )
    assert responses_call(request).messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]


async def test_the_custody_row_takes_the_digest_of_admission_and_the_chain_still_resolves(
    tmp_path: Path, ledger_hashes: list[int]
) -> None:
    """D429: the policy server hands the digest it computed at admission to the custody row,
    which hashes no request again; each next call still finds its parent by that digest."""
    messages = [SYSTEM, FIRST]
    call_ids = []
    async with policy(tmp_path) as (client, _app):
        for turn in range(3):
            response = await client.post(
                "/ng-rollout/r1/v1/chat/completions", json=_body("chat/completions", messages)
            )
            call_ids.append(response.json()["ng_model_call_id"])
            messages = [
                *messages,
                {"role": "assistant", "content": _content("chat/completions", response)},
                {"role": "user", "content": f"r1 {turn + 1}"},
            ]
        manifest = (await client.get(MANIFEST.format("r1"), headers=AUTH)).json()
    assert ledger_hashes == []
    records = manifest["records"]
    assert [r["model_call_id"] for r in records] == call_ids
    assert [r["parent_call_id"] for r in records] == [None, *call_ids[:2]]
