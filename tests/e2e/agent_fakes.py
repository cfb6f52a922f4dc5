"""Fake policy and resources peers for the agent server, and the contract's expected episode."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import FastAPI, Request

from e2e._worker.generation import generate_tokens
from protocols import decode, encode, render_prompt

TOKEN = "agent-test-token"
ROLLOUT = "r1"


def completion(seed: int, messages: list[dict[str, str]], max_tokens: int) -> str:
    """What the deterministic policy answers (e2e-contract §2)."""
    return decode(generate_tokens(seed, encode(render_prompt(messages)), 0, max_tokens))


def counter_tool_step(content: str, value: int, notes: list[int]) -> tuple[int, str]:
    """The tool the contract picks for ``content``, applied: the new value and the tool's reply."""
    digest = hashlib.sha256(content.encode("latin-1")).digest()
    tool, arg = ("add", "mul", "note")[digest[0] % 3], digest[1] % 10
    if tool == "add":
        value = (value + arg) % 1_000_003
    elif tool == "mul":
        value = (value * (arg + 1)) % 1_000_003
    else:
        notes.append(arg)
    return value, f"{tool} {arg} -> {value} {len(notes)}"


def expected_episode(rollout_id: str, task: dict[str, int], model_seed: int = 0) -> list[Any]:
    """Every message per activation, computed from the contract alone (the test oracle)."""
    conversation = [
        {"role": "system", "content": "counter"},
        {"role": "user", "content": f"{rollout_id} {task['seed']}"},
    ]
    value, notes = 1, []
    per_activation = []
    for _ in range(task["activations"]):
        start = len(conversation)
        for _ in range(task["turns"]):
            content = completion(model_seed, conversation, task["max_tokens"])
            conversation.append({"role": "assistant", "content": content})
            value, tool_reply = counter_tool_step(content, value, notes)
            conversation.append({"role": "tool", "content": tool_reply})
        per_activation.append(conversation[start:])
    return per_activation


@dataclass
class FakePeers:
    """One app playing both the policy (chat completions) and the resources counter (tools).

    ``model_gates[n]`` holds the n-th model call (1-based) until set; ``tool_gates`` likewise.
    """

    model_seed: int = 0
    model_calls: list[tuple[str, list[dict[str, str]]]] = field(default_factory=list)
    tool_calls: list[tuple[str, str, str, int]] = field(default_factory=list)
    counters: dict[str, dict[str, Any]] = field(default_factory=dict)
    model_gates: dict[int, anyio.Event] = field(default_factory=dict)
    tool_gates: dict[int, anyio.Event] = field(default_factory=dict)

    def new_session(self, session_id: str = "s1") -> str:
        self.counters[session_id] = {"value": 1, "notes": []}
        return session_id

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/ng-rollout/{key}/v1/chat/completions")
        async def chat(key: str, request: Request) -> dict[str, Any]:
            body = await request.json()
            self.model_calls.append((key, body["messages"]))
            gate = self.model_gates.get(len(self.model_calls))
            if gate is not None:
                await gate.wait()
            content = completion(self.model_seed, body["messages"], body["max_tokens"])
            return {
                "id": f"c{len(self.model_calls)}",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": content},
                        "finish_reason": "length",
                    }
                ],
                "usage": {"prompt_tokens": 0, "completion_tokens": body["max_tokens"]},
                "ng_model_call_id": f"c{len(self.model_calls)}",
            }

        @app.post("/ng-rollout/{key}/tools/{tool}")
        async def call_tool(key: str, tool: str, request: Request) -> Any:
            arg = int((await request.json())["arg"])
            session_id = request.cookies["ng_session"]
            self.tool_calls.append((key, session_id, tool, arg))
            gate = self.tool_gates.get(len(self.tool_calls))
            if gate is not None:
                await gate.wait()
            counter = self.counters[session_id]
            if tool == "add":
                counter["value"] = (counter["value"] + arg) % 1_000_003
            elif tool == "mul":
                counter["value"] = (counter["value"] * (arg + 1)) % 1_000_003
            else:
                counter["notes"].append(arg)
            return {"value": counter["value"], "notes": len(counter["notes"])}

        return app


async def wait_for(condition: Callable[[], bool], what: str, limit: float = 10.0) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``limit`` seconds."""
    with anyio.fail_after(limit):
        while not condition():  # noqa: ASYNC110 - state of another component, no event to wait on
            await anyio.sleep(0.005)
    assert condition(), what


def control(checkpoint_id: str, **fields: Any) -> dict[str, Any]:
    """A control request body with a near deadline."""
    return {"checkpoint_id": checkpoint_id, "deadline_ts": time.time() + 30, **fields}


AUTH = {"authorization": f"Bearer {TOKEN}"}
