"""The drill controller sends a commit, a retire or a resume again when it ran out of time, and
only then (D388, D390, D395).

With thousands of episodes to park, a prepare can take most of the checkpoint's deadline, and
the commit is then refused with ``deadline_exceeded`` while the participants go on writing. The
error table says to retry with the same id: the retry finds the write under way and waits for it
instead of exporting again. These tests drive the real driver against real control planes
(``tests/coordinator/deployment.py``) whose export takes longer than the deadline.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

import coordinator._client as client_module
import e2e._drill.control as control_module
import e2e._drill.driver as driver_module
from coordinator import CoordinationError
from e2e._drill.control import OUT_OF_TIME_SENDS
from e2e._drill.driver import Driver
from e2e._drill.plan import DriverPlan
from e2e._servers.cluster import default_cluster
from e2e._servers.evidence import read_evidence
from participants import Record
from protocols import EpisodeId, InvalidPhaseError, Phase
from tests.coordinator.deployment import Deployment, deployment

pytestmark = pytest.mark.anyio

SHAPE = (("environment", "environment"), ("resources", "resources"))


def _driver(tmp_path: Path, d: Deployment) -> Driver:
    plan = DriverPlan(
        rollouts=["r1"], task_input={}, phase=0, checkpoints=1, crash_after=False, commit_delay_s=0
    )
    driver = Driver(tmp_path, default_cluster(tmp_path), plan, "token")
    driver.control._coordinator = d.coordinator  # the real coordinator over in-process planes
    driver.in_flight = {"r1": 0}
    return driver


def _slow_environment(d: Deployment, seconds: float) -> list[str]:
    """Make the environment's export take ``seconds``, longer than the deadline; its calls."""
    fake = d.fakes["environment"]
    fake.episodes = [EpisodeId(rollout_id="r1")]
    calls: list[str] = []
    export = fake.export

    async def slow(episode_ids: Sequence[EpisodeId] | None) -> list[Record]:
        calls.append("export")
        await anyio.sleep(seconds)
        return await export(episode_ids)

    fake.export = slow  # type: ignore[method-assign]
    return calls


def _events(driver: Driver, name: str) -> list[dict[str, Any]]:
    return [e for e in read_evidence(driver.evidence.path) if e["event"] == name]


async def test_a_commit_out_of_time_is_sent_again_and_published_from_one_export(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(driver_module, "DEADLINE_SECONDS", 0.6)
    async with deployment(SHAPE) as d:
        slow = _slow_environment(d, 1.2)
        driver = _driver(tmp_path, d)
        try:
            assert await driver.checkpoint(0)
        finally:
            await driver.http.aclose()
        retried = _events(driver, "commit_retried")
        assert 1 <= len(retried) < OUT_OF_TIME_SENDS
        assert retried[0]["id"] == "ckpt-0-0" and retried[0]["refused"] == ["environment"]
        assert slow == ["export"]  # the retry waited for the first export's write
        published = _events(driver, "checkpoint")
        assert [e["continued"] for e in published] == [["r1"]]
        assert (tmp_path / "checkpoints" / "ckpt-0-0" / "checkpoint.json").is_file()


async def test_a_commit_still_out_of_time_after_the_last_send_fails_the_controller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(driver_module, "DEADLINE_SECONDS", 0.3)
    async with deployment(SHAPE) as d:
        slow = _slow_environment(d, 0.3 * (OUT_OF_TIME_SENDS + 2))
        driver = _driver(tmp_path, d)
        try:
            with pytest.raises(CoordinationError, match="deadline_exceeded"):
                await driver.checkpoint(0)
        finally:
            await driver.http.aclose()
        assert len(_events(driver, "commit_retried")) == OUT_OF_TIME_SENDS - 1
        assert slow == ["export"]
        assert not (tmp_path / "checkpoints" / "ckpt-0-0" / "checkpoint.json").exists()


async def test_a_commit_refused_for_anything_but_time_is_not_sent_again(
    tmp_path: Path,
) -> None:
    async with deployment(SHAPE) as d:
        d.fakes["environment"].episodes = [EpisodeId(rollout_id="r1")]
        driver = _driver(tmp_path, d)
        sent: list[str] = []
        commit = driver.control.commit

        async def regressed_then_commit(*args: object) -> object:
            # Readiness regressed between prepare and commit (a held response delivered): the
            # participant refuses with invalid_phase, which no fresh deadline can change.
            sent.append(str(args[0]))
            d.fakes["resources"].ready_now = False
            return await commit(*args)  # type: ignore[arg-type]

        driver.control.commit = regressed_then_commit  # type: ignore[method-assign]
        try:
            with pytest.raises(CoordinationError, match="invalid_phase") as caught:
                await driver.checkpoint(0)
        finally:
            await driver.http.aclose()
        assert sent == ["ckpt-0-0"]
        assert isinstance(caught.value.causes["resources"], InvalidPhaseError)
        assert _events(driver, "commit_retried") == []


async def test_a_retire_out_of_time_is_sent_again_and_a_refused_one_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(control_module, "OPERATION_SECONDS", 0.3)
    async with deployment(SHAPE) as d:
        fake = d.fakes["environment"]
        stops: list[str] = []

        async def slow_the_first_time(episode_id: EpisodeId) -> None:
            stops.append(episode_id.capture_key)
            if len(stops) == 1:
                await anyio.sleep(1.0)  # past the first deadline; a retire is idempotent

        fake.retire = slow_the_first_time  # type: ignore[method-assign]
        driver = _driver(tmp_path, d)
        try:
            await driver.control.retire("retire-x", [EpisodeId(rollout_id="r1")])
            assert stops == ["r1", "r1"]
            await d.coordinator.prepare("c1", time.time() + 30)  # a retire is refused now
            sent = len(d.router.requests)
            with pytest.raises(CoordinationError, match="invalid_phase"):
                await driver.control.retire("retire-y", [EpisodeId(rollout_id="r2")])
            retires = [r for r in d.router.requests[sent:] if r.url.path.endswith("/retire")]
            assert len(retires) == len(SHAPE)  # one send to each server, not three
        finally:
            await driver.http.aclose()


async def test_a_resume_out_of_time_is_sent_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D395: at load 10 a worker of the 4,000 drill did not reopen within 30 s, and the
    controller died on a resume that a second send would have finished."""
    monkeypatch.setattr(client_module, "COORDINATION_REPLY_SLACK_SECONDS", 0.2)
    async with deployment(SHAPE) as d:
        fake = d.fakes["environment"]
        opens: list[float] = []
        reopen = fake.open_admission

        async def slow_the_first_time() -> None:
            opens.append(time.monotonic())
            if len(opens) == 1:
                await anyio.sleep(2.0)  # past the first deadline (1 s at least) and the slack
            await reopen()

        fake.open_admission = slow_the_first_time  # type: ignore[method-assign]
        await d.coordinator.prepare("c1", time.time() + 30)
        driver = _driver(tmp_path, d)
        sent = len(d.router.requests)
        try:
            await driver.control.resume("c1", time.time() + 0.3)
        finally:
            await driver.http.aclose()
        resumes = [r.url.host for r in d.router.requests[sent:] if r.url.path.endswith("/resume")]
        assert resumes.count("environment") >= 2  # no reply in time, so sent again
        assert len(opens) == 2  # in one process, the client's timeout cancelled the first
        assert all(plane.phase is Phase.IDLE for plane in d.planes.values())
