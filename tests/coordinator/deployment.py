"""An in-process deployment for coordinator tests: real control planes behind ASGITransport.

Each participant is a small fake that writes what the runtime asks of it into one shared call log,
so a test can check the order in which the coordinator reached the participants.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
from fastapi import FastAPI

from coordinator import ControlClient, Coordinator, Member
from participants import BaseParticipant, ControlPlane, Record, build_report, participant_app
from protocols import CheckpointRequest, EpisodeId, ParticipantKind, PrepareReport

from .s3_participants import ASGIApp, S3Shares

TOKEN = "coord-token"


class Logged(BaseParticipant):
    """A participant that logs each runtime call as ``(instance, operation, detail)``."""

    def __init__(
        self, kind: ParticipantKind, instance: str, log: list[tuple[str, str, str]]
    ) -> None:
        super().__init__()
        self.kind = kind
        self.instance = instance
        self.log = log
        self.ready_now = True
        self.blockers: list[str] = []
        self.restarts: list[str] = []
        self.episodes: list[EpisodeId] = []
        self.fail_install: Exception | None = None
        self.fail_forget: Exception | None = None
        self.extras: dict[str, Any] = {}
        self.served = False

    async def close_admission(self, request: CheckpointRequest) -> None:
        self.log.append((self.instance, "close", request.checkpoint_id))

    async def open_admission(self) -> None:
        self.log.append((self.instance, "open", ""))

    def readiness(self) -> PrepareReport:
        return build_report(
            [] if self.ready_now else self.blockers or ["blocked"], restarts=self.restarts
        )

    def become_ready(self) -> None:
        self.log.append((self.instance, "ready", ""))
        self.ready_now = True
        self.changes.notify()

    async def export(self, episode_ids: Sequence[EpisodeId] | None) -> list[Record]:
        chosen = self.episodes if episode_ids is None else list(episode_ids)
        return [{"episode_id": e.model_dump(), "from": self.instance} for e in chosen]

    async def install(self, records: Sequence[Record], scope: Sequence[EpisodeId]) -> None:
        self.log.append((self.instance, "install", ",".join(e.capture_key for e in scope)))
        if self.fail_install is not None:
            raise self.fail_install

    def served_live_work(self) -> bool:
        return self.served

    async def retire(self, episode_id: EpisodeId) -> None:
        self.log.append((self.instance, "retire", episode_id.capture_key))

    async def forget(self, rollout_ids: Sequence[str]) -> None:
        self.log.append((self.instance, "forget", ",".join(rollout_ids)))
        if self.fail_forget is not None:
            raise self.fail_forget

    def commit_reply(self, records: Sequence[Record]) -> dict[str, Any]:
        return dict(self.extras)


class Router(httpx.AsyncBaseTransport):
    """Routes ``http://<host>/…`` to the app registered for that host; unknown hosts refuse."""

    def __init__(self) -> None:
        self.apps: dict[str, httpx.ASGITransport] = {}
        self.down: set[str] = set()
        self.requests: list[httpx.Request] = []

    def add(self, host: str, app: FastAPI | ASGIApp) -> None:
        self.apps[host] = httpx.ASGITransport(app=app)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        host = request.url.host
        if host in self.down or host not in self.apps:
            raise httpx.ConnectError(f"{host} is down", request=request)
        return await self.apps[host].handle_async_request(request)


@dataclass
class Deployment:
    """Fakes, their planes and a coordinator over them."""

    router: Router
    fakes: dict[str, Logged]
    planes: dict[str, ControlPlane]
    coordinator: Coordinator
    log: list[tuple[str, str, str]] = field(default_factory=list)

    def ops(self, operation: str) -> list[str]:
        """Instances in the order they saw ``operation``."""
        return [name for name, op, _ in self.log if op == operation]


DEFAULT_SHAPE: tuple[tuple[ParticipantKind, str], ...] = (
    ("resources", "resources"),
    ("agent", "agent"),
    ("model", "policy"),
    ("environment", "environment"),
    ("resources", "resources2"),
)


@asynccontextmanager
async def deployment(
    shape: Sequence[tuple[ParticipantKind, str]] = DEFAULT_SHAPE,
    log: list[tuple[str, str, str]] | None = None,
    *,
    s3_mirror: Path | None = None,
) -> AsyncIterator[Deployment]:
    """Start one control plane per ``(kind, instance)``; yield them with a coordinator.

    With ``s3_mirror``, every participant commits to and restores from an ``s3://``
    ``checkpoint_dir`` through :class:`S3Shares` (a directory of its own under ``s3_mirror``).
    """
    log = [] if log is None else log
    router = Router()
    fakes: dict[str, Logged] = {}
    planes: dict[str, ControlPlane] = {}
    async with AsyncExitStack() as stack:
        for kind, instance in shape:
            fake = Logged(kind, instance, log)
            plane = ControlPlane(fake)
            await stack.enter_async_context(plane.running())
            app = participant_app(plane, token=TOKEN)
            router.add(instance, app if s3_mirror is None else S3Shares(app, s3_mirror / instance))
            fakes[instance], planes[instance] = fake, plane
        members = [
            Member(
                kind,
                instance,
                f"http://{instance}",
                ControlClient(f"http://{instance}", token=TOKEN, transport=router, wait=_no_wait()),
            )
            for kind, instance in shape
        ]
        coordinator = Coordinator(members)
        stack.push_async_callback(coordinator.aclose)
        yield Deployment(router, fakes, planes, coordinator, log)


def _no_wait() -> Any:
    from tenacity import wait_none

    return wait_none()


async def flip_ready_later(fake: Logged, seconds: float) -> None:
    """Make ``fake`` ready after ``seconds`` (runs in a task group)."""
    await anyio.sleep(seconds)
    fake.become_ready()
