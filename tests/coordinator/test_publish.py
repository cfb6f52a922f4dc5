"""Publication: checkpoint.json after every participant manifest, LATEST only after it.

Most tests run twice, on a directory and on an ``s3://`` root (the local S3 server): the
guarantees are the same on both.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from coordinator import (
    CHECKPOINT_FILE,
    LATEST_FILE,
    Member,
    checkpoint_directory,
    checkpoint_location,
    publish_checkpoint,
    read_checkpoint,
    read_latest,
    verify_checkpoint,
)
from coordinator._publish import publish_checkpoint_sync
from protocols import (
    CommitReply,
    EpisodeId,
    InvalidCheckpointStateError,
    is_object_store_url,
    open_store,
)

from .deployment import deployment

pytestmark = pytest.mark.anyio
R1 = EpisodeId(rollout_id="r1")
LATEST = f"checkpoints/{LATEST_FILE}"


async def committed(
    root: str | Path, checkpoint_ids: Sequence[str], scope: Sequence[EpisodeId] = ()
) -> tuple[list[Member], dict[str, dict[str, CommitReply]]]:
    """Prepare, commit and resume each checkpoint under ``root`` (shares only, nothing published)."""
    commits: dict[str, dict[str, CommitReply]] = {}
    with tempfile.TemporaryDirectory() as mirror:
        s3_mirror = Path(mirror) if is_object_store_url(root) else None
        async with deployment(s3_mirror=s3_mirror) as d:
            for fake in d.fakes.values():
                fake.episodes = [R1]
            for checkpoint_id in checkpoint_ids:
                directory = checkpoint_location(root, checkpoint_id)
                assert (await d.coordinator.prepare(checkpoint_id, time.time() + 30)).prepared
                commits[checkpoint_id] = await d.coordinator.commit(
                    checkpoint_id, time.time() + 30, directory, list(scope)
                )
                await d.coordinator.resume(checkpoint_id, time.time() + 30)
            return list(d.coordinator.members), commits


async def _commit_and_publish(root: str | Path, checkpoint_id: str, state: object) -> None:
    with tempfile.TemporaryDirectory() as mirror:
        s3_mirror = Path(mirror) if is_object_store_url(root) else None
        async with deployment(s3_mirror=s3_mirror) as d:
            for fake in d.fakes.values():
                fake.episodes = [R1]
            d.fakes["policy"].extras = {"staging_keys_by_episode": {"r1": ["k2", "k1"]}}
            directory = checkpoint_location(root, checkpoint_id)
            assert (await d.coordinator.prepare(checkpoint_id, time.time() + 30)).prepared
            commits = await d.coordinator.commit(checkpoint_id, time.time() + 30, directory, [R1])
            await publish_checkpoint(
                root, checkpoint_id, d.coordinator.members, commits, [R1], state
            )
            await d.coordinator.resume(checkpoint_id, time.time() + 30)


async def test_published_checkpoint_reads_back_and_latest_names_it(run_root: str | Path) -> None:
    assert read_latest(run_root) is None
    await _commit_and_publish(run_root, "c1", {"dispatched": ["r1"]})
    latest = read_latest(run_root)
    assert latest is not None and latest.checkpoint_id == "c1"
    assert latest.controller_state == {"dispatched": ["r1"]}
    assert latest.continued == [R1]
    assert latest.staging_keys_by_episode == {"r1": ["k1", "k2"]}
    shares = {(p.kind, p.instance): p for p in latest.participants}
    assert set(shares) == {
        ("environment", "environment"),
        ("model", "policy"),
        ("agent", "agent"),
        ("resources", "resources"),
        ("resources", "resources2"),
    }
    assert shares[("model", "policy")].manifest == "gym/model/policy/manifest.json"
    await _commit_and_publish(run_root, "c2", None)
    assert open_store(run_root).read(LATEST) == b"c2"
    assert read_checkpoint(run_root, "c1").checkpoint_id == "c1"
    assert verify_checkpoint(checkpoint_location(run_root, "c2")) == []


async def test_the_location_is_the_directory_or_the_url(s3_root: str, tmp_path: Path) -> None:
    assert checkpoint_location(tmp_path, "c1") == str(checkpoint_directory(tmp_path, "c1"))
    assert checkpoint_location(s3_root + "/", "c1") == f"{s3_root}/checkpoints/c1"
    for bad in ("s3://midflight/../x", "s3://No_Bucket/x"):
        with pytest.raises(ValueError):
            checkpoint_location(bad, "c1")
    with pytest.raises(ValueError, match="checkpoint_location"):
        checkpoint_directory(s3_root, "c1")  # type: ignore[arg-type]


async def test_nothing_is_published_when_a_participant_did_not_commit(
    run_root: str | Path,
) -> None:
    await _commit_and_publish(run_root, "c1", None)
    members, commits = await committed(run_root, ["c2"])
    store = open_store(run_root)
    partial = dict(commits["c2"])
    del partial["agent"]
    with pytest.raises(InvalidCheckpointStateError, match="agent has no commit reply"):
        await publish_checkpoint(run_root, "c2", members, partial, [], None)
    # a manifest that changed after its commit is refused too
    manifest = "checkpoints/c2/gym/agent/agent/manifest.json"
    store.replace(
        manifest, json.dumps({**json.loads(store.read(manifest)), "record_count": 7}).encode()
    )
    with pytest.raises(InvalidCheckpointStateError, match="agent: the manifest in the store"):
        await publish_checkpoint(run_root, "c2", members, commits["c2"], [], None)
    store.delete([manifest])
    with pytest.raises(InvalidCheckpointStateError, match=r"agent: .*does not exist"):
        await publish_checkpoint(run_root, "c2", members, commits["c2"], [], None)
    assert not store.exists(f"checkpoints/c2/{CHECKPOINT_FILE}")
    latest = read_latest(run_root)
    assert latest is not None and latest.checkpoint_id == "c1"


async def test_reading_refuses_a_tampered_participant_manifest(run_root: str | Path) -> None:
    await _commit_and_publish(run_root, "c1", None)
    store = open_store(run_root)
    manifest = "checkpoints/c1/gym/model/policy/manifest.json"
    store.replace(manifest, store.read(manifest) + b" ")
    with pytest.raises(InvalidCheckpointStateError, match="policy"):
        read_latest(run_root)
    store.replace(LATEST, b"../escape")
    with pytest.raises(InvalidCheckpointStateError):
        read_latest(run_root)


async def test_checkpoint_json_is_durable_before_latest_moves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import protocols._store.durable as durable
    import protocols._store.posix as posix

    await _commit_and_publish(tmp_path, "c0", None)  # LATEST exists: it is replaced, not created
    members, commits = await committed(tmp_path, ["c1"])
    steps: list[str] = []
    real_replace, real_link, real_fsync = os.replace, os.link, os.fsync

    def replace(src: str, dst: Path) -> None:
        steps.append(f"rename {Path(dst).name}")
        real_replace(src, dst)

    def link(src: str, dst: Path) -> None:
        steps.append(f"link {Path(dst).name}")
        real_link(src, dst)

    def fsync(fd: int) -> None:
        steps.append("fsync")
        real_fsync(fd)

    def dir_sync(directory: Path) -> None:
        steps.append(f"dirsync {directory.name}")
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        real_fsync(fd)  # not the patched one: this step is recorded as one dirsync
        os.close(fd)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "link", link)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(durable, "fsync_directory", dir_sync)
    monkeypatch.setattr(posix, "fsync_directory", dir_sync)
    publish_checkpoint_sync(tmp_path, "c1", members, commits["c1"], [], None)
    monkeypatch.undo()
    assert steps == [
        "fsync",
        "link checkpoint.json",  # created once: a second publisher of c1 cannot replace it
        "dirsync c1",
        "fsync",
        "rename LATEST",
        "dirsync checkpoints",
    ]
    assert (tmp_path / "checkpoints" / LATEST_FILE).read_bytes() == b"c1"


class Crash(Exception):
    """Stands for the controller dying at one boundary of publication."""


@pytest.mark.parametrize("fault", [None, "latest-before-manifest"])
@pytest.mark.parametrize("boundary", ["manifests-published", "checkpoint-json-written"])
async def test_a_crash_during_publication_never_leaves_latest_on_a_partial_checkpoint(
    run_root: str | Path, boundary: str, fault: str | None
) -> None:
    await _commit_and_publish(run_root, "c1", None)
    members, commits = await committed(run_root, ["c2"])

    def crash(at: str) -> None:
        if at == boundary:
            raise Crash(f"killed at {at}")

    with pytest.raises(Crash):
        publish_checkpoint_sync(
            run_root, "c2", members, commits["c2"], [], None, fault=fault, on_boundary=crash
        )
    store = open_store(run_root)
    json_written = store.exists(f"checkpoints/c2/{CHECKPOINT_FILE}")
    assert json_written == (boundary == "checkpoint-json-written")
    problems = verify_checkpoint(checkpoint_location(run_root, "c2"))
    assert problems == [] if json_written else "unreadable checkpoint.json" in problems[0]
    if fault is not None and not json_written:
        # The fault moves LATEST first: the crash leaves it on a checkpoint without its manifest.
        assert store.read(LATEST) == b"c2"
        with pytest.raises(InvalidCheckpointStateError, match="c2"):
            read_latest(run_root)
        return
    latest = read_latest(run_root)
    expected = "c2" if fault is not None else "c1"  # with the fault LATEST had moved already
    assert latest is not None and latest.checkpoint_id == expected
    assert verify_checkpoint(checkpoint_location(run_root, expected)) == []


def test_an_unknown_publication_fault_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown publication fault"):
        publish_checkpoint_sync(tmp_path, "c1", [], {}, [], None, fault="nope")
    assert not (tmp_path / "checkpoints").exists()
