"""One agent session of the counter episode: its exported state, its live loop state, the tool rule.

The state a restore needs is small and self-checking: the conversation so far (at a boundary),
the resources session it drives, the task, and where it is (activations completed, turns done in
the current one). Its length is a function of the position, so a corrupt record is caught before
anything is installed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal, Protocol

import anyio
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

from protocols import MAX_COMPLETION_TOKENS, EpisodeId

TOOLS: Final = ("add", "mul", "note")
"""The counter tools, indexed by the first byte of the completion's sha256 (e2e-contract §3)."""
COOKIE_VALUE_PATTERN: Final = r"^[\x21\x23-\x2b\x2d-\x3a\x3c-\x5b\x5d-\x7e]+$"
"""RFC 6265's cookie octets: visible ASCII but for ``"``, ``,``, ``;`` and ``\\`` (D359)."""
ResourcesSessionId = Annotated[
    str, Field(min_length=1, max_length=256, pattern=COOKIE_VALUE_PATTERN)
]
"""A resources session id as the agent keeps it: it goes back to the resources server as the
value of the ``ng_session`` cookie on every tool call, so it must be one a cookie can carry."""

BoundaryKind = Literal["before_model_call", "after_tool_round", "between_activations"]
SessionState = Literal["idle", "running", "at_boundary"]


def choose_tool(completion: str) -> tuple[str, int]:
    """The tool call of a completion: ``(tool, arg)`` from the sha256 of its Latin-1 bytes."""
    digest = hashlib.sha256(completion.encode("latin-1")).digest()
    return TOOLS[digest[0] % len(TOOLS)], digest[1] % 10


class AgentTaskInput(BaseModel):
    """The counter task as the agent sees it (e2e-contract §3)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    activations: int = Field(ge=1, le=10_000)
    turns: int = Field(ge=1, le=10_000)
    max_tokens: int = Field(ge=1, le=MAX_COMPLETION_TOKENS)
    seed: int = Field(ge=0, lt=2**64)


class ChatMessage(BaseModel):
    """One message of the conversation."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    role: Literal["system", "user", "assistant", "tool"]
    content: str


class AgentSessionState(BaseModel):
    """What an export carries per session, and what install validates before installing any.

    ``conversation`` holds exactly the messages up to the exported boundary: the two opening
    messages, two per finished turn. ``stored_reply`` is the reply of the last completed
    activation (repeated when the environment re-invokes it).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    conversation: list[ChatMessage]
    resources_session_id: ResourcesSessionId
    task_input: AgentTaskInput
    completed_activation: int = Field(ge=0)
    turn_in_activation: int = Field(ge=0)
    stored_reply: dict[str, Any] | None
    held_reply: str | None = None

    @model_validator(mode="after")
    def _position_matches_conversation(self) -> AgentSessionState:
        task = self.task_input
        if self.completed_activation > task.activations:
            raise ValueError("more activations completed than the task has")
        if self.turn_in_activation > task.turns or (
            self.completed_activation == task.activations and self.turn_in_activation
        ):
            raise ValueError("turn_in_activation is past the task's turns")
        turns_done = task.turns * self.completed_activation + self.turn_in_activation
        if len(self.conversation) != 2 + 2 * turns_done:
            raise ValueError(
                f"the conversation has {len(self.conversation)} messages; "
                f"{2 + 2 * turns_done} expected at this position"
            )
        if (self.stored_reply is None) != (self.completed_activation == 0):
            raise ValueError("stored_reply must be present exactly when an activation completed")
        return self


AGENT_SESSION_STATES: TypeAdapter[list[AgentSessionState]] = TypeAdapter(list[AgentSessionState])
"""A whole restore's session states, validated in one call (D265)."""


class AgentPeers(Protocol):
    """How the agent reaches the policy model and the resources server."""

    async def complete(
        self, session_key: str, messages: list[dict[str, str]], max_tokens: int
    ) -> str:
        """One chat completion for the session; returns the assistant message's content."""
        ...

    async def call_tool(
        self, session_key: str, resources_session_id: str, tool: str, arg: int
    ) -> dict[str, int]:
        """One tool call on the resources session; returns ``{"value", "notes"}``."""
        ...


