"""The file-backed token staging store: round trip, durability steps, verification on read."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import participants._durable as durable_module
import participants._staging_store as store_module
from participants import FileTokenStagingStore
from protocols import StagedEntry
from tests.staging_factories import golden_record


def _entry(key: str = "rollout-1/call-1") -> StagedEntry:
    return StagedEntry(staging_key=key, record=golden_record(), attachments={"a": 1})


def test_put_get_delete(tmp_path: Path) -> None:
    store = FileTokenStagingStore(tmp_path / "staging")
    assert store.get("rollout-1/call-1") is None
    store.put(_entry())
    store.put(_entry("__generation_cut__/call-1/1"))
    assert store.get("rollout-1/call-1") == _entry()
    assert store.keys() == ["__generation_cut__/call-1/1", "rollout-1/call-1"]
    assert store.delete("rollout-1/call-1") is True
    assert store.delete("rollout-1/call-1") is False
    assert store.get("rollout-1/call-1") is None
    assert [p.name for p in (tmp_path / "staging").iterdir() if p.name.endswith(".tmp")] == []


def test_put_replaces_atomically(tmp_path: Path) -> None:
    store = FileTokenStagingStore(tmp_path)
    store.put(_entry())
    replacement = StagedEntry(
        staging_key="rollout-1/call-1", record=golden_record(weight_version=8)
    )
    store.put(replacement)
    assert store.get("rollout-1/call-1") == replacement


def test_put_syncs_the_file_and_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FileTokenStagingStore(tmp_path / "staging")
    synced: list[str] = []
    real_fsync, real_dir = os.fsync, durable_module.fsync_directory
    monkeypatch.setattr(
        durable_module.os, "fsync", lambda fd: synced.append("file") or real_fsync(fd)
    )
    monkeypatch.setattr(
        durable_module, "fsync_directory", lambda d: synced.append(f"dir:{d.name}") or real_dir(d)
    )
    store.put(_entry())
    assert synced[:2] == ["file", "dir:staging"]  # (the directory sync itself calls fsync too)
    synced.clear()
    monkeypatch.setattr(store_module, "fsync_directory", lambda d: synced.append(f"dir:{d.name}"))
    store.delete("rollout-1/call-1")
    assert synced == ["dir:staging"]


def test_the_store_is_created_durably(tmp_path: Path) -> None:
    root = tmp_path / "run" / "staging"
    FileTokenStagingStore(root)
    assert root.is_dir()


def test_a_corrupt_or_foreign_file_is_refused(tmp_path: Path) -> None:
    store = FileTokenStagingStore(tmp_path)
    store.put(_entry())
    path = store.path_of("rollout-1/call-1")
    path.write_bytes(path.read_bytes().replace(b'"weight_version":7', b'"weight_version":8'))
    with pytest.raises(ValueError, match="digest"):
        store.get("rollout-1/call-1")
    store.put(_entry("other/key"))
    store.path_of("other/key").rename(store.path_of("rollout-1/call-1"))
    with pytest.raises(ValueError, match="holds"):
        store.get("rollout-1/call-1")
    with pytest.raises(ValueError, match="non-empty"):
        store.path_of("")
