"""The high-level checkpoint: prepare, commit, publish, resume; blockers handed back."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from coordinator import CoordinationError, checkpoint, read_latest, verify_checkpoint
from participants import Record
from protocols import CheckpointError, EpisodeId, Phase, open_store

from .deployment import deployment
from .s3_participants import S3Shares

pytestmark = pytest.mark.anyio
R1, R2, R3 = (EpisodeId(rollout_id=r) for r in ("r1", "r2", "r3"))


async def test_checkpoint_publishes_the_continued_scope_and_resumes_everyone(
    tmp_path: Path,
) -> None:
    async with deployment() as d:
        for fake in d.fakes.values():
            fake.episodes = [R1, R2, R3]
        d.fakes["agent"].restarts = [R2.capture_key]
        outcome = await checkpoint(
            d.coordinator,
            tmp_path,
            "c1",
            deadline_seconds=30,
            episodes=[R1, R2, R3],
            controller_state={"step": 7},
        )
        assert outcome.published and outcome.manifest is not None
        assert outcome.manifest.continued == [R1, R3]
        assert outcome.prepare.restarts() == {R2}
        for name, plane in d.planes.items():
            assert plane.phase is Phase.IDLE, name
        # the reverse order: resources reopen first, the environment last
        assert d.ops("open")[-1] == "environment"
    latest = read_latest(tmp_path)
    assert latest is not None and latest.checkpoint_id == "c1"
    assert latest.controller_state == {"step": 7}


async def test_without_a_scope_the_environment_export_minus_restarts_is_continued(
    tmp_path: Path,
) -> None:
    async with deployment() as d:
        for fake in d.fakes.values():
            fake.episodes = [R1, R2]
        d.fakes["policy"].restarts = [R1.capture_key]
        outcome = await checkpoint(d.coordinator, tmp_path, "c1", deadline_seconds=30)
        assert outcome.manifest is not None and outcome.manifest.continued == [R2]


async def test_without_a_scope_a_model_that_needs_one_gets_the_environment_export(
    tmp_path: Path,
) -> None:
    async with deployment() as d:
        for fake in d.fakes.values():
            fake.episodes = [R1, R2, R3]
        d.fakes["environment"].episodes = [R1, R2]  # R3 is not in flight any more
        d.fakes["agent"].restarts = [R2.capture_key]
        scopes: list[list[EpisodeId]] = []

        async def like_the_model(episode_ids: Sequence[EpisodeId] | None) -> list[Record]:
            if episode_ids is None:  # as participants/_model/participant.py refuses it
                raise CheckpointError("a model commit needs the episode_ids")
            scopes.append(list(episode_ids))
            return [{"episode_id": e.model_dump()} for e in episode_ids]

        d.fakes["policy"].export = like_the_model  # type: ignore[method-assign]
        outcome = await checkpoint(d.coordinator, tmp_path, "c1", deadline_seconds=30)
        assert outcome.manifest is not None and outcome.manifest.continued == [R1]
        assert scopes == [[R1]]
        # idle: nothing exported, nothing continued, still published
        d.fakes["environment"].episodes = []
        d.fakes["agent"].restarts = []
        outcome = await checkpoint(d.coordinator, tmp_path, "c2", deadline_seconds=30)
        assert outcome.manifest is not None and outcome.manifest.continued == []
        assert scopes[-1] == []


async def test_blockers_come_back_after_everyone_resumed_and_nothing_is_published(
    tmp_path: Path,
) -> None:
    async with deployment() as d:
        d.fakes["agent"].ready_now = False
        d.fakes["agent"].blockers = [R1.capture_key, "worker:lost"]
        outcome = await checkpoint(d.coordinator, tmp_path, "c1", deadline_seconds=0.5)
        assert not outcome.published
        assert outcome.prepare.blockers() == {"agent": [R1.capture_key, "worker:lost"]}
        assert outcome.blocking_episodes() == [R1]
        for name, plane in d.planes.items():
            assert plane.phase is Phase.IDLE, name
        assert "commit" not in {op for _, op, _ in d.log}
    assert read_latest(tmp_path) is None
    assert not (tmp_path / "checkpoints" / "c1" / "checkpoint.json").exists()


async def test_a_failed_commit_resumes_everyone_and_raises(tmp_path: Path) -> None:
    async with deployment() as d:

        async def broken(episode_ids: object) -> list[object]:
            raise CheckpointError("disk full")

        d.fakes["policy"].export = broken  # type: ignore[method-assign,assignment]
        with pytest.raises(CoordinationError) as caught:
            await checkpoint(d.coordinator, tmp_path, "c1", deadline_seconds=30)
        assert caught.value.operation == "commit" and set(caught.value.failures) == {"policy"}
        # each failing server is listed with its wire code and detail
        assert "policy: checkpoint_error:" in str(caught.value)
        for name, plane in d.planes.items():
            assert plane.phase is Phase.IDLE, name
    assert read_latest(tmp_path) is None
    # the shares the others committed went with it: nothing under checkpoints/ looks like one
    assert not (tmp_path / "checkpoints" / "c1").exists()


async def test_a_failed_commit_never_removes_a_published_checkpoint(tmp_path: Path) -> None:
    async with deployment() as d:
        outcome = await checkpoint(d.coordinator, tmp_path, "c1", deadline_seconds=30)
        assert outcome.published

        async def broken(episode_ids: object) -> list[object]:
            raise CheckpointError("disk full")

        d.fakes["policy"].export = broken  # type: ignore[method-assign,assignment]
        with pytest.raises(CoordinationError):
            await checkpoint(d.coordinator, tmp_path, "c2", deadline_seconds=30)
    assert (tmp_path / "checkpoints" / "c1" / "checkpoint.json").exists()
    assert not (tmp_path / "checkpoints" / "c2").exists()
    assert verify_checkpoint(tmp_path / "checkpoints" / "c1") == []


async def test_on_an_s3_root_the_participants_get_its_url_and_a_failure_leaves_nothing(
    s3_root: str, tmp_path: Path
) -> None:
    async with deployment(s3_mirror=tmp_path) as d:
        for fake in d.fakes.values():
            fake.episodes = [R1]
        outcome = await checkpoint(d.coordinator, s3_root, "c1", deadline_seconds=30)
        assert outcome.published

        async def broken(episode_ids: object) -> list[object]:
            raise CheckpointError("disk full")

        d.fakes["policy"].export = broken  # type: ignore[method-assign,assignment]
        with pytest.raises(CoordinationError):
            await checkpoint(d.coordinator, s3_root, "c2", deadline_seconds=30)
    app = d.router.apps["agent"].app
    assert isinstance(app, S3Shares)
    assert app.locations == [f"{s3_root}/checkpoints/c1", f"{s3_root}/checkpoints/c2"]
    latest = read_latest(s3_root)
    assert latest is not None and latest.checkpoint_id == "c1" and latest.continued == [R1]
    assert verify_checkpoint(f"{s3_root}/checkpoints/c1") == []
    # the shares the others committed to c2 went with it
    assert open_store(s3_root).list_objects("checkpoints/c2") == []
