"""Verify, pin and gc of published checkpoints."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from coordinator import (
    CHECKPOINT_FILE,
    LATEST_FILE,
    checkpoint_directory,
    collect_garbage,
    pin_checkpoint,
    unpin_checkpoint,
    verify_checkpoint,
)
from coordinator._retention import PINNED_FILE

from .test_publish import _commit_and_publish

pytestmark = pytest.mark.anyio


def _records_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("gym/*/*/records-*.jsonl"))


def _snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"<dir>"
        for p in sorted(root.rglob("*"))
    }


async def test_an_intact_checkpoint_verifies_clean(tmp_path: Path) -> None:
    await _commit_and_publish(tmp_path, "c1", None)
    assert verify_checkpoint(checkpoint_directory(tmp_path, "c1")) == []


async def test_verify_detects_one_flipped_byte_in_every_records_file(tmp_path: Path) -> None:
    await _commit_and_publish(tmp_path, "c1", None)
    directory = checkpoint_directory(tmp_path, "c1")
    files = _records_files(directory)
    assert len(files) == 5  # one per participant of the deployment
    for records in files:
        original = records.read_bytes()
        records.chmod(0o644)
        flipped = bytearray(original)
        flipped[len(flipped) // 2] ^= 0x01
        records.write_bytes(bytes(flipped))
        problems = verify_checkpoint(directory)
        assert len(problems) == 1 and str(records) in problems[0] and "sha256" in problems[0]
        records.write_bytes(original)
    assert verify_checkpoint(directory) == []


async def test_verify_detects_a_wrong_count_a_missing_manifest_and_a_missing_json(
    tmp_path: Path,
) -> None:
    await _commit_and_publish(tmp_path, "c1", None)
    directory = checkpoint_directory(tmp_path, "c1")
    records = _records_files(directory)[0]
    records.chmod(0o644)
    data = records.read_bytes()
    records.write_bytes(data + data)  # two copies: count and digest both wrong
    problems = verify_checkpoint(directory)
    assert any("2 records but its manifest records 1" in p for p in problems)
    records.write_bytes(data)
    manifest = directory / "gym/agent/agent/manifest.json"
    manifest.unlink()
    (problem,) = verify_checkpoint(directory)
    assert "missing manifest of agent" in problem
    (directory / CHECKPOINT_FILE).unlink()
    (problem,) = verify_checkpoint(directory)
    assert "unreadable checkpoint.json" in problem


async def test_gc_dry_run_changes_nothing_and_gc_keeps_latest_and_pins(tmp_path: Path) -> None:
    for checkpoint_id in ("c1", "c2", "c3", "c4"):
        await _commit_and_publish(tmp_path, checkpoint_id, None)
    pin_checkpoint(tmp_path, "c1")
    # c2 is older than the newest and LATEST names it: gc must keep it though keep=1.
    (tmp_path / "checkpoints" / LATEST_FILE).write_text("c2")
    partial = checkpoint_directory(tmp_path, "p0")
    (partial / "gym/model/policy").mkdir(parents=True)
    (partial / "gym/model/policy/.records.tmp").write_bytes(b"x" * 100)
    old = os.stat(checkpoint_directory(tmp_path, "c1") / CHECKPOINT_FILE).st_mtime - 10
    for path in [partial, *partial.rglob("*")]:
        os.utime(path, (old, old))
    before = _snapshot(tmp_path)
    dry = collect_garbage(tmp_path, keep=1, dry_run=True)
    assert _snapshot(tmp_path) == before
    assert dry.removed == ["c3", "p0"] and dry.partial == ["p0"] and dry.bytes_reclaimed > 100
    assert dry.protected == ["c1", "c2"] and dry.kept[0] == "c4"
    real = collect_garbage(tmp_path, keep=1)
    assert real.removed == dry.removed and real.bytes_reclaimed == dry.bytes_reclaimed
    remaining = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert remaining == [LATEST_FILE, "c1", "c2", "c4"]
    assert unpin_checkpoint(tmp_path, "c1") and not unpin_checkpoint(tmp_path, "c1")
    assert collect_garbage(tmp_path, keep=1).removed == ["c1"]


async def test_gc_keeps_a_partial_commit_newer_than_the_newest_checkpoint(tmp_path: Path) -> None:
    await _commit_and_publish(tmp_path, "c1", None)
    (checkpoint_directory(tmp_path, "c2") / "gym").mkdir(parents=True)
    assert collect_garbage(tmp_path, keep=1).removed == []
    assert checkpoint_directory(tmp_path, "c2").exists()


def test_gc_and_pin_refuse_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep"):
        collect_garbage(tmp_path, keep=0)
    with pytest.raises(ValueError, match="not a published checkpoint"):
        pin_checkpoint(tmp_path, "c9")
    assert not (checkpoint_directory(tmp_path, "c9") / PINNED_FILE).exists()
    assert collect_garbage(tmp_path, keep=1).removed == []
