"""The reference resources server: counter sessions that tools act on (e2e-contract §3, §4).

Routes (besides the control routes, ``/healthz`` and ``/metrics``):

- ``POST /ng-rollout/<key>/seed_session`` ``{"task_input"}`` → ``{"session_id"}``, with the
  cookie ``ng_session`` and the headers ``x-ng-checkpoint-verify`` (and, on a restart-only
  server, ``x-ng-checkpoint-restart: 1``);
- ``POST /ng-rollout/<key>/tools/{add|mul|note}`` ``{"arg"}`` → ``{"value", "notes"}``;
- ``POST /ng-rollout/<key>/verify`` → ``{"reward"}`` (ends the session);
- ``POST /close_session`` → ``{}`` (never refused).

Every one of them goes through :meth:`participants.ResourcesParticipant.admit`: while a checkpoint
is open it waits for resume inside the server, then the admission rules apply.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Final, Literal

import anyio
from fastapi import Cookie, FastAPI, Response
from prometheus_client import CollectorRegistry, Counter, Gauge
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from participants import (
    ControlPlane,
    ResourcesMode,
    ResourcesParticipant,
    VerifyMode,
    error_responses,
    participant_app,
)
from protocols import CheckpointError, EpisodeId, InvalidCheckpointStateError, InvalidRequestError

from .context import ServeContext, control_settings

SESSION_COOKIE: Final = "ng_session"
VERIFY_HEADER: Final = "x-ng-checkpoint-verify"
RESTART_HEADER: Final = "x-ng-checkpoint-restart"
COUNTER_MODULUS: Final = 1_000_003
TOOLS: Final = ("add", "mul", "note")
SESSION_ERRORS: Final = error_responses(
    ("invalid_rollout_id", "stale_attempt", "admission_closed", "checkpoint_error"),
    authenticated=False,
)
"""The refusals a data-plane route of the resources server may answer (declared in OpenAPI)."""

ToolName = Literal["add", "mul", "note"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class TaskInput(_Strict):
    """The counter task's input (e2e-contract §3)."""

    activations: int = Field(default=2, ge=1, le=1000)
    turns: int = Field(default=2, ge=1, le=1000)
    max_tokens: int = Field(default=32, ge=1, le=4096)
    seed: int = Field(default=0, ge=0, le=2**64 - 1)


class SeedSessionBody(_Strict):
    """Body of ``seed_session``."""

    task_input: TaskInput


class SeedSessionReply(_Strict):
    """Reply of ``seed_session``."""

    session_id: str


class ToolBody(_Strict):
    """Body of a tool call."""

    arg: int = Field(ge=0, lt=COUNTER_MODULUS)


class ToolReply(_Strict):
    """Reply of a tool call: the counter and how many notes it holds."""

    value: int
    notes: int


class VerifyReply(_Strict):
    """Reply of ``verify``."""

    reward: float


class CounterState(_Strict):
    """One session's exported state."""

    value: int = Field(ge=0, lt=COUNTER_MODULUS)
    notes: list[Annotated[int, Field(ge=0, lt=COUNTER_MODULUS)]]


_COUNTER_STATES: TypeAdapter[dict[str, CounterState]] = TypeAdapter(dict[str, CounterState])


@dataclass
class _Counter:
    value: int = 1
    notes: list[int] = field(default_factory=list)

    def apply(self, tool: ToolName, arg: int) -> None:
        if tool == "add":
            self.value = (self.value + arg) % COUNTER_MODULUS
        elif tool == "mul":
            self.value = (self.value * (arg + 1)) % COUNTER_MODULUS
        else:
            self.notes.append(arg)

    def reward(self) -> float:
        return ((self.value + 7 * sum(self.notes)) % 101) / 100


class CounterSessions:
    """The server's session state; the participant's :class:`ResourcesSessionHooks`."""

    def __init__(self) -> None:
        self.counters: dict[str, _Counter] = {}

    def create(self) -> str:
        """A new session at ``value = 1, notes = []``; returns its id."""
        session_id = uuid.uuid4().hex
        self.counters[session_id] = _Counter()
        return session_id

    async def export_session_states(self, session_ids: Sequence[str]) -> dict[str, Any]:
        """``{"value", "notes"}`` of each session still held."""
        return {
            sid: {"value": self.counters[sid].value, "notes": list(self.counters[sid].notes)}
            for sid in session_ids
            if sid in self.counters
        }

    async def restore_session_states(self, states: Mapping[str, Any]) -> None:
        """Validate every state, then install them all.

        Raises:
            InvalidCheckpointStateError: A state is not a counter; nothing was installed.
        """
        try:
            parsed = _COUNTER_STATES.validate_python(dict(states))  # one call for the batch
        except ValidationError as exc:
            sid = exc.errors()[0]["loc"][0]
            raise InvalidCheckpointStateError(f"session {sid!r}: {exc}") from None
        for sid, counter in parsed.items():
            self.counters[sid] = _Counter(counter.value, list(counter.notes))

    async def retire_session_state(self, session_id: str) -> None:
        """Drop one session (idempotent)."""
        self.counters.pop(session_id, None)


def _session_cookie(value: str | None) -> str:
    if not value:
        raise InvalidRequestError(f"the {SESSION_COOKIE} cookie is required")
    return value


VERIFY_HOLD_SECONDS: Final = 120.0
"""Longest a held verify waits for its release file (then it goes on: a test never hangs)."""


async def _held_until_released(release: Path) -> None:
    with anyio.move_on_after(VERIFY_HOLD_SECONDS):
        while not await anyio.Path(release).exists():  # noqa: ASYNC110 - a file from a test
            await anyio.sleep(0.02)


