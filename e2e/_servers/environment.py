"""The environment server of the reference deployment: ``POST /run`` (e2e-contract §3, §4).

The episode logic lives in :class:`participants.EnvironmentParticipant`; this module adds the wire
model of ``/run`` and the HTTP clients to the agent and resources servers. A ``/run`` of a retired
or fenced attempt gets ``409 stale_attempt``; while a checkpoint is open a new one gets
``409 admission_closed``; a key already running, or a restored key sent with another task, gets
``409 checkpoint_error``. A peer's refusal ends the episode with a ``failure`` body (HTTP 200),
and so does a peer that does not answer within its timeout (:class:`PeerTimeouts`, each a
``serve environment`` option): ``{"code": "deadline_exceeded", "detail": <which call, how long>}``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import Any, Final

import anyio
import httpx
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from coordinator import HttpClient
from participants import (
    Clock,
    ControlPlane,
    EnvironmentParticipant,
    SeededSession,
    error_responses,
    participant_app,
)
from protocols import DeadlineExceededError, EpisodeId, InternalError, error_from_envelope

from .._trace.propagation import TRACE_HOOKS
from .call_phase import CallPhase
from .context import ServeContext, control_settings
from .peer_pool import CONNECT_RETRIES, peer_transport

ACTIVATION_HEADER: Final = "x-ng-agent-activation"
VERIFY_HEADER: Final = "x-ng-checkpoint-verify"
RESTART_HEADER: Final = "x-ng-checkpoint-restart"
SESSION_COOKIE: Final = "ng_session"
TIMEOUT_SLACK_SECONDS: Final = 5.0
"""httpx's own read and connect timeouts are set this much past ours, so ours (typed) fires
first. A connect is never given up sooner than its call: one not made yet is one the event loop
has not got to, or a SYN the kernel is still sending again (D409)."""


@dataclass(frozen=True)
class PeerTimeouts:
    """How long the environment waits for each peer call, in seconds (D246).

    Attributes:
        call_s: Seeds and closes (``serve environment --peer-timeout-s``).
        activation_s: An agent activation, which may be held through a checkpoint
            (``--activation-timeout-s``).
        verify_s: A verify: reward models can take minutes (``--verify-timeout-s``).
    """

    call_s: float = 60.0
    activation_s: float = 900.0
    verify_s: float = 900.0

    def __post_init__(self) -> None:
        for name in ("call_s", "activation_s", "verify_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")


def _httpx_timeout(seconds: float) -> httpx.Timeout:
    return httpx.Timeout(
        connect=seconds + TIMEOUT_SLACK_SECONDS,
        read=seconds + TIMEOUT_SLACK_SECONDS,
        write=60.0,
        pool=60.0,
    )


DEFAULT_EPISODE_SECONDS: Final = 3600.0
"""Each attempt's budget by default, not counting time a checkpoint holds it (D138)."""
RUN_ERRORS: Final = error_responses(
    ("invalid_rollout_id", "stale_attempt", "admission_closed", "checkpoint_error"),
    authenticated=False,
)
"""The refusals of ``/run`` (declared in OpenAPI); a peer's refusal is a ``failure`` body."""


class TaskId(BaseModel):
    """``{"taskset", "task_id"}``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    taskset: str = Field(min_length=1, max_length=200)
    task_id: str = Field(min_length=1, max_length=200)


class TaskInput(BaseModel):
    """The counter task: ``activations`` activations of ``turns`` turns of ``max_tokens`` tokens."""

    model_config = ConfigDict(extra="forbid", strict=True)
    activations: int = Field(default=2, ge=0, le=1000)
    turns: int = Field(default=2, ge=1, le=1000)
    max_tokens: int = Field(default=32, ge=1, le=65536)
    seed: int = Field(default=0, ge=0, le=2**64 - 1)


class Task(BaseModel):
    """One task of the counter task set."""

    model_config = ConfigDict(extra="forbid", strict=True)
    task_id: TaskId
    task_input: TaskInput


class RunRequest(BaseModel):
    """Body of ``POST /run``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    episode_id: EpisodeId
    task: Task


def _no_cookie_jar() -> CookieJar:
    # One client serves every episode: a shared jar would send one episode's session to another.
    return CookieJar(policy=DefaultCookiePolicy(allowed_domains=[]))


