"""The file-backed token staging store: round trip, durability steps, verification on read."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import participants._staging.store as store_module
import protocols._store.durable as durable_module
from participants import FileTokenStagingStore, put_entries
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


# -- batches: put_many writes one segment ---------------------------------------------------------


def _batch(
    count: int, prefix: str = "__generation_cut__/call", version: int = 7
) -> list[StagedEntry]:
    return [
        StagedEntry(staging_key=f"{prefix}-{i}/1", record=golden_record(weight_version=version))
        for i in range(count)
    ]


def _count_syncs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = os.fsync
    monkeypatch.setattr(durable_module.os, "fsync", lambda fd: calls.append(fd) or real(fd))
    return calls


@pytest.mark.parametrize("count", [1, 300])
def test_a_batch_costs_two_fsyncs_however_many_entries_it_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, count: int
) -> None:
    store = FileTokenStagingStore(tmp_path / "staging")
    syncs = _count_syncs(monkeypatch)
    entries = _batch(count)
    store.put_many(entries)
    assert len(syncs) == 2  # the segment file, then its directory
    assert len(store.segment_names()) == 1
    assert [store.get(e.staging_key) for e in entries] == entries
    assert [p for p in (tmp_path / "staging").iterdir() if p.name.endswith(".staged.json")] == []


def test_another_process_reads_a_batch_and_sees_later_ones(tmp_path: Path) -> None:
    writer = FileTokenStagingStore(tmp_path)
    first = _batch(3)
    writer.put_many(first)
    reader = FileTokenStagingStore(tmp_path)  # a fresh process: nothing indexed yet
    assert reader.get(first[1].staging_key) == first[1]
    later = _batch(2, prefix="__generation_cut__/later")
    segments = tmp_path / "segments"
    before = os.stat(segments)
    writer.put_many(later)  # published after the reader's scan, within the same clock tick:
    os.utime(segments, ns=(before.st_atime_ns, before.st_mtime_ns))  # (a coarse file clock)
    assert reader.get(later[0].staging_key) == later[0]
    assert reader.keys() == sorted(e.staging_key for e in first + later)


def test_a_later_batch_replaces_and_a_delete_is_seen_by_every_reader(tmp_path: Path) -> None:
    writer = FileTokenStagingStore(tmp_path)
    [old] = _batch(1)
    writer.put_many([old])
    reader = FileTokenStagingStore(tmp_path)
    assert reader.get(old.staging_key) == old
    [new] = _batch(1, version=9)
    writer.put_many([new])
    assert reader.get(new.staging_key) == new  # the later segment wins
    assert FileTokenStagingStore(tmp_path).get(new.staging_key) == new  # also on a cold scan
    assert writer.delete(new.staging_key) is True
    assert reader.get(new.staging_key) is None
    assert FileTokenStagingStore(tmp_path).get(new.staging_key) is None
    assert writer.delete(new.staging_key) is False
    writer.put_many([old])  # a deleted key can be staged again
    assert FileTokenStagingStore(tmp_path).get(old.staging_key) == old


def test_a_single_put_wins_over_a_segment_until_a_batch_replaces_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FileTokenStagingStore(tmp_path)
    [batched] = _batch(1)
    store.put_many([batched])
    single = StagedEntry(staging_key=batched.staging_key, record=golden_record(weight_version=8))
    store.put(single)
    assert FileTokenStagingStore(tmp_path).get(batched.staging_key) == single
    syncs = _count_syncs(monkeypatch)
    store.put_many([batched])  # removes the single file: the batch is the newest write
    assert len(syncs) == 3  # segment, its directory, and the directory that lost the file
    assert not store.path_of(batched.staging_key).exists()
    assert FileTokenStagingStore(tmp_path).get(batched.staging_key) == batched
    assert store.delete(batched.staging_key) is True
    assert store.get(batched.staging_key) is None


def test_a_batch_naming_a_key_twice_writes_nothing(tmp_path: Path) -> None:
    store = FileTokenStagingStore(tmp_path)
    entries = _batch(2)
    with pytest.raises(ValueError, match="once"):
        store.put_many([entries[0], entries[1], entries[0]])
    assert store.segment_names() == []
    assert store.get(entries[0].staging_key) is None


def test_a_corrupt_segment_line_is_refused_and_an_unpublished_one_ignored(
    tmp_path: Path,
) -> None:
    store = FileTokenStagingStore(tmp_path)
    entries = _batch(2)
    store.put_many(entries)
    [name] = store.segment_names()
    path = tmp_path / "segments" / name
    path.write_bytes(path.read_bytes().replace(b'"weight_version":7', b'"weight_version":8', 1))
    fresh = FileTokenStagingStore(tmp_path)
    with pytest.raises(ValueError, match="digest"):
        fresh.get(entries[0].staging_key)
    assert fresh.get(entries[1].staging_key) == entries[1]
    # A segment a crash left before its rename (a temporary name) holds nothing.
    (tmp_path / "segments" / f".{name}.1.abcd.tmp").write_bytes(path.read_bytes())
    later = _batch(1, prefix="__generation_cut__/x")
    (tmp_path / "segments" / ".half.tmp").write_bytes(
        b'"' + later[0].staging_key.encode() + b'"\t{'
    )
    assert FileTokenStagingStore(tmp_path).get(later[0].staging_key) is None


class _PutOnly:
    """A store without ``put_many``."""

    def __init__(self) -> None:
        self.puts: list[str] = []

    def put(self, entry: StagedEntry) -> None:
        self.puts.append(entry.staging_key)

    def get(self, staging_key: str) -> StagedEntry | None:
        return None

    def delete(self, staging_key: str) -> bool:
        return False


def test_put_entries_batches_when_it_can_and_puts_one_by_one_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = _PutOnly()
    entries = _batch(3)
    put_entries(plain, entries)
    assert plain.puts == [e.staging_key for e in entries]
    store = FileTokenStagingStore(tmp_path)
    syncs = _count_syncs(monkeypatch)
    put_entries(store, entries)
    assert len(syncs) == 2 and len(store.segment_names()) == 1
