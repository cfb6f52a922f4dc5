"""A fake agent and resources server (one app serves both route sets) for the environment's tests.

It keeps the counter arithmetic out: each activation and verify is recorded with the headers and
cookie it arrived with, and ``hold_activation`` makes activations wait until released.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse


@dataclass
class PeerLog:
    """What the fake peers saw, and the switches that steer them."""

    verify_mode: str = "replay"
    requests: list[dict[str, Any]] = field(default_factory=list)
    refuse_activation: tuple[int, str] | None = None
    hold_activation: int | None = None
    verify_seconds: float = 0.0
    held: anyio.Event = field(default_factory=anyio.Event)
    release: anyio.Event = field(default_factory=anyio.Event)

    def seen(self, route: str) -> list[dict[str, Any]]:
        return [r for r in self.requests if r["route"] == route]


def fake_peers_app(log: PeerLog) -> FastAPI:
    """The fake agent + resources app."""
    app = FastAPI()

    async def note(route: str, key: str | None, request: Request) -> dict[str, Any]:
        body = await request.body()
        entry = {
            "route": route,
            "key": key,
            "cookie": request.headers.get("cookie"),
            "activation": request.headers.get("x-ng-agent-activation"),
            "body": body.decode() if body else None,
        }
        log.requests.append(entry)
        return entry

    @app.post("/ng-rollout/{key}/seed_session")
    async def seed_session(key: str, request: Request) -> Response:
        await note("seed_session", key, request)
        session_id = f"sess-{key}"
        reply = JSONResponse({"session_id": session_id})
        reply.headers["x-ng-checkpoint-verify"] = log.verify_mode
        reply.set_cookie("ng_session", session_id, path="/")
        return reply

    @app.post("/ng-rollout/{key}/sessions/seed")
    async def seed_agent(key: str, request: Request) -> dict[str, Any]:
        await note("sessions/seed", key, request)
        return {"session_key": key}

    @app.post("/ng-rollout/{key}/sessions/activate")
    async def activate(key: str, request: Request) -> Response:
        entry = await note("sessions/activate", key, request)
        index = int(entry["activation"])
        if log.refuse_activation is not None and log.refuse_activation[0] == index:
            code = log.refuse_activation[1]
            return JSONResponse({"error": {"code": code, "detail": "refused"}}, status_code=409)
        if log.hold_activation == index:
            log.held.set()
            await log.release.wait()
        return JSONResponse({"activation": index, "messages": [], "turns": 2})

    @app.post("/ng-rollout/{key}/verify")
    async def verify(key: str, request: Request) -> dict[str, Any]:
        await note("verify", key, request)
        await anyio.sleep(log.verify_seconds)  # a slow reward model
        return {"reward": 0.37}

    @app.post("/ng-rollout/{key}/sessions/close")
    async def close_agent(key: str, request: Request) -> dict[str, Any]:
        await note("sessions/close", key, request)
        return {}

    @app.post("/close_session")
    async def close_session(request: Request) -> dict[str, Any]:
        await note("close_session", None, request)
        return {}

    return app