def _raise_for_refusal(reply: httpx.Response, what: str) -> Any:
    try:
        body = reply.json()
    except ValueError:
        body = None
    if reply.status_code != 200:
        raise error_from_envelope(reply.status_code, body)
    if not isinstance(body, dict):
        raise ValueError(f"{what} answered a body that is not a JSON object: {reply.text[:200]!r}")
    return body


class HttpEnvironmentPeers:
    """The agent and resources servers over HTTP.

    Args:
        agent: A client whose base URL is the agent server.
        resources: A client whose base URL is the resources server.
        timeouts: How long each kind of call may take.
    """

    def __init__(
        self,
        agent: httpx.AsyncClient,
        resources: httpx.AsyncClient,
        timeouts: PeerTimeouts | None = None,
    ) -> None:
        self.agent = agent
        self.resources = resources
        self.timeouts = timeouts or PeerTimeouts()

    async def _within(
        self,
        seconds: float,
        what: str,
        option: str,
        send: Callable[[dict[str, Any]], Awaitable[httpx.Response]],
    ) -> httpx.Response:
        """``send(extensions)``, or a typed error naming the call, its option and how far it got
        (``CallPhase``, D382)."""
        phase = CallPhase()
        try:
            with anyio.fail_after(seconds):
                return await send(phase.extensions)
        except (TimeoutError, httpx.ReadTimeout):
            raise DeadlineExceededError(
                f"{what} did not answer within {seconds:g} s (serve environment {option}); "
                f"{phase.describe()}"
            ) from None
        except httpx.TimeoutException as exc:  # connect, write or pool: it never got going
            raise DeadlineExceededError(
                f"{what} could not be sent ({type(exc).__name__}): the server did not take the "
                f"request; a connection is tried {CONNECT_RETRIES + 1} times (D380); "
                f"{phase.describe()}"
            ) from None
        except httpx.TransportError as exc:  # the connection broke: say which call it was
            raise InternalError(phase.broke(what, exc)) from exc

    async def seed_resources(self, key: str, task_input: dict[str, Any]) -> SeededSession:
        """``POST /ng-rollout/<key>/seed_session``; notes the verify mode and restart flag."""
        seconds = self.timeouts.call_s
        reply = await self._within(
            seconds,
            f"resources seed_session of {key}",
            "--peer-timeout-s",
            lambda ext: self.resources.post(
                f"/ng-rollout/{key}/seed_session",
                json={"task_input": task_input},
                timeout=_httpx_timeout(seconds),
                extensions=ext,
            ),
        )
        body = _raise_for_refusal(reply, "resources seed_session")
        session_id = body.get("session_id")
        if not isinstance(session_id, str) or not session_id:
            raise ValueError(f"resources seed_session gave no session id: {body!r}")
        verify = reply.headers.get(VERIFY_HEADER, "wait").strip().lower()
        return SeededSession(
            session_id=session_id,
            verify="replay" if verify == "replay" else "wait",
            restart=reply.headers.get(RESTART_HEADER, "").strip() == "1",
        )

    async def seed_agent(
        self, key: str, resources_session_id: str, task_input: dict[str, Any]
    ) -> None:
        """``POST /ng-rollout/<key>/sessions/seed``."""
        seconds = self.timeouts.call_s
        reply = await self._within(
            seconds,
            f"agent sessions/seed of {key}",
            "--peer-timeout-s",
            lambda ext: self.agent.post(
                f"/ng-rollout/{key}/sessions/seed",
                json={"resources_session_id": resources_session_id, "task_input": task_input},
                timeout=_httpx_timeout(seconds),
                extensions=ext,
            ),
        )
        _raise_for_refusal(reply, "agent sessions/seed")

    async def activate(self, key: str, activation: int) -> dict[str, Any]:
        """``POST /ng-rollout/<key>/sessions/activate`` with the activation index header."""
        seconds = self.timeouts.activation_s
        reply = await self._within(
            seconds,
            f"agent activation {activation} of {key}",
            "--activation-timeout-s",
            lambda ext: self.agent.post(
                f"/ng-rollout/{key}/sessions/activate",
                headers={ACTIVATION_HEADER: str(activation)},
                timeout=_httpx_timeout(seconds),
                extensions=ext,
            ),
        )
        result: dict[str, Any] = _raise_for_refusal(reply, "agent sessions/activate")
        return result

    async def verify(self, key: str, resources_session_id: str) -> float:
        """``POST /ng-rollout/<key>/verify`` with the session cookie; the reward."""
        seconds = self.timeouts.verify_s
        reply = await self._within(
            seconds,
            f"resources verify of {key}",
            "--verify-timeout-s",
            lambda ext: self.resources.post(
                f"/ng-rollout/{key}/verify",
                headers={"cookie": f"{SESSION_COOKIE}={resources_session_id}"},
                timeout=_httpx_timeout(seconds),
                extensions=ext,
            ),
        )
        body = _raise_for_refusal(reply, "resources verify")
        reward = body.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, int | float):
            raise ValueError(f"resources verify gave no reward: {body!r}")
        return float(reward)

    async def close(self, key: str, resources_session_id: str | None) -> None:
        """Close the agent session, then the resources session (never refused)."""
        seconds = self.timeouts.call_s
        reply = await self._within(
            seconds,
            f"agent sessions/close of {key}",
            "--peer-timeout-s",
            lambda ext: self.agent.post(
                f"/ng-rollout/{key}/sessions/close",
                timeout=_httpx_timeout(seconds),
                extensions=ext,
            ),
        )
        _raise_for_refusal(reply, "agent sessions/close")
        if resources_session_id is not None:
            reply = await self._within(
                seconds,
                f"resources close_session of {key}",
                "--peer-timeout-s",
                lambda ext: self.resources.post(
                    "/close_session",
                    headers={"cookie": f"{SESSION_COOKIE}={resources_session_id}"},
                    timeout=_httpx_timeout(seconds),
                    extensions=ext,
                ),
            )
            _raise_for_refusal(reply, "resources close_session")


