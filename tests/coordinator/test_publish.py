"""Publication: checkpoint.json after every participant manifest, LATEST only after it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from coordinator import (
    CHECKPOINT_FILE,
    LATEST_FILE,
    checkpoint_directory,
    publish_checkpoint,
    read_checkpoint,
    read_latest,
)
from coordinator._publish import publish_checkpoint_sync
from protocols import EpisodeId, InvalidCheckpointStateError

from .deployment import deployment

pytestmark = pytest.mark.anyio
R1 = EpisodeId(rollout_id="r1")


async def _commit_and_publish(root: Path, checkpoint_id: str, state: object) -> None:
    directory = str(checkpoint_directory(root, checkpoint_id))
    async with deployment() as d:
        for fake in d.fakes.values():
            fake.episodes = [R1]
        d.fakes["policy"].extras = {"staging_keys_by_episode": {"r1": ["k2", "k1"]}}
        assert (await d.coordinator.prepare(checkpoint_id, time.time() + 30)).prepared
        commits = await d.coordinator.commit(checkpoint_id, time.time() + 30, directory, [R1])
        await publish_checkpoint(root, checkpoint_id, d.coordinator.members, commits, [R1], state)
        await d.coordinator.resume(checkpoint_id, time.time() + 30)


async def test_published_checkpoint_reads_back_and_latest_names_it(tmp_path: Path) -> None:
    assert read_latest(tmp_path) is None
    await _commit_and_publish(tmp_path, "c1", {"dispatched": ["r1"]})
    latest = read_latest(tmp_path)
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
    await _commit_and_publish(tmp_path, "c2", None)
    assert (tmp_path / "checkpoints" / LATEST_FILE).read_text() == "c2"
    assert read_checkpoint(tmp_path, "c1").checkpoint_id == "c1"


async def test_nothing_is_published_when_a_participant_did_not_commit(tmp_path: Path) -> None:
    await _commit_and_publish(tmp_path, "c1", None)
    directory = str(checkpoint_directory(tmp_path, "c2"))
    async with deployment() as d:
        await d.coordinator.prepare("c2", time.time() + 30)
        commits = await d.coordinator.commit("c2", time.time() + 30, directory, [])
        del commits["agent"]
        with pytest.raises(InvalidCheckpointStateError):
            await publish_checkpoint(tmp_path, "c2", d.coordinator.members, commits, [], None)
        # a manifest that changed after its commit is refused too
        commits = await d.coordinator.commit("c2", time.time() + 30, directory, [])
        manifest = Path(directory) / "gym/agent/agent/manifest.json"
        manifest.chmod(0o644)
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "record_count": 7}))
        with pytest.raises(InvalidCheckpointStateError):
            await publish_checkpoint(tmp_path, "c2", d.coordinator.members, commits, [], None)
        await d.coordinator.resume("c2", time.time() + 30)
    assert not (Path(directory) / CHECKPOINT_FILE).exists()
    latest = read_latest(tmp_path)
    assert latest is not None and latest.checkpoint_id == "c1"


async def test_reading_refuses_a_tampered_participant_manifest(tmp_path: Path) -> None:
    await _commit_and_publish(tmp_path, "c1", None)
    manifest = checkpoint_directory(tmp_path, "c1") / "gym/model/policy/manifest.json"
    manifest.chmod(0o644)
    manifest.write_bytes(manifest.read_bytes() + b" ")
    with pytest.raises(InvalidCheckpointStateError, match="policy"):
        read_latest(tmp_path)
    (tmp_path / "checkpoints" / LATEST_FILE).write_text("../escape")
    with pytest.raises(InvalidCheckpointStateError):
        read_latest(tmp_path)


async def test_checkpoint_json_is_durable_before_latest_moves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import coordinator._publish as publish

    steps: list[str] = []
    real_replace, real_fsync = publish.os.replace, publish.os.fsync

    def replace(src: str, dst: Path) -> None:
        steps.append(f"rename {Path(dst).name}")
        real_replace(src, dst)

    def fsync(fd: int) -> None:
        steps.append("fsync")
        real_fsync(fd)

    def dir_sync(directory: Path) -> None:
        steps.append(f"dirsync {directory.name}")
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        real_fsync(fd)  # not the patched one: this step is recorded as one dirsync
        os.close(fd)

    directory = str(checkpoint_directory(tmp_path, "c1"))
    async with deployment() as d:
        await d.coordinator.prepare("c1", time.time() + 30)
        commits = await d.coordinator.commit("c1", time.time() + 30, directory, [])
        monkeypatch.setattr(publish.os, "replace", replace)
        monkeypatch.setattr(publish.os, "fsync", fsync)
        monkeypatch.setattr(publish, "_fsync_directory", dir_sync)
        publish.publish_checkpoint_sync(tmp_path, "c1", d.coordinator.members, commits, [], None)
        monkeypatch.undo()
        await d.coordinator.resume("c1", time.time() + 30)
    assert steps == [
        "dirsync checkpoints",
        "fsync",
        "rename checkpoint.json",
        "dirsync c1",
        "fsync",
        "rename LATEST",
        "dirsync checkpoints",
    ]


class Crash(Exception):
    """Stands for the controller dying at one step of publication."""


@pytest.mark.parametrize("fault", [None, "latest-before-manifest"])
@pytest.mark.parametrize("crash_at", [CHECKPOINT_FILE, LATEST_FILE])
async def test_a_crash_during_publication_never_leaves_latest_on_a_partial_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, crash_at: str, fault: str | None
) -> None:
    import coordinator._publish as publish

    await _commit_and_publish(tmp_path, "c1", None)
    real = publish._replace_durably

    def crashing(path: Path, data: bytes) -> None:
        if path.name == crash_at:
            raise Crash(f"killed before {crash_at} was written")
        real(path, data)

    directory = str(checkpoint_directory(tmp_path, "c2"))
    async with deployment() as d:
        await d.coordinator.prepare("c2", time.time() + 30)
        commits = await d.coordinator.commit("c2", time.time() + 30, directory, [])
        monkeypatch.setattr(publish, "_replace_durably", crashing)
        with pytest.raises(Crash):
            publish.publish_checkpoint_sync(
                tmp_path, "c2", d.coordinator.members, commits, [], None, fault=fault
            )
        monkeypatch.undo()
        await d.coordinator.resume("c2", time.time() + 30)
    if fault is not None and crash_at == CHECKPOINT_FILE:
        # The fault moves LATEST first: the crash leaves it on a checkpoint without its manifest.
        with pytest.raises(InvalidCheckpointStateError, match="c2"):
            read_latest(tmp_path)
        return
    latest = read_latest(tmp_path)
    assert latest is not None and latest.checkpoint_id == "c1"


def test_an_unknown_publication_fault_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown publication fault"):
        publish_checkpoint_sync(tmp_path, "c1", [], {}, [], None, fault="nope")
    assert not (tmp_path / "checkpoints").exists()
