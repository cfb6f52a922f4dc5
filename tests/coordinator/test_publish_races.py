"""Two publications that meet in one store: a retry, a taken id, two publishers racing (D332).

Each test runs on a directory and on an ``s3://`` root (the local S3 server): ``checkpoint.json``
is created once (hard link, ``If-None-Match``) and ``LATEST`` is replaced only from the version
read before ``checkpoint.json`` (``flock``, ``If-Match``).
"""

from __future__ import annotations

import threading
from pathlib import Path

import anyio
import pytest

from coordinator import (
    CHECKPOINT_FILE,
    CheckpointManifest,
    CheckpointTakenError,
    LatestMovedError,
    PublicationConflictError,
    checkpoint_location,
    read_checkpoint,
    read_latest,
    verify_checkpoint,
)
from coordinator._publish import publish_checkpoint_sync
from protocols import EpisodeId, open_store

from .test_publish import LATEST, R1, _commit_and_publish, committed

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("before", [None, "c0"])
async def test_of_two_publishers_racing_on_one_root_exactly_one_moves_latest(
    run_root: str | Path, before: str | None
) -> None:
    if before is not None:
        await _commit_and_publish(run_root, before, None)
    members, commits = await committed(run_root, ["a", "b"])
    # Both have read LATEST and written checkpoint.json before either moves LATEST.
    barrier = threading.Barrier(2, timeout=30)
    outcomes: dict[str, CheckpointManifest | LatestMovedError] = {}

    def publish(checkpoint_id: str) -> None:
        def at(boundary: str) -> None:
            if boundary == "checkpoint-json-written":
                barrier.wait()

        try:
            outcomes[checkpoint_id] = publish_checkpoint_sync(
                run_root, checkpoint_id, members, commits[checkpoint_id], [], None, on_boundary=at
            )
        except LatestMovedError as exc:
            outcomes[checkpoint_id] = exc

    async with anyio.create_task_group() as group:
        for checkpoint_id in ("a", "b"):
            group.start_soon(anyio.to_thread.run_sync, publish, checkpoint_id)
    (winner,) = [k for k, v in outcomes.items() if isinstance(v, CheckpointManifest)]
    (loser,) = [k for k, v in outcomes.items() if isinstance(v, LatestMovedError)]
    error = outcomes[loser]
    assert isinstance(error, LatestMovedError)
    assert (error.checkpoint_id, error.latest) == (loser, winner)
    assert "LATEST was not moved" in str(error) and CHECKPOINT_FILE in error.location
    latest = read_latest(run_root)
    assert latest is not None and latest.checkpoint_id == winner
    # The loser stays published, whole, just not LATEST.
    assert read_checkpoint(run_root, loser).checkpoint_id == loser
    for checkpoint_id in ("a", "b"):
        assert verify_checkpoint(checkpoint_location(run_root, checkpoint_id)) == []


async def test_a_retried_publication_keeps_what_the_first_try_wrote(run_root: str | Path) -> None:
    members, commits = await committed(run_root, ["c1"], scope=[R1])

    def killed(boundary: str) -> None:
        if boundary == "checkpoint-json-written":
            raise RuntimeError("controller killed before LATEST")

    with pytest.raises(RuntimeError):
        publish_checkpoint_sync(
            run_root, "c1", members, commits["c1"], [R1], "v1", on_boundary=killed
        )
    store = open_store(run_root)
    first = store.read(f"checkpoints/c1/{CHECKPOINT_FILE}")
    assert not store.exists(LATEST)
    retried = publish_checkpoint_sync(run_root, "c1", members, commits["c1"], [R1], "v2")
    assert retried == CheckpointManifest.model_validate_json(first)  # the first try's, kept
    assert store.read(f"checkpoints/c1/{CHECKPOINT_FILE}") == first
    assert store.read(LATEST) == b"c1"
    again = publish_checkpoint_sync(run_root, "c1", members, commits["c1"], [R1], "v3")
    assert again == retried and store.read(LATEST) == b"c1"


async def test_another_publication_under_a_taken_id_is_refused(run_root: str | Path) -> None:
    await _commit_and_publish(run_root, "c0", None)
    members, commits = await committed(run_root, ["c1"], scope=[R1])
    publish_checkpoint_sync(run_root, "c1", members, commits["c1"], [R1], None)
    store = open_store(run_root)
    before = store.read(f"checkpoints/c1/{CHECKPOINT_FILE}")
    store.replace(LATEST, b"c0")
    other_scope = [EpisodeId(rollout_id="r9")]
    with pytest.raises(CheckpointTakenError, match="already holds another publication") as caught:
        publish_checkpoint_sync(run_root, "c1", members, commits["c1"], other_scope, None)
    assert isinstance(caught.value, PublicationConflictError)
    assert caught.value.location == store.describe(f"checkpoints/c1/{CHECKPOINT_FILE}")
    assert store.read(f"checkpoints/c1/{CHECKPOINT_FILE}") == before
    assert store.read(LATEST) == b"c0"  # nothing moved