def create_environment_app(
    ctx: ServeContext,
    *,
    agent_transport: httpx.AsyncBaseTransport | None = None,
    resources_transport: httpx.AsyncBaseTransport | None = None,
    episode_seconds: float | None = DEFAULT_EPISODE_SECONDS,
    clock: Clock | None = None,
    timeouts: PeerTimeouts | None = None,
) -> FastAPI:
    """The environment server: control routes, ``/healthz``, ``/metrics`` and ``/run``.

    Args:
        ctx: Name, peers and tokens of the server.
        agent_transport: How to reach the agent (tests pass an in-process transport).
        resources_transport: How to reach the resources server (likewise).
        episode_seconds: Each attempt's budget (time held by checkpoints not counted);
            ``None`` for none.
        clock: Where the budget reads the time (the wall clock by default).
        timeouts: How long each peer call may take; :class:`PeerTimeouts` by default.
    """
    agent = HttpClient(
        base_url=ctx.peer_url("agent"),
        timeout=_httpx_timeout(PeerTimeouts().call_s),
        transport=agent_transport or peer_transport(),
        cookies=_no_cookie_jar(),
        event_hooks=TRACE_HOOKS,
    )
    resources = HttpClient(
        base_url=ctx.peer_url("resources"),
        timeout=_httpx_timeout(PeerTimeouts().call_s),
        transport=resources_transport or peer_transport(),
        cookies=_no_cookie_jar(),
        event_hooks=TRACE_HOOKS,
    )
    participant = EnvironmentParticipant(
        ctx.name,
        HttpEnvironmentPeers(agent, resources, timeouts),
        episode_seconds=episode_seconds,
        clock=clock,
    )
    plane = ControlPlane(participant, settings=control_settings(ctx))

    @asynccontextmanager
    async def episodes(_app: FastAPI) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            await stack.enter_async_context(agent)
            await stack.enter_async_context(resources)
            await stack.enter_async_context(participant.serving())
            yield

    app = participant_app(
        plane, token=ctx.control_token, title="midflight environment server", lifespan=episodes
    )
    app.state.participant = participant
    app.state.plane = plane

    @app.post("/run", tags=["episodes"], responses=RUN_ERRORS)
    async def run(body: RunRequest) -> dict[str, Any]:
        """Run one episode (or continue its restored boundary) and return its result."""
        task = body.task.model_dump(mode="json")
        outcome = await participant.run(body.episode_id, task)
        reply: dict[str, Any] = {
            "episode_id": body.episode_id.model_dump(),
            "task_id": task["task_id"],
        }
        if outcome.result is not None:
            reply["result"] = outcome.result
        else:
            reply["failure"] = outcome.failure
        return reply

    return app