class RequestMetrics:
    """``/metrics`` of the resources routes: requests in progress and finished, per route.

    An operator sees a slow verify holding a checkpoint (``wait``) or running through one
    (``replay``); after a restore, a verify counted again in the fresh process is a re-run.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.finished = Counter(
            "midflight_resources_requests",
            "Resources requests finished, by route and outcome (ok or refused).",
            ["route", "outcome"],
            registry=registry,
        )
        self.in_progress = Gauge(
            "midflight_resources_requests_in_progress",
            "Resources requests being served (waiting for admission included), by route.",
            ["route"],
            registry=registry,
        )
        for route in ("seed", "tool", "verify", "close"):  # every series scrapes from the start
            self.in_progress.labels(route=route)
            for outcome in ("ok", "refused"):
                self.finished.labels(route=route, outcome=outcome)

    @asynccontextmanager
    async def serving(self, route: str) -> AsyncIterator[None]:
        """Count one request of ``route`` while it runs, then by how it ended."""
        gauge = self.in_progress.labels(route=route)
        gauge.inc()
        outcome = "refused"
        try:
            yield
            outcome = "ok"
        finally:
            gauge.dec()
            self.finished.labels(route=route, outcome=outcome).inc()


def create_resources_app(
    ctx: ServeContext,
    *,
    mode: ResourcesMode = "exported",
    verify: VerifyMode = "wait",
    verify_delay_ms: float = 0.0,
    verify_hold_dir: Path | None = None,
) -> FastAPI:
    """The resources server of ``ctx`` (its name is the participant's instance).

    Args:
        ctx: Name, tokens and run root.
        mode: ``exported`` (the reference deployment), ``stateless`` or ``restart_only``.
        verify: Announced to callers on every seed; ``replay`` verifies are not waited for.
        verify_delay_ms: How long each verify takes (the slow-verify variant).
        verify_hold_dir: A test knob: each verify waits (at most ``VERIFY_HOLD_SECONDS``) until a
            file named by its capture key exists in this directory, so a test decides when a
            verify ends instead of racing a timer.

    ``app.state.participant`` and ``app.state.plane`` give tests the participant and its plane.
    """
    counters = CounterSessions()
    participant = ResourcesParticipant(ctx.name, counters, mode=mode, verify=verify)
    plane = ControlPlane(participant, settings=control_settings(ctx))
    app = participant_app(plane, token=ctx.control_token, title="midflight resources server")
    app.state.participant = participant
    app.state.plane = plane
    app.state.counters = counters
    metrics = RequestMetrics(plane.telemetry.registry)

    @app.post(
        "/ng-rollout/{capture_key}/seed_session",
        response_model=SeedSessionReply,
        responses=SESSION_ERRORS,
    )
    async def seed_session(
        capture_key: str, body: SeedSessionBody, response: Response
    ) -> SeedSessionReply:
        """Start a counter session bound to the capture key."""
        episode = EpisodeId.from_capture_key(capture_key)
        async with (
            metrics.serving("seed"),
            participant.admit("seed", episode_id=episode, session_id=None),
        ):
            session_id = counters.create()
            await participant.bind_session(session_id, episode)
        response.headers[VERIFY_HEADER] = verify
        if mode == "restart_only":
            response.headers[RESTART_HEADER] = "1"
        response.set_cookie(SESSION_COOKIE, session_id, path="/")
        return SeedSessionReply(session_id=session_id)

    @app.post(
        "/ng-rollout/{capture_key}/tools/{tool}", response_model=ToolReply, responses=SESSION_ERRORS
    )
    async def call_tool(
        capture_key: str,
        tool: ToolName,
        body: ToolBody,
        ng_session: Annotated[str | None, Cookie()] = None,
    ) -> ToolReply:
        """Apply one tool to the session's counter."""
        episode = EpisodeId.from_capture_key(capture_key)
        session_id = _session_cookie(ng_session)
        async with (
            metrics.serving("tool"),
            participant.admit("tool", episode_id=episode, session_id=session_id),
        ):
            counter = counters.counters[session_id]
            counter.apply(tool, body.arg)
            return ToolReply(value=counter.value, notes=len(counter.notes))

    @app.post(
        "/ng-rollout/{capture_key}/verify", response_model=VerifyReply, responses=SESSION_ERRORS
    )
    async def verify_session(
        capture_key: str, ng_session: Annotated[str | None, Cookie()] = None
    ) -> VerifyReply:
        """The reward of the session's whole history; ends the session."""
        episode = EpisodeId.from_capture_key(capture_key)
        session_id = _session_cookie(ng_session)
        async with (
            metrics.serving("verify"),
            participant.admit("verify", episode_id=episode, session_id=session_id) as ad,
        ):
            if verify_delay_ms > 0:
                await anyio.sleep(verify_delay_ms / 1000)
            if verify_hold_dir is not None:
                await _held_until_released(verify_hold_dir / capture_key)
            counter = counters.counters.get(session_id)
            if counter is None:  # closed while the verify ran: its caller gave up (D246)
                raise CheckpointError(
                    f"session {session_id!r} of {capture_key} was closed while its verify ran; "
                    "no reward"
                )
            reward = counter.reward()
            await participant.end_session(ad)
            return VerifyReply(reward=reward)

    @app.post("/close_session", responses=SESSION_ERRORS)
    async def close_session(
        ng_session: Annotated[str | None, Cookie()] = None,
    ) -> dict[str, Any]:
        """End the session; never refused (an unknown session is already closed)."""
        async with (
            metrics.serving("close"),
            participant.admit("close", episode_id=None, session_id=ng_session) as ad,
        ):
            await participant.end_session(ad)
        return {}

    return app
