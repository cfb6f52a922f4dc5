"""``checkpoint(commit_sends=…)``: a commit refused for time alone is sent again (D392).

With thousands of episodes to park, a prepare can take most of the deadline, and the commit is
then refused with ``deadline_exceeded`` while the participants go on writing. A caller that
asks for more than one send gets the same commit again with a fresh deadline: it finds the write
under way and waits for it instead of exporting again. These tests run the library's
``checkpoint`` against real control planes (``deployment.py``) whose export outlives the
deadline.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from coordinator import CoordinationError, checkpoint, read_latest
from participants import Record
from protocols import DeadlineExceededError, EpisodeId, InvalidPhaseError, Phase

from .deployment import Deployment, deployment

pytestmark = pytest.mark.anyio
R1 = EpisodeId(rollout_id="r1")
SHAPE = (("environment", "environment"), ("resources", "resources"))


def _slow_environment(d: Deployment, seconds: float) -> list[str]:
    """Make the environment's export take ``seconds``, longer than the deadline; its calls."""
    for fake in d.fakes.values():
        fake.episodes = [R1]
    calls: list[str] = []
    export = d.fakes["environment"].export

    async def slow(episode_ids: Sequence[EpisodeId] | None) -> list[Record]:
        calls.append("export")
        await anyio.sleep(seconds)
        return await export(episode_ids)

    d.fakes["environment"].export = slow  # type: ignore[method-assign]
    return calls


def _count_sends(d: Deployment) -> list[str]:
    """Every ``Coordinator.commit`` the checkpoint sends, by checkpoint id."""
    sent: list[str] = []
    commit = d.coordinator.commit

    async def counted(*args: Any, **kwargs: Any) -> Any:
        sent.append(str(args[0]))
        return await commit(*args, **kwargs)

    d.coordinator.commit = counted  # type: ignore[method-assign]
    return sent


@pytest.mark.parametrize("episodes", [None, [R1]], ids=["environment-first", "scope-given"])
async def test_a_commit_out_of_time_is_sent_again_and_published_from_one_export(
    tmp_path: Path, episodes: list[EpisodeId] | None
) -> None:
    async with deployment(SHAPE) as d:
        exports = _slow_environment(d, 1.2)
        sent = _count_sends(d)
        outcome = await checkpoint(
            d.coordinator, tmp_path, "c1", deadline_seconds=0.6, episodes=episodes, commit_sends=4
        )
        assert outcome.published and outcome.manifest is not None
        assert outcome.manifest.continued == [R1]
        assert 1 <= outcome.commits_resent < 4
        assert len(sent) == outcome.commits_resent + (2 if episodes is None else 1)
        assert exports == ["export"]  # each send after the first waited for the first's write
        latest = read_latest(tmp_path)
        assert latest is not None and latest.checkpoint_id == "c1"
        assert all(plane.phase is Phase.IDLE for plane in d.planes.values())


async def test_by_default_a_commit_out_of_time_aborts_the_checkpoint(tmp_path: Path) -> None:
    async with deployment(SHAPE) as d:
        exports = _slow_environment(d, 1.2)
        sent = _count_sends(d)
        with pytest.raises(CoordinationError, match="deadline_exceeded") as caught:
            await checkpoint(d.coordinator, tmp_path, "c1", deadline_seconds=0.6)
        assert caught.value.out_of_time
        assert exports == ["export"]
        assert sent == ["c1"]
        assert read_latest(tmp_path) is None
        assert not (tmp_path / "checkpoints" / "c1" / "checkpoint.json").exists()


async def test_a_commit_still_out_of_time_after_the_last_send_is_raised(tmp_path: Path) -> None:
    async with deployment(SHAPE) as d:
        exports = _slow_environment(d, 0.3 * 5)
        sent = _count_sends(d)
        with pytest.raises(CoordinationError, match="deadline_exceeded"):
            await checkpoint(d.coordinator, tmp_path, "c1", deadline_seconds=0.3, commit_sends=3)
        assert sent == ["c1"] * 3  # the environment's commit, three times
        assert exports == ["export"]  # and one export: each send waited for the first's write
        assert read_latest(tmp_path) is None


async def test_a_commit_refused_for_anything_but_time_is_sent_once(tmp_path: Path) -> None:
    async with deployment(SHAPE) as d:
        for fake in d.fakes.values():
            fake.episodes = [R1]
        sent = _count_sends(d)
        # Readiness regresses between prepare and commit (a held response delivered): the
        # participant refuses with invalid_phase, which no fresh deadline changes.
        prepare = d.coordinator.prepare

        async def then_regress(*args: Any, **kwargs: Any) -> Any:
            result = await prepare(*args, **kwargs)
            d.fakes["resources"].ready_now = False
            return result

        d.coordinator.prepare = then_regress  # type: ignore[method-assign]
        with pytest.raises(CoordinationError, match="invalid_phase") as caught:
            await checkpoint(
                d.coordinator, tmp_path, "c1", deadline_seconds=30, episodes=[R1], commit_sends=3
            )
        assert sent == ["c1"]
        assert isinstance(caught.value.causes["resources"], InvalidPhaseError)
        assert not caught.value.out_of_time


async def test_commit_sends_below_one_is_refused_before_anything_is_sent(tmp_path: Path) -> None:
    async with deployment(SHAPE) as d:
        with pytest.raises(ValueError, match="commit_sends must be at least 1"):
            await checkpoint(d.coordinator, tmp_path, "c1", deadline_seconds=30, commit_sends=0)
        assert d.log == []


def test_only_running_out_of_time_on_every_failing_participant_counts_as_out_of_time() -> None:
    late = DeadlineExceededError("the deadline passed during the write")
    other = InvalidPhaseError("no longer ready to commit")
    assert CoordinationError("commit", {"a": "x"}, {"a": late}).out_of_time
    both = CoordinationError("commit", {"a": "x", "b": "y"}, {"a": late, "b": other})
    assert not both.out_of_time
    assert not CoordinationError("commit", {}, {}).out_of_time
    # A reply that did not come within the deadline and the client's slack is out of time too.
    silent = TimeoutError("control POST /retire to http://agent got no reply within 5.00 s")
    assert CoordinationError("retire", {"a": "x", "b": "y"}, {"a": late, "b": silent}).out_of_time
    assert not CoordinationError("retire", {"a": "x"}, {"a": ValueError("bad")}).out_of_time
