"""Shared pieces of the checkpoint, restore, overhead and scale benchmarks.

:class:`InProcessCluster` is the reference deployment (worker, policy model, resources, agent,
environment) in one process: each server is its real ASGI app, the servers reach each other and
the coordinator reaches them through ``httpx.ASGITransport``, and every file (ledger, staging,
records, manifests, evidence) is a real file under the run root. Thousands of rollouts in flight
then cost no descriptors and no ports: a real server process needs a socket per open request on
every hop, and the descriptor limit of one process is what caps a process-level run first.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import secrets
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import anyio
import httpx
import structlog
from fastapi import FastAPI
from tenacity import wait_none

from coordinator import ControlClient, Coordinator, HttpClient, Member
from participants import ControlPlane
from protocols import EpisodeId, ParticipantKind

from .._servers.agent import create_agent_app
from .._servers.cluster import Role, default_cluster
from .._servers.context import ServeContext
from .._servers.environment import create_environment_app
from .._servers.model import create_model_app
from .._servers.resources import create_resources_app
from .._worker.app import WorkerSettings, create_worker_app

TOKEN: Final = secrets.token_urlsafe(24)
"""The control token of every in-process server (a fresh one per bench process)."""
PARKING: Final = (
    "in-process participants: the five reference server apps in one process, reached through "
    "httpx.ASGITransport, with real files under the run root (no sockets, so no descriptor or "
    "port limit)"
)
"""How the benchmarks park their rollouts; every suite prints it."""
KINDS: Final[dict[Role, ParticipantKind]] = {
    "environment": "environment",
    "model": "model",
    "agent": "agent",
    "resources": "resources",
}


@dataclass(frozen=True)
class Workload:
    """The counter task every rollout runs, and how slowly the worker generates."""

    activations: int = 2
    turns: int = 1
    max_tokens: int = 16
    token_delay_ms: float = 1.0

    def task_input(self) -> dict[str, int]:
        """The ``task_input`` of the counter task."""
        return {
            "activations": self.activations,
            "turns": self.turns,
            "max_tokens": self.max_tokens,
            "seed": 0,
        }


def run_body(rollout: str, attempt: int, workload: Workload) -> dict[str, Any]:
    """The ``/run`` body of one attempt of the counter task."""
    return {
        "episode_id": EpisodeId(rollout_id=rollout, attempt=attempt).model_dump(),
        "task": {
            "task_id": {"taskset": "counter", "task_id": rollout},
            "task_input": workload.task_input(),
        },
    }


@dataclass
class BoundaryWaits:
    """Seconds each participant's prepare spent waiting for its work to reach a boundary."""

    seconds: dict[str, float] = field(default_factory=dict)

    def wrap(self, name: str, plane: ControlPlane) -> None:
        """Time ``plane``'s readiness wait (the one part of prepare that is not ours)."""
        inner: Callable[[str, float], Awaitable[None]] = plane.prepares._wait_ready

        @functools.wraps(inner)
        async def timed(checkpoint_id: str, deadline: float) -> None:
            start = time.perf_counter()
            try:
                await inner(checkpoint_id, deadline)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

        plane.prepares._wait_ready = timed  # type: ignore[method-assign]

    def take(self) -> dict[str, float]:
        """The waits since the last call, and start over."""
        taken, self.seconds = self.seconds, {}
        return taken


