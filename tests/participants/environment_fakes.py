"""Scripted agent and resources peers, and a harness around the environment participant, for tests."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskGroup

from participants import Clock, ControlPlane, EnvironmentParticipant, SeededSession
from protocols import CheckpointRequest, CommitRequest, EpisodeId, Phase


@dataclass
class ScriptedPeers:
    """Peers that record every call and can hold any of them until released.

    ``hold("activate")`` makes the next ``activate`` calls wait until ``release("activate")``;
    ``entered[name]`` is set once a call of that name is waiting at its gate. A call whose name
    is in ``refuse`` raises that error once past its gate.
    """

    verify_mode: str = "wait"
    restart: bool = False
    reward: float = 0.42
    calls: list[tuple[str, str, Any]] = field(default_factory=list)
    gates: dict[str, anyio.Event] = field(default_factory=dict)
    entered: dict[str, anyio.Event] = field(default_factory=dict)
    refuse: dict[str, Exception] = field(default_factory=dict)
    sessions: int = 0

    def hold(self, name: str) -> None:
        self.gates[name] = anyio.Event()
        self.entered[name] = anyio.Event()

    def release(self, name: str) -> None:
        self.gates.pop(name).set()

    async def _gate(self, name: str, key: str, arg: Any) -> None:
        self.calls.append((name, key, arg))
        gate = self.gates.get(name)
        if gate is not None:
            self.entered[name].set()
            await gate.wait()
        if name in self.refuse:
            raise self.refuse[name]

    def names(self, key: str | None = None) -> list[str]:
        return [name for name, k, _ in self.calls if key is None or k == key]

    async def seed_resources(self, key: str, task_input: dict[str, Any]) -> SeededSession:
        self.sessions += 1
        session_id = f"s{self.sessions}"
        await self._gate("seed_resources", key, task_input)
        return SeededSession(
            session_id, "replay" if self.verify_mode == "replay" else "wait", self.restart
        )

    async def seed_agent(
        self, key: str, resources_session_id: str, task_input: dict[str, Any]
    ) -> None:
        await self._gate("seed_agent", key, resources_session_id)

    async def activate(self, key: str, activation: int) -> dict[str, Any]:
        await self._gate("activate", key, activation)
        return {"activation": activation, "messages": [], "turns": 2}

    async def verify(self, key: str, resources_session_id: str) -> float:
        await self._gate("verify", key, resources_session_id)
        return self.reward

    async def close(self, key: str, resources_session_id: str | None) -> None:
        await self._gate("close", key, resources_session_id)


def task(rollout_id: str = "r1", activations: int = 2) -> dict[str, Any]:
    return {
        "task_id": {"taskset": "counter", "task_id": rollout_id},
        "task_input": {"activations": activations, "turns": 2, "max_tokens": 32, "seed": 0},
    }


def ep(key: str) -> EpisodeId:
    return EpisodeId.from_capture_key(key)


def soon(seconds: float = 30.0) -> float:
    return time.time() + seconds


@dataclass
class Env:
    participant: EnvironmentParticipant
    plane: ControlPlane
    peers: ScriptedPeers
    group: TaskGroup
    root: Path
    outcomes: dict[str, Any] = field(default_factory=dict)
    done: dict[str, anyio.Event] = field(default_factory=dict)

    def start(self, key: str, the_task: dict[str, Any] | None = None) -> None:
        """Run ``key`` in the background; its outcome (or refusal) lands in ``outcomes``."""
        self.done[key] = anyio.Event()

        async def run() -> None:
            try:
                self.outcomes[key] = await self.participant.run(ep(key), the_task or task())
            except Exception as exc:
                self.outcomes[key] = exc
            self.done[key].set()

        self.group.start_soon(run)

    async def outcome(self, key: str) -> Any:
        with anyio.fail_after(10):
            await self.done[key].wait()
        return self.outcomes[key]

    async def prepare(self, cid: str, seconds: float = 30.0) -> Phase:
        reply = await self.plane.prepare(
            CheckpointRequest(checkpoint_id=cid, deadline_ts=soon(seconds))
        )
        return reply.phase

    async def commit(self, cid: str, scope: list[str] | None) -> list[dict[str, Any]]:
        episode_ids = None if scope is None else [ep(k) for k in scope]
        await self.plane.commit(
            CommitRequest(
                checkpoint_id=cid,
                deadline_ts=soon(),
                checkpoint_dir=str(self.root / cid),
                episode_ids=episode_ids,
            )
        )
        return await self.participant.export(episode_ids)

    async def resume(self, cid: str) -> None:
        await self.plane.resume(CheckpointRequest(checkpoint_id=cid, deadline_ts=soon()))


@asynccontextmanager
async def environment(
    root: Path,
    peers: ScriptedPeers | None = None,
    *,
    episode_seconds: float | None = None,
    clock: Clock | None = None,
) -> AsyncIterator[Env]:
    scripted = peers or ScriptedPeers()
    participant = EnvironmentParticipant(
        "environment", scripted, episode_seconds=episode_seconds, clock=clock
    )
    plane = ControlPlane(participant)
    async with plane.running(), participant.serving(), anyio.create_task_group() as group:
        yield Env(participant, plane, scripted, group, root)
        group.cancel_scope.cancel()


async def settle() -> None:
    await anyio.wait_all_tasks_blocked()
