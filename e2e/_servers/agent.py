"""The reference agent server (e2e-contract §3, §4): sessions that call the policy and the tools.

Routes, besides the control routes, ``/healthz`` and ``/metrics``:

- ``POST /ng-rollout/<key>/sessions/seed`` ``{"resources_session_id", "task_input"}`` →
  ``{"session_key"}``
- ``POST /ng-rollout/<key>/sessions/activate`` with ``x-ng-agent-activation: <a>`` →
  ``{"activation", "messages", "turns"}``
- ``POST /ng-rollout/<key>/sessions/close`` → ``{}``

With ``restart_only`` the server runs a :class:`participants.RestartOnlyAgentParticipant`: the
same sessions, never captured, and every seed reply carries ``x-ng-checkpoint-restart: 1``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Annotated, Any, Final, Literal

import httpx
from fastapi import FastAPI, Header, Response
from pydantic import BaseModel, ConfigDict

from coordinator import HttpClient
from participants import (
    AgentParticipant,
    AgentTaskInput,
    ControlPlane,
    ResourcesSessionId,
    RestartOnlyAgentParticipant,
    error_responses,
    participant_app,
)
from protocols import EpisodeId, InternalError, WireError, error_from_envelope

from .._trace.propagation import TRACE_HOOKS
from .call_phase import CallPhase
from .context import ServeContext, control_settings
from .peer_pool import HELD_CALL_TIMEOUT, peer_transport

ACTIVATION_HEADER: Final = "x-ng-agent-activation"
RESTART_HEADER: Final = "x-ng-checkpoint-restart"
SESSION_ERRORS: Final = error_responses(
    (
        "invalid_rollout_id",
        "stale_attempt",
        "activation_out_of_order",
        "checkpoint_error",
        "invalid_checkpoint_state",
    ),
    authenticated=False,
)
"""The refusals a session route of the agent may answer (declared in OpenAPI)."""


class SeedBody(BaseModel):
    """Body of ``sessions/seed``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    resources_session_id: ResourcesSessionId
    task_input: AgentTaskInput


class ActivationReply(BaseModel):
    """Reply of ``sessions/activate``: the messages this activation added."""

    model_config = ConfigDict(extra="forbid")

    activation: int
    messages: list[dict[str, str]]
    turns: int


class HttpAgentPeers:
    """The agent's peers over HTTP: clients opened by the server's lifespan."""

    def __init__(self) -> None:
        self.model: httpx.AsyncClient | None = None
        self.resources: httpx.AsyncClient | None = None

    @staticmethod
    def _refusal(reply: httpx.Response, peer: str) -> WireError:
        try:
            body = reply.json()
        except ValueError:  # not JSON: the envelope parser reports the bare status
            body = None
        error = error_from_envelope(reply.status_code, body)
        error.detail = f"{peer}: {error.detail}"
        return error

    async def complete(
        self, session_key: str, messages: list[dict[str, str]], max_tokens: int
    ) -> str:
        """One chat completion on the policy server."""
        assert self.model is not None, "the agent server is not running"
        phase = CallPhase()
        try:
            reply = await self.model.post(
                f"/ng-rollout/{session_key}/v1/chat/completions",
                json={"messages": messages, "max_tokens": max_tokens},
                extensions=phase.extensions,
            )
        except httpx.TransportError as exc:  # how far it got decides if it may have run (D382)
            raise InternalError(
                phase.broke(f"the policy server call of {session_key}", exc)
            ) from exc
        if reply.status_code != 200:
            raise self._refusal(reply, "the policy server")
        return str(reply.json()["choices"][0]["message"]["content"])

    async def call_tool(
        self, session_key: str, resources_session_id: str, tool: str, arg: int
    ) -> dict[str, int]:
        """One tool call on the resources server, in the session named by the cookie."""
        assert self.resources is not None, "the agent server is not running"
        phase = CallPhase()
        try:
            reply = await self.resources.post(
                f"/ng-rollout/{session_key}/tools/{tool}",
                json={"arg": arg},
                headers={"cookie": f"ng_session={resources_session_id}"},
                extensions=phase.extensions,
            )
        except httpx.TransportError as exc:
            raise InternalError(
                phase.broke(f"the resources tool call {tool} of {session_key}", exc)
            ) from exc
        if reply.status_code != 200:
            raise self._refusal(reply, "the resources server")
        body = reply.json()
        return {"value": int(body["value"]), "notes": int(body["notes"])}


def create_agent_app(
    ctx: ServeContext,
    *,
    restart_only: bool = False,
    transports: Mapping[str, httpx.AsyncBaseTransport] | None = None,
) -> FastAPI:
    """The agent server's ASGI app.

    Args:
        ctx: Name, peers, tokens.
        restart_only: Serve sessions that are restarted after a crash, never continued.
        transports: Per peer role (``model``, ``resources``), a transport to use instead of the
            network (tests pass ``httpx.ASGITransport`` of fake peers).
    """
    peers = HttpAgentPeers()
    kind = RestartOnlyAgentParticipant if restart_only else AgentParticipant
    participant = kind(ctx.name, peers)
    plane = ControlPlane(participant, settings=control_settings(ctx))

    @asynccontextmanager
    async def clients(_app: FastAPI) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            roles: tuple[Literal["model", "resources"], ...] = ("model", "resources")
            for role in roles:
                transport = (transports or {}).get(role)
                client = HttpClient(
                    base_url=ctx.peer_url(role),
                    timeout=HELD_CALL_TIMEOUT,
                    transport=transport or peer_transport(),
                    event_hooks=TRACE_HOOKS,
                )
                await stack.enter_async_context(client)
                setattr(peers, role, client)
            yield

    app = participant_app(
        plane, token=ctx.control_token, title="midflight agent server", lifespan=clients
    )
    app.state.participant = participant
    app.state.plane = plane

    @app.post("/ng-rollout/{capture_key}/sessions/seed", responses=SESSION_ERRORS)
    async def seed(capture_key: str, body: SeedBody, response: Response) -> dict[str, str]:
        """Open the session of this attempt; waits while a checkpoint is open."""
        episode_id = EpisodeId.from_capture_key(capture_key)
        key = await participant.seed(episode_id, body.resources_session_id, body.task_input)
        if restart_only:  # the environment then runs the episode as a restart
            response.headers[RESTART_HEADER] = "1"
        return {"session_key": key}

    @app.post(
        "/ng-rollout/{capture_key}/sessions/activate",
        response_model=ActivationReply,
        responses=SESSION_ERRORS,
    )
    async def activate(
        capture_key: str,
        activation: Annotated[int, Header(alias=ACTIVATION_HEADER, ge=1, le=10_000)],
    ) -> dict[str, Any]:
        """Run the next activation, or repeat the reply of the last completed one."""
        episode_id = EpisodeId.from_capture_key(capture_key)
        return await participant.activate(episode_id, activation)

    @app.post("/ng-rollout/{capture_key}/sessions/close", responses=SESSION_ERRORS)
    async def close(capture_key: str) -> dict[str, Any]:
        """End the session (a running activation is cancelled)."""
        await participant.close(EpisodeId.from_capture_key(capture_key))
        return {}

    return app