class InProcessCluster:
    """The reference servers of one run root, in this process.

    Args:
        root: The run root (ledger, staging, checkpoints and evidence go under it).
        workload: The worker's token delay comes from it.
        control: Whether checkpointing is on; ``False`` builds every server without a control
            token, so no control route (and no generation-cut route) exists at all.
    """

    def __init__(self, root: Path, workload: Workload, *, control: bool = True) -> None:
        self.root = root
        self.workload = workload
        self.control = control
        self.apps: dict[Role, FastAPI] = {}
        self.waits = BoundaryWaits()
        self.coordinator: Coordinator | None = None
        self.http: httpx.AsyncClient | None = None

    def _context(self, name: str) -> ServeContext:
        token = TOKEN if self.control else None
        return ServeContext(name, 0, self.root, default_cluster(self.root), token, token)

    def _build(self) -> None:
        root, token = self.root, (TOKEN if self.control else None)
        worker = create_worker_app(
            WorkerSettings(
                root=root,
                token_delay_ms=self.workload.token_delay_ms,
                control_token=token,
            )
        )
        model = create_model_app(
            self._context("policy"), worker_transport=httpx.ASGITransport(app=worker)
        )
        resources = create_resources_app(self._context("resources"))
        agent = create_agent_app(
            self._context("agent"),
            transports={
                "model": httpx.ASGITransport(app=model),
                "resources": httpx.ASGITransport(app=resources),
            },
        )
        environment = create_environment_app(
            self._context("environment"),
            agent_transport=httpx.ASGITransport(app=agent),
            resources_transport=httpx.ASGITransport(app=resources),
            episode_seconds=None,
        )
        self.apps = {
            "worker": worker,
            "model": model,
            "resources": resources,
            "agent": agent,
            "environment": environment,
        }

    @asynccontextmanager
    async def running(self) -> AsyncIterator[InProcessCluster]:
        """Start every app's lifespan (dependencies first) and the coordinator; stop them after."""
        self._build()
        async with AsyncExitStack() as stack:
            for app in self.apps.values():
                await stack.enter_async_context(app.router.lifespan_context(app))
            self.http = HttpClient(
                transport=httpx.ASGITransport(app=self.apps["environment"]),
                base_url="http://environment",
                timeout=httpx.Timeout(900.0),
            )
            stack.push_async_callback(self.http.aclose)
            if self.control:
                members = []
                for role, kind in KINDS.items():
                    plane: ControlPlane = self.apps[role].state.plane
                    self.waits.wrap(plane.participant.instance, plane)
                    members.append(
                        Member(
                            kind,
                            plane.participant.instance,
                            f"http://{role}",
                            ControlClient(
                                f"http://{role}",
                                token=TOKEN,
                                transport=httpx.ASGITransport(app=self.apps[role]),
                                wait=wait_none(),
                            ),
                        )
                    )
                self.coordinator = Coordinator(members)
                stack.push_async_callback(self.coordinator.aclose)
            yield self

    def transport_of(self, url: str) -> httpx.ASGITransport:
        """The transport to a server of this cluster by its URL (``http://<role>``)."""
        role: Role = url.removeprefix("http://")  # type: ignore[assignment]
        return httpx.ASGITransport(app=self.apps[role])

    def plane(self, role: Role) -> ControlPlane:
        """The control plane of one server."""
        plane: ControlPlane = self.apps[role].state.plane
        return plane

    def model_calls_in_flight(self) -> int:
        """Calls the policy server has admitted and not yet delivered."""
        return len(self.apps["model"].state.policy.participant.gate.tickets)

    def every_generation_grew(self) -> bool:
        """Whether every running generation has tokens its last cut did not stage."""
        return all(
            len(live.generated) > live.staged_count
            for live in self.apps["worker"].state.engine.live.values()
        )

    def generations_running(self) -> int:
        """Calls the worker is generating: admitted by the model, resolved, logged and sent."""
        return len(self.apps["worker"].state.engine.live)

    async def run(self, rollout: str, attempt: int = 0) -> dict[str, Any]:
        """``POST /run`` until admitted (a closed admission is retried); the reply body."""
        assert self.http is not None, "use `async with cluster.running()`"
        body = run_body(rollout, attempt, self.workload)
        while True:
            reply = await self.http.post("/run", json=body)
            if reply.status_code == 409 and "admission_closed" in reply.text:
                await anyio.sleep(0.05)  # a checkpoint is open: the same attempt after resume
                continue
            reply.raise_for_status()
            result: dict[str, Any] = reply.json()
            return result


