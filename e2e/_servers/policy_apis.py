"""The three model APIs of the policy server, as thin adapters over one handler.

Chat completions, the Responses API and the Messages API all reach
:meth:`e2e._servers.policy_server.PolicyServer.serve`. Each adapter turns its request into a
:class:`ModelCall` — the conversation as chat messages (the form the ledger's lineage matcher and
the prompt renderer know), the output limit, and the request fields that say whether decoding is
constrained, in chat-completions form — and renders the handler's :class:`ModelReply` in its own
response shape. Only the subset the deterministic worker can honour is accepted; anything else is a
422 ``invalid_request``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field

from protocols import MAX_COMPLETION_TOKENS

ROLLOUT_PREFIX: Final = "/ng-rollout/{capture_key}"
"""Path prefix of a call of an episode: the capture key names the attempt."""
MAX_CONTENT: Final = 1_048_576
MAX_MESSAGES: Final = 4096


@dataclass(frozen=True)
class ModelCall:
    """What every API asks of the handler.

    Attributes:
        messages: The conversation as ``{"role", "content"}`` chat messages.
        max_tokens: The output limit.
        constraints: ``tool_choice`` and ``response_format`` in chat-completions form (what
            :func:`participants.generation_cut_restart_reason` reads).
    """

    messages: list[dict[str, str]]
    max_tokens: int
    constraints: dict[str, Any]


@dataclass(frozen=True)
class ModelReply:
    """What the handler generated, for an adapter to render."""

    response_id: str
    model_call_id: str
    content: str
    finish_reason: Literal["stop", "length"]
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class ModelApi:
    """One API: its path (under the rollout prefix or plain), its response ids and shape."""

    path: str
    response_id_prefix: str
    render: Callable[[ModelReply], dict[str, Any]]

    def response_id(self, model_call_id: str) -> str:
        """The response id of a call (also the ``response_id`` of its ledger row)."""
        return f"{self.response_id_prefix}{model_call_id}"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# -- chat completions ---------------------------------------------------------------------


class ChatMessage(_Strict):
    """One chat message."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str = Field(max_length=MAX_CONTENT)


class ChatCompletionRequest(_Strict):
    """Body of ``/v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int = Field(ge=1, le=MAX_COMPLETION_TOKENS)
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


def chat_call(body: ChatCompletionRequest) -> ModelCall:
    """A chat completions request as the handler's call."""
    return ModelCall(
        messages=[m.model_dump() for m in body.messages],
        max_tokens=body.max_tokens,
        constraints={"tool_choice": body.tool_choice, "response_format": body.response_format},
    )


def _render_chat(reply: ModelReply) -> dict[str, Any]:
    return {
        "id": reply.response_id,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": reply.content},
                "finish_reason": reply.finish_reason,
            }
        ],
        "usage": {
            "prompt_tokens": reply.prompt_tokens,
            "completion_tokens": reply.completion_tokens,
        },
        "ng_model_call_id": reply.model_call_id,
    }


# -- responses ----------------------------------------------------------------------------


class ResponsesMessage(_Strict):
    """One input message of the Responses API (text content only)."""

    type: Literal["message"] | None = None
    role: Literal["system", "user", "assistant"]
    content: str = Field(max_length=MAX_CONTENT)


class ResponsesText(_Strict):
    """The ``text`` option: ``format`` other than ``{"type": "text"}`` constrains decoding."""

    format: dict[str, Any] | None = None


class ResponsesRequest(_Strict):
    """Body of ``/v1/responses``: a string or a list of messages, optional instructions."""

    input: (
        Annotated[str, Field(max_length=MAX_CONTENT)]
        | Annotated[list[ResponsesMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    )
    instructions: str | None = Field(default=None, max_length=MAX_CONTENT)
    max_output_tokens: int = Field(ge=1, le=MAX_COMPLETION_TOKENS)
    tool_choice: str | dict[str, Any] | None = None
    text: ResponsesText | None = None


def responses_call(body: ResponsesRequest) -> ModelCall:
    """A Responses API request as the handler's call: instructions become the system message."""
    messages = [] if body.instructions is None else [_message("system", body.instructions)]
    if isinstance(body.input, str):
        messages.append(_message("user", body.input))
    else:
        messages += [_message(m.role, m.content) for m in body.input]
    response_format = None if body.text is None else body.text.format
    return ModelCall(
        messages=messages,
        max_tokens=body.max_output_tokens,
        constraints={"tool_choice": body.tool_choice, "response_format": response_format},
    )


def _render_responses(reply: ModelReply) -> dict[str, Any]:
    complete = reply.finish_reason == "stop"
    return {
        "id": reply.response_id,
        "object": "response",
        "status": "completed" if complete else "incomplete",
        "incomplete_details": None if complete else {"reason": "max_output_tokens"},
        "output": [
            {
                "type": "message",
                "id": f"msg_{reply.model_call_id}",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": reply.content, "annotations": []}],
            }
        ],
        "usage": {
            "input_tokens": reply.prompt_tokens,
            "output_tokens": reply.completion_tokens,
            "total_tokens": reply.prompt_tokens + reply.completion_tokens,
        },
        "ng_model_call_id": reply.model_call_id,
    }


# -- messages -----------------------------------------------------------------------------


class MessagesMessage(_Strict):
    """One message of the Messages API (text content only)."""

    role: Literal["user", "assistant"]
    content: str = Field(max_length=MAX_CONTENT)


class MessagesRequest(_Strict):
    """Body of ``/v1/messages``: a system prompt beside the messages."""

    system: str | None = Field(default=None, max_length=MAX_CONTENT)
    messages: list[MessagesMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int = Field(ge=1, le=MAX_COMPLETION_TOKENS)
    tool_choice: dict[str, Any] | None = None


def messages_call(body: MessagesRequest) -> ModelCall:
    """A Messages API request as the handler's call.

    ``tool_choice`` ``{"type": "auto"}`` and ``{"type": "none"}`` leave decoding free, as their
    chat-completions namesakes do; ``any`` forces some tool (``tool_choice:any``); a named tool is
    constrained.
    """
    messages = [] if body.system is None else [_message("system", body.system)]
    messages += [_message(m.role, m.content) for m in body.messages]
    tool_choice: str | dict[str, Any] | None = body.tool_choice
    kind = None if body.tool_choice is None else body.tool_choice.get("type")
    if kind in ("auto", "none", "any"):
        tool_choice = str(kind)
    return ModelCall(
        messages=messages,
        max_tokens=body.max_tokens,
        constraints={"tool_choice": tool_choice, "response_format": None},
    )


def _render_messages(reply: ModelReply) -> dict[str, Any]:
    return {
        "id": reply.response_id,
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": reply.content}],
        "stop_reason": "end_turn" if reply.finish_reason == "stop" else "max_tokens",
        "stop_sequence": None,
        "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": reply.completion_tokens},
        "ng_model_call_id": reply.model_call_id,
    }


def _message(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


CHAT_API: Final = ModelApi("/v1/chat/completions", "chatcmpl-", _render_chat)
RESPONSES_API: Final = ModelApi("/v1/responses", "resp_", _render_responses)
MESSAGES_API: Final = ModelApi("/v1/messages", "msg_", _render_messages)
