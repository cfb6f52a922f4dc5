"""A minimal participant server: counter episodes that advance, park and continue.

Each episode counts from its current step up to a target, one step every ``--tick-ms``. Between
steps it records a boundary; while a checkpoint is open it parks there. A checkpoint exports the
parked episodes (their step changes over time, so every export is different); a restore in a fresh
process installs them under their next attempt, and a replacement ``start`` continues from the
saved step.

Run it::

    MIDFLIGHT_CONTROL_TOKEN=secret python docs/examples/minimal_participant.py --port 8710

Data routes (besides the control routes, ``/healthz`` and ``/metrics``):

- ``POST /ng-rollout/<capture_key>/start`` ``{"target": 20}`` → ``{"step", "state"}``
- ``GET  /ng-rollout/<capture_key>`` → ``{"step", "target", "state"}``
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import uvicorn
from anyio.abc import TaskGroup
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from participants import (
    BaseParticipant,
    ControlPlane,
    Record,
    build_report,
    participant_app,
)
from protocols import (
    AdmissionClosedError,
    CheckpointError,
    CheckpointRequest,
    EpisodeId,
    ParticipantKind,
    PrepareReport,
)


class Episode:
    """One counter episode: its progress and the task that advances it."""

    def __init__(self, episode_id: EpisodeId, step: int, target: int) -> None:
        self.episode_id = episode_id
        self.step = step
        self.target = target
        self.in_step = False
        self.parked = False
        self.scope = anyio.CancelScope()
        self.stopped = anyio.Event()

    @property
    def state(self) -> str:
        if self.step >= self.target:
            return "finished"
        return "parked" if self.parked else "running"


class CounterParticipant(BaseParticipant):
    """An environment-kind participant whose episodes are counters."""

    kind: ParticipantKind = "environment"

    def __init__(self, instance: str = "example", tick_seconds: float = 0.05) -> None:
        super().__init__()
        self.instance = instance
        self.tick_seconds = tick_seconds
        self.episodes: dict[str, Episode] = {}
        self.restored: dict[str, Record] = {}
        self.accepting = True
        self.awaiting_resume = False
        self.opened = anyio.Event()
        self.served = False
        self.task_group: TaskGroup | None = None

    # ---- data plane
    async def start(self, episode_id: EpisodeId, target: int) -> Episode:
        """Start (or continue, after a restore) one episode."""
        self.marks.check(episode_id)
        key = episode_id.capture_key
        restored = self.restored.get(key)
        if not self.accepting and (restored is None or self.awaiting_resume):
            raise AdmissionClosedError("a checkpoint is open; retry after resume")
        if key in self.episodes:
            raise CheckpointError(f"{key} is already running")
        step = 0
        if restored is not None:
            step = int(restored["step"])
            target = int(restored["target"])
            del self.restored[key]
        self.served = True
        episode = Episode(episode_id, step, target)
        self.episodes[key] = episode
        assert self.task_group is not None, "the server is not running"
        self.task_group.start_soon(self._run, episode)
        return episode

    async def _run(self, episode: Episode) -> None:
        try:
            with episode.scope:
                while episode.step < episode.target:
                    episode.in_step = True
                    await anyio.sleep(self.tick_seconds)
                    episode.step += 1
                    episode.in_step = False
                    await self._boundary(episode)
        finally:
            episode.in_step = False
            episode.stopped.set()
            self.changes.notify()

    async def _boundary(self, episode: Episode) -> None:
        while not self.accepting:  # park here until resume (and through any new checkpoint)
            episode.parked = True
            self.changes.notify()
            await self.opened.wait()
        episode.parked = False

    # ---- participant interface
    async def close_admission(self, request: CheckpointRequest) -> None:
        self.accepting = False
        self.opened = anyio.Event()

    async def open_admission(self) -> None:
        self.accepting = True
        self.awaiting_resume = False
        self.opened.set()

    def readiness(self) -> PrepareReport:
        live = [e for e in self.episodes.values() if e.state != "finished"]
        blockers = [e.episode_id.capture_key for e in live if not self.accepting and e.in_step]
        return build_report(
            blockers,
            counts={"episodes": len(live), "parked": sum(e.parked for e in live)},
        )

    async def export(self, episode_ids: Sequence[EpisodeId] | None) -> list[Record]:
        wanted = None if episode_ids is None else {e.capture_key for e in episode_ids}
        records: list[Record] = []
        for key, episode in sorted(self.episodes.items()):
            if episode.state != "finished" and (wanted is None or key in wanted):
                records.append(
                    {
                        "episode_id": episode.episode_id.model_dump(),
                        "step": episode.step,
                        "target": episode.target,
                    }
                )
        for key, record in sorted(self.restored.items()):
            if wanted is None or key in wanted:
                records.append(record)
        return records

    async def install(self, records: Sequence[Record], scope: Sequence[EpisodeId]) -> None:
        if self.episodes or self.restored:
            raise CheckpointError("restore requires a process without live episodes")
        for record in records:  # every record is checked before any is installed
            step, target = record.get("step"), record.get("target")
            if not (isinstance(step, int) and isinstance(target, int) and 0 <= step <= target):
                raise CheckpointError(f"invalid counter record {record!r}")
        for record in records:
            replacement = EpisodeId.model_validate(record["episode_id"]).next_attempt()
            self.restored[replacement.capture_key] = {
                **record,
                "episode_id": replacement.model_dump(),
            }
        self.awaiting_resume = True

    def served_live_work(self) -> bool:
        return self.served

    def restored_pending(self) -> list[EpisodeId]:
        return [EpisodeId.from_capture_key(key) for key in sorted(self.restored)]

    async def delete_restored(self, episode_id: EpisodeId) -> None:
        self.restored.pop(episode_id.capture_key, None)

    async def retire(self, episode_id: EpisodeId) -> None:
        for key, episode in list(self.episodes.items()):
            if episode_id.covers(episode.episode_id):
                episode.scope.cancel()
                await episode.stopped.wait()
                self.episodes.pop(key, None)
        for key in list(self.restored):
            if episode_id.covers(EpisodeId.from_capture_key(key)):
                del self.restored[key]
        self.changes.notify()

    def status_extra(self) -> dict[str, Any]:
        return {"restored_pending": sorted(self.restored), "accepting": self.accepting}


class StartBody(BaseModel):
    """Body of ``start``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    target: int = Field(ge=0, le=1_000_000)