async def wait_for(predicate: Callable[[], bool], what: str, within_s: float) -> None:
    """Poll an in-process predicate until it holds.

    Raises:
        TimeoutError: It did not hold within ``within_s`` seconds (names ``what``).
    """
    with anyio.move_on_after(within_s):
        # The state polled belongs to the servers, which signal nothing a bench could wait on.
        while not predicate():  # noqa: ASYNC110
            await anyio.sleep(0.02)
        return
    raise TimeoutError(f"{what} did not happen within {within_s:g} s")


@contextmanager
def quiet_logs() -> Iterator[None]:
    """Keep the servers' per-operation log lines off the bench's stdout while the block runs.

    A served process writes them to its own log file; here they would interleave with ``--json``.
    Warnings and errors still go to stderr. The previous configuration comes back afterwards, so
    a bench run inside a longer-lived process (a test session) leaves its logging alone.
    """
    saved = structlog.get_config()
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
    try:
        yield
    finally:
        structlog.configure(**saved)


def load_average() -> list[float]:
    """The 1-, 5- and 15-minute load averages now, rounded to two places.

    Every bench reports them at its start (``loadavg``) and end (``loadavg_end``): on a shared
    machine a figure means little without the load it was measured under.
    """
    return [round(value, 2) for value in os.getloadavg()]


_STAGE_REPORT: ContextVar[Callable[[str], None] | None] = ContextVar("bench_stage", default=None)


def stage(text: str) -> None:
    """Say what the bench does now (``"16,000 rollouts · restoring"``) to whoever watches it.

    The command line draws it on stderr; a bench run from code reports to no one. The report
    travels in a context variable, so it reaches a measurement inside ``anyio.run`` and its tasks.
    """
    report = _STAGE_REPORT.get()
    if report is not None:
        report(text)


@contextmanager
def reporting_stages(report: Callable[[str], None]) -> Iterator[None]:
    """Send every :func:`stage` said inside this block to ``report``."""
    token = _STAGE_REPORT.set(report)
    try:
        yield
    finally:
        _STAGE_REPORT.reset(token)


def speed_probe_ms() -> float:
    """How long a fixed piece of pure-Python work takes now: the fastest of three runs, in ms.

    The work (50,000 dictionary entries, their JSON both ways, SHA-256 of 4 MB) stands for what
    the servers do. On a shared VM the machine's speed moves within a day by more than a change
    under test does, while the load average stays the same (D426): two runs compare only when
    their probes agree.
    """
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        table = {f"k{index}": index * 7 for index in range(50_000)}
        data = json.dumps(table).encode()
        json.loads(data)
        hashlib.sha256(data * 4).digest()
        best = min(best, time.perf_counter() - start)
    return round(best * 1000, 2)


def under_load(measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run ``measure``; its payload with ``loadavg`` (at the start) and ``loadavg_end`` added,
    and ``speed_probe_ms``: :func:`speed_probe_ms` at the start and at the end."""
    before, probe = load_average(), speed_probe_ms()
    payload = measure()
    payload["loadavg"] = before
    payload["loadavg_end"] = load_average()
    payload["speed_probe_ms"] = [probe, speed_probe_ms()]
    return payload


def files_under(directory: Path) -> list[Path]:
    """Every regular file under ``directory``, sorted."""
    return sorted(p for p in directory.rglob("*") if p.is_file())


def write_floor(files: dict[str, bytes], directory: Path) -> float:
    """The floor of a commit: write the same bytes, one fsync per file; seconds taken."""
    directory.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    for index, data in enumerate(files.values()):
        fd = os.open(directory / f"f{index}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)  # the floor's one fsync per file: what any durable write must pay
        finally:
            os.close(fd)
    return time.perf_counter() - start


def median(values: list[float]) -> float:
    """The median, rounded for printing."""
    return round(statistics.median(values), 6) if values else 0.0


def ratio(ours: float, floor: float) -> float | None:
    """``ours / floor`` rounded, or ``None`` when the floor is zero."""
    return round(ours / floor, 3) if floor > 0 else None
