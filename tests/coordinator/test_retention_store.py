"""Verify, pin and gc on a directory and on S3, and gc against pins and publications meanwhile (D334).

A ``Spy`` around the real store (the local S3 server, or the directory) lets a test act at one
exact point of a gc run: between its listing and a removal, or halfway through one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import anyio
import pytest

from coordinator import (
    CHECKPOINT_FILE,
    checkpoint_location,
    collect_garbage,
    pin_checkpoint,
    read_checkpoint,
    read_latest,
    unpin_checkpoint,
    verify_checkpoint,
)
from coordinator._publish import publish_checkpoint_sync
from coordinator._retention import OBJECT_TIME_SLACK
from protocols import CheckpointStore, InvalidCheckpointStateError, is_object_store_url, open_store

from .test_publish import LATEST, _commit_and_publish, committed

pytestmark = pytest.mark.anyio


def _nothing(_key: str) -> None:
    return None


class Spy:
    """The real store, with hooks called before each deletion and each replace."""

    def __init__(
        self,
        store: CheckpointStore,
        before_delete: Callable[[str], None] = _nothing,
        before_replace: Callable[[str], None] = _nothing,
    ) -> None:
        self._store = store
        self._before = before_delete
        self._before_replace = before_replace

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def delete(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        for key in keys:
            self._before(key)
        self._store.delete(keys)

    def delete_tree(self, prefix: str) -> None:
        self._before(prefix + "/")
        self._store.delete_tree(prefix)

    def replace(self, key: str, data: bytes) -> None:
        self._before_replace(key)
        self._store.replace(key, data)


def spy_on_retention(monkeypatch: pytest.MonkeyPatch, **hooks: Callable[[str], None]) -> None:
    import coordinator._retention as retention

    monkeypatch.setattr(retention, "open_store", lambda root: Spy(open_store(root), **hooks))


async def test_verify_names_a_tampered_records_object_and_a_missing_manifest(
    run_root: str | Path,
) -> None:
    await _commit_and_publish(run_root, "c1", None)
    store = open_store(run_root)
    location = checkpoint_location(run_root, "c1")
    assert verify_checkpoint(location) == []
    (records,) = [
        o.key for o in store.list_objects("checkpoints/c1/gym/agent") if "records-" in o.key
    ]
    original = store.read(records)
    store.replace(records, original[:-2] + b"X\n")
    (problem,) = verify_checkpoint(location)
    assert problem.startswith(store.describe(records)) and "sha256" in problem
    store.replace(records, original)
    manifest = "checkpoints/c1/gym/model/policy/manifest.json"
    store.delete([manifest])
    (problem,) = verify_checkpoint(location)
    assert problem.startswith(store.describe(manifest)) and "missing manifest of policy" in problem
    store.delete([f"checkpoints/c1/{CHECKPOINT_FILE}"])
    (problem,) = verify_checkpoint(location)
    assert "unreadable checkpoint.json" in problem


def test_verify_refuses_a_malformed_url() -> None:
    with pytest.raises(ValueError, match="bucket"):
        verify_checkpoint("s3://Not_A_Bucket/checkpoints/c1")


async def test_gc_removes_an_old_partial_commit_and_keeps_one_under_way(
    run_root: str | Path,
) -> None:
    await committed(run_root, ["old"])  # its shares, never published
    if is_object_store_url(run_root):  # older than c1 by more than S3's second-rounded clock
        await anyio.sleep(OBJECT_TIME_SLACK + 0.5)
    await _commit_and_publish(run_root, "c1", None)
    await committed(run_root, ["fresh"])  # a commit under way, newer than c1
    assert read_latest(run_root) is not None
    dry = collect_garbage(run_root, keep=1, dry_run=True)
    assert dry.removed == ["old"] and dry.partial == ["old"] and dry.bytes_reclaimed > 0
    report = collect_garbage(run_root, keep=1)
    assert report.removed == ["old"] and report.bytes_reclaimed == dry.bytes_reclaimed
    store = open_store(run_root)
    assert store.list_objects("checkpoints/old") == []
    assert store.list_objects("checkpoints/fresh")  # kept: it may still be published
    with pytest.raises(InvalidCheckpointStateError):
        read_checkpoint(run_root, "fresh")  # and until it is, every reader ignores it


async def test_pin_and_unpin_on_the_store(run_root: str | Path) -> None:
    for checkpoint_id in ("c1", "c2"):
        await _commit_and_publish(run_root, checkpoint_id, None)
    marker = pin_checkpoint(run_root, "c1")
    store = open_store(run_root)
    assert str(marker) == store.describe("checkpoints/c1/PINNED")
    assert collect_garbage(run_root, keep=1).protected == ["c1"]
    assert unpin_checkpoint(run_root, "c1") and not unpin_checkpoint(run_root, "c1")
    assert collect_garbage(run_root, keep=1).removed == ["c1"]
    assert store.list_objects("checkpoints/c1") == []
    with pytest.raises(ValueError, match="not a published checkpoint"):
        pin_checkpoint(run_root, "c1")


async def test_gc_rereads_latest_and_the_pins_right_before_each_removal(
    run_root: str | Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    members, commits = await committed(run_root, ["c2"])
    publish_checkpoint_sync(run_root, "c2", members, commits["c2"], [], None)
    for checkpoint_id in ("c1", "c3", "c4"):
        await _commit_and_publish(run_root, checkpoint_id, None)
    # keep=1 dooms c1, c2 and c3; while gc removes the first, c3 is pinned and a retried
    # publication of c2 moves LATEST back to it.
    acted: list[str] = []

    def meanwhile(key: str) -> None:
        if not acted:
            acted.append(key)
            pin_checkpoint(run_root, "c3")
            publish_checkpoint_sync(run_root, "c2", members, commits["c2"], [], None)

    spy_on_retention(monkeypatch, before_delete=meanwhile)
    report = collect_garbage(run_root, keep=1)
    monkeypatch.undo()
    assert acted == [f"checkpoints/c1/{CHECKPOINT_FILE}"]  # checkpoint.json goes first
    assert report.removed == ["c1"]
    assert report.protected == ["c2", "c3"] and set(report.kept) == {"c2", "c3", "c4"}
    latest = read_latest(run_root)
    assert latest is not None and latest.checkpoint_id == "c2"
    for checkpoint_id in ("c2", "c3", "c4"):
        assert verify_checkpoint(checkpoint_location(run_root, checkpoint_id)) == []


async def test_a_pin_written_while_gc_removes_the_checkpoint_fails_and_leaves_no_marker(
    run_root: str | Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for checkpoint_id in ("c1", "c2"):
        await _commit_and_publish(run_root, checkpoint_id, None)

    def gc_first(key: str) -> None:
        if key.endswith("/PINNED"):  # pin checked c1 is published; gc runs before it writes
            assert collect_garbage(run_root, keep=1).removed == ["c1"]

    spy_on_retention(monkeypatch, before_replace=gc_first)
    with pytest.raises(ValueError, match="collected by gc while it was being pinned"):
        pin_checkpoint(run_root, "c1")
    monkeypatch.undo()
    assert open_store(run_root).list_objects("checkpoints/c1") == []  # no marker left behind


class Killed(Exception):
    """gc dying halfway through a removal."""


async def test_a_checkpoint_removed_halfway_reads_as_a_partial_commit(
    run_root: str | Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for checkpoint_id in ("c1", "c2"):
        await _commit_and_publish(run_root, checkpoint_id, None)
    deleted: list[str] = []

    def die_after_the_first(key: str) -> None:
        if deleted:
            raise Killed(f"killed before removing {key}")
        deleted.append(key)

    spy_on_retention(monkeypatch, before_delete=die_after_the_first)
    with pytest.raises(Killed):
        collect_garbage(run_root, keep=1)
    monkeypatch.undo()
    store = open_store(run_root)
    assert not store.exists(f"checkpoints/c1/{CHECKPOINT_FILE}")
    assert store.list_objects("checkpoints/c1/gym")  # the shares are still there
    with pytest.raises(InvalidCheckpointStateError):
        read_checkpoint(run_root, "c1")
    (problem,) = verify_checkpoint(checkpoint_location(run_root, "c1"))
    assert "unreadable checkpoint.json" in problem


async def test_two_gc_runs_and_a_publisher_at_once_keep_latest_and_the_pin(
    run_root: str | Path,
) -> None:
    for checkpoint_id in ("c1", "c2", "c3", "c4"):
        await _commit_and_publish(run_root, checkpoint_id, None)
    pin_checkpoint(run_root, "c2")
    members, commits = await committed(run_root, ["c5"])
    start = threading.Barrier(3, timeout=30)
    failures: list[BaseException] = []

    def gc() -> None:
        start.wait()
        try:
            for _ in range(3):
                collect_garbage(run_root, keep=1)
        except BaseException as exc:  # reported below, with the thread's traceback
            failures.append(exc)

    def publish() -> None:
        start.wait()
        try:
            publish_checkpoint_sync(run_root, "c5", members, commits["c5"], [], None)
        except BaseException as exc:
            failures.append(exc)

    async with anyio.create_task_group() as group:
        for work in (gc, gc, publish):
            group.start_soon(anyio.to_thread.run_sync, work)
    assert failures == []
    latest = read_latest(run_root)
    assert latest is not None and latest.checkpoint_id == "c5"
    collect_garbage(run_root, keep=1)  # once more, now that nothing moves
    store = open_store(run_root)
    assert store.subdirectories("checkpoints") == ["c2", "c5"]
    assert store.read(LATEST) == b"c5"
    for checkpoint_id in ("c2", "c5"):
        assert verify_checkpoint(checkpoint_location(run_root, checkpoint_id)) == []
