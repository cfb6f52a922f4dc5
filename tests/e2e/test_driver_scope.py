"""The drill controller's commit scope: attempts in flight, and restored attempts it still owes.

A restored attempt whose ``/run`` has not started yet must still be named in every commit (by its
replacement attempt), or the commit deletes its restored state (control-plane §5, step 5) and the
attempt then runs from its input again, repeating model calls. D192.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from coordinator import PrepareResult
from e2e._cluster import default_cluster
from e2e._driver import Driver, DriverPlan
from protocols import EpisodeId

pytestmark = pytest.mark.anyio


class _Commit:
    def __init__(self, episodes: list[EpisodeId]) -> None:
        self.episodes = episodes

    def generation_cut_episodes(self) -> list[str]:
        return []

    def environment_episode_ids(self) -> list[str]:
        return [episode.capture_key for episode in self.episodes]


class _Control:
    """Stands in for the control session: records the commit scope, answers like a cluster."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.scopes: list[list[str]] = []

    def checkpoint_dir(self, root: Path, checkpoint_id: str) -> Path:
        return root / "checkpoints" / checkpoint_id

    async def prepare(self, checkpoint_id: str, deadline: float) -> PrepareResult:
        return PrepareResult(prepared=True, replies={})

    async def commit(self, *args: Any) -> _Commit:
        episodes: list[EpisodeId] = list(args[-1])
        self.scopes.append([episode.capture_key for episode in episodes])
        return _Commit(episodes)

    async def publish(self, *args: Any) -> None:
        return None

    async def resume(self, *args: Any) -> None:
        return None


async def test_a_commit_names_restored_attempts_that_have_not_started(tmp_path: Path) -> None:
    plan = DriverPlan(
        rollouts=["r1", "r2"],
        task_input={},
        phase=1,
        checkpoints=1,
        crash_after=False,
        commit_delay_s=0.0,
    )
    driver = Driver(tmp_path, default_cluster(tmp_path), plan, "token")
    control = _Control(tmp_path)
    driver.control = control  # type: ignore[assignment]
    try:
        driver.owed = {"r1": 1}  # restored as r1-a1; its /run is not sent yet
        driver.in_flight = {"r2": 0}
        assert await driver.checkpoint(0)
        assert control.scopes == [["r1-a1", "r2"]]
    finally:
        await driver.http.aclose()
