"""The coordinator's named boundaries: where a test harness may kill the controller."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from coordinator import (
    CHECKPOINT_FILE,
    LATEST_FILE,
    Coordinator,
    checkpoint_directory,
    publish_checkpoint,
)
from protocols import EpisodeId

from .deployment import deployment

pytestmark = pytest.mark.anyio
R1 = EpisodeId(rollout_id="r1")


class Stop(Exception):
    """The harness's kill, in-process: stop right at the boundary."""


async def test_each_boundary_is_passed_after_the_first_stage_and_before_the_rest() -> None:
    seen: list[tuple[str, list[str]]] = []
    async with deployment() as d:
        log = d.log

        async def hook(boundary: str) -> None:
            seen.append((boundary, [f"{name}:{op}" for name, op, _ in log]))

        coordinator = Coordinator(d.coordinator.members, on_boundary=hook)
        assert (await coordinator.prepare("c1", time.time() + 30)).prepared
        await coordinator.resume("c1", time.time() + 30)
        await coordinator.retire("t1", time.time() + 30, [R1])
    names = [boundary for boundary, _ in seen]
    assert names == ["some-prepared", "prepare-sent", "resume-partly-sent", "retire-partly-applied"]
    at = dict(seen)
    # some-prepared: only the first stage (environment) was closed, the others not asked yet.
    assert [e for e in at["some-prepared"] if e.endswith(":close")] == ["environment:close"]
    assert len([e for e in at["prepare-sent"] if e.endswith(":close")]) == 5
    # resume walks the stages backwards: only the resources servers reopened so far.
    opened = [e.split(":")[0] for e in at["resume-partly-sent"] if e.endswith(":open")]
    assert sorted(opened) == ["resources", "resources2"]
    # retire: the environment (first group) retired, nobody else yet.
    retired = [e.split(":")[0] for e in at["retire-partly-applied"] if e.endswith(":retire")]
    assert retired == ["environment"]


async def test_a_stop_between_checkpoint_json_and_latest_leaves_latest_alone(
    tmp_path: Path,
) -> None:
    def stop_at_latest(boundary: str) -> None:
        if boundary == "checkpoint-json-written":
            raise Stop

    async with deployment() as d:
        for fake in d.fakes.values():
            fake.episodes = [R1]
        for checkpoint_id, hook in (("c1", None), ("c2", stop_at_latest)):
            directory = str(checkpoint_directory(tmp_path, checkpoint_id))
            assert (await d.coordinator.prepare(checkpoint_id, time.time() + 30)).prepared
            commits = await d.coordinator.commit(checkpoint_id, time.time() + 30, directory, [R1])
            with pytest.raises(Stop) if hook else _nothing():
                await publish_checkpoint(
                    tmp_path,
                    checkpoint_id,
                    d.coordinator.members,
                    commits,
                    [R1],
                    None,
                    on_boundary=hook,
                )
            await d.coordinator.resume(checkpoint_id, time.time() + 30)
    assert (checkpoint_directory(tmp_path, "c2") / CHECKPOINT_FILE).exists()
    assert (tmp_path / "checkpoints" / LATEST_FILE).read_text() == "c1"


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_exc: object) -> None:
        return None
