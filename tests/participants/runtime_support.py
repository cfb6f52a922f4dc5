"""Helpers for driving a control plane in-process under a manual clock."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskGroup

from participants import ControlPlane, ControlSettings, ManualClock
from protocols import (
    CheckpointRequest,
    CommitRequest,
    EpisodeId,
    ForgetRequest,
    RestoreRequest,
    RetireRequest,
)

from .fakes import FakeParticipant

NOW = 1_800_000_000.0


@dataclass
class Harness:
    plane: ControlPlane
    fake: FakeParticipant
    clock: ManualClock
    root: Path
    group: TaskGroup
    outcomes: dict[str, Any] = field(default_factory=dict)

    def spawn(self, name: str, work: Callable[[], Awaitable[Any]]) -> None:
        """Run ``work`` in the background; its result or exception lands in ``outcomes``."""

        async def run() -> None:
            try:
                self.outcomes[name] = await work()
            except Exception as exc:
                self.outcomes[name] = exc

        self.group.start_soon(run)

    async def settle(self) -> None:
        """Let every task run until all of them wait for something."""
        for _ in range(3):
            await anyio.wait_all_tasks_blocked()
            await anyio.sleep(0.01)  # threads (the writer) finish and hand back

    def directory(self, name: str = "ckpt") -> str:
        return str(self.root / name)


@asynccontextmanager
async def harness(
    root: Path, on_write_step: Callable[[str], None] | None = None, **settings: Any
) -> AsyncIterator[Harness]:
    clock = ManualClock(NOW)
    fake = FakeParticipant()
    plane = ControlPlane(
        fake, clock=clock, settings=ControlSettings(**settings), on_write_step=on_write_step
    )
    async with plane.running(), anyio.create_task_group() as group:
        yield Harness(plane, fake, clock, root, group)
        group.cancel_scope.cancel()


def ep(rollout_id: str, attempt: int = 0) -> EpisodeId:
    return EpisodeId(rollout_id=rollout_id, attempt=attempt)


def req(checkpoint_id: str = "c1", deadline: float = NOW + 60) -> CheckpointRequest:
    return CheckpointRequest(checkpoint_id=checkpoint_id, deadline_ts=deadline)


def commit_req(
    directory: str,
    scope: list[EpisodeId] | None,
    checkpoint_id: str = "c1",
    deadline: float = NOW + 60,
    stop: bool = False,
) -> CommitRequest:
    return CommitRequest(
        checkpoint_id=checkpoint_id,
        deadline_ts=deadline,
        checkpoint_dir=directory,
        episode_ids=scope,
        stop=stop,
    )


def restore_req(
    directory: str, scope: list[EpisodeId], checkpoint_id: str = "r1", deadline: float = NOW + 60
) -> RestoreRequest:
    return RestoreRequest(
        checkpoint_id=checkpoint_id,
        deadline_ts=deadline,
        checkpoint_dir=directory,
        episode_ids=scope,
    )


def retire_req(episodes: list[EpisodeId], checkpoint_id: str = "retire") -> RetireRequest:
    return RetireRequest(checkpoint_id=checkpoint_id, deadline_ts=NOW + 60, episode_ids=episodes)


def forget_req(rollout_ids: list[str], checkpoint_id: str = "forget") -> ForgetRequest:
    return ForgetRequest(checkpoint_id=checkpoint_id, deadline_ts=NOW + 60, rollout_ids=rollout_ids)