def build_app(participant: CounterParticipant, token: str | None) -> FastAPI:
    """The example server: the control plane plus the counter data routes."""

    @asynccontextmanager
    async def episodes_running(_app: FastAPI) -> AsyncIterator[None]:
        async with anyio.create_task_group() as group:
            participant.task_group = group
            yield
            group.cancel_scope.cancel()

    plane = ControlPlane(participant)
    app = participant_app(
        plane, token=token, title="midflight minimal participant", lifespan=episodes_running
    )

    @app.post("/ng-rollout/{capture_key}/start")
    async def start(capture_key: str, body: StartBody) -> dict[str, Any]:
        """Start an episode, or continue the restored one of this attempt."""
        episode = await participant.start(EpisodeId.from_capture_key(capture_key), body.target)
        return {"step": episode.step, "state": episode.state}

    @app.get("/ng-rollout/{capture_key}")
    async def show(capture_key: str) -> dict[str, Any]:
        """Where an episode is."""
        episode_id = EpisodeId.from_capture_key(capture_key)
        participant.marks.check(episode_id)
        episode = participant.episodes.get(episode_id.capture_key)
        if episode is None:
            raise CheckpointError(f"no episode {episode_id.capture_key}")
        return {"step": episode.step, "target": episode.target, "state": episode.state}

    return app


def main(argv: list[str] | None = None) -> None:
    """Serve the example on 127.0.0.1; prints ``listening on <url>`` once bound."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8710, help="0 picks a free port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--tick-ms", type=float, default=50.0)
    parser.add_argument("--instance", default="example")
    args = parser.parse_args(argv)
    token = os.environ.get("MIDFLIGHT_CONTROL_TOKEN") or None
    participant = CounterParticipant(args.instance, tick_seconds=args.tick_ms / 1000)
    app = build_app(participant, token)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(2048)  # listening before we announce the port: a client may connect at once
    print(f"listening on http://{args.host}:{sock.getsockname()[1]}", flush=True)
    if token is None:
        print("MIDFLIGHT_CONTROL_TOKEN is not set: checkpointing is off", file=sys.stderr)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