@dataclass
class Snapshot:
    """The session as of its latest boundary (the conversation only grows, so a length suffices)."""

    kind: BoundaryKind
    conversation_length: int
    completed_activation: int
    turn_in_activation: int
    stored_reply: dict[str, Any] | None
    held_reply: str | None = None

    def boundary(self) -> dict[str, Any]:
        """The exported ``boundary`` object."""
        return {
            "at": self.kind,
            "activation": self.completed_activation + (self.kind != "between_activations"),
            "turn": self.turn_in_activation,
        }


@dataclass
class AgentSession:
    """One live (or restored, not yet continued) session."""

    episode_id: EpisodeId
    task_input: AgentTaskInput
    resources_session_id: str
    conversation: list[dict[str, str]]
    completed_activation: int = 0
    turn_in_activation: int = 0
    stored_reply: dict[str, Any] | None = None
    held_reply: str | None = None
    state: SessionState = "idle"
    parked: bool = False
    restored_pending: bool = False
    retired: bool = False
    closing: bool = False
    scope: anyio.CancelScope | None = None
    stopped: anyio.Event | None = None
    """Set when the running activation has ended; ``None`` until one has started (D435)."""
    snapshot: Snapshot | None = None

    @classmethod
    def seeded(
        cls, episode_id: EpisodeId, task_input: AgentTaskInput, resources_session_id: str
    ) -> AgentSession:
        """A fresh session: the opening messages, no activation yet."""
        session = cls(
            episode_id,
            task_input,
            resources_session_id,
            [
                {"role": "system", "content": "counter"},
                {"role": "user", "content": f"{episode_id.rollout_id} {task_input.seed}"},
            ],
        )
        session.record_boundary("between_activations")
        return session

    @classmethod
    def restored(cls, episode_id: EpisodeId, state: AgentSessionState) -> AgentSession:
        """A session installed by a restore under its next attempt, pending its continuation."""
        session = cls(
            episode_id,
            state.task_input,
            state.resources_session_id,
            # A message's fields are two strings: its ``__dict__`` is its dump, copied ten
            # times faster than ``model_dump`` builds it, once per message of every session
            # a restore installs (D432).
            [dict(message.__dict__) for message in state.conversation],
            state.completed_activation,
            state.turn_in_activation,
            state.stored_reply,
            held_reply=state.held_reply,
            restored_pending=True,
        )
        kind: BoundaryKind = (
            "before_model_call" if state.turn_in_activation else "between_activations"
        )
        session.record_boundary(kind)
        return session

    @property
    def activation_start(self) -> int:
        """Index of the current activation's first message in the conversation."""
        return 2 + 2 * self.task_input.turns * self.completed_activation

    def record_boundary(self, kind: BoundaryKind) -> None:
        """Remember the loop state as of now; an export reads it, whenever it runs.

        A reply the session still holds (restored with it, not yet used) belongs to the
        boundary: dropping it here made the next checkpoint forget a delivered call (D248).
        """
        self.snapshot = Snapshot(
            kind,
            len(self.conversation),
            self.completed_activation,
            self.turn_in_activation,
            self.stored_reply,
            held_reply=self.held_reply,
        )

    def export_state(self) -> dict[str, Any]:
        """The ``session`` object of the exported record, as of the latest boundary."""
        snap = self.snapshot
        assert snap is not None  # every constructor records one
        return {
            "conversation": [dict(m) for m in self.conversation[: snap.conversation_length]],
            "resources_session_id": self.resources_session_id,
            "task_input": self.task_input.model_dump(),
            "completed_activation": snap.completed_activation,
            "turn_in_activation": snap.turn_in_activation,
            "stored_reply": snap.stored_reply,
            "held_reply": snap.held_reply,
        }

    def rewind(self) -> None:
        """Go back to the latest boundary (after an activation failed between two)."""
        snap = self.snapshot
        assert snap is not None  # every constructor records one
        del self.conversation[snap.conversation_length :]
        self.completed_activation = snap.completed_activation
        self.turn_in_activation = snap.turn_in_activation
        self.stored_reply = snap.stored_reply
        self.held_reply = snap.held_reply  # a held reply taken but not used is held again
