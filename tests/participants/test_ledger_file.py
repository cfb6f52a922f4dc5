"""The file ledger's system-call discipline, caching, locks and sharing of one directory."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from participants import FileCaptureLedger
from participants._ledger.cache import LedgerCacheCollector, RowCache
from participants._ledger.locks import DEFAULT_STRIPES, LOCK_DIRECTORY
from protocols import RolloutRemoval, RolloutRetiredError
from protocols._ledger_keys import MAX_LEDGER_KEY_LENGTH

from .ledger_factory import commit

pytestmark = pytest.mark.anyio


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[FileCaptureLedger]:
    made = FileCaptureLedger(tmp_path / "ledger")
    yield made
    made.close()


class SyscallLog:
    """Records the ledger's fsyncs, unlinks, fence creations and existence checks, in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, ledger: FileCaptureLedger) -> None:
        self.events: list[tuple[str, str]] = []
        real_fsync, real_unlink, real_open = os.fsync, os.unlink, os.open
        real_exists = os.path.exists

        def fsync(fd: int) -> None:
            self.events.append(("fsync", "dir" if fd == ledger._dir_fd else "file"))
            real_fsync(fd)

        def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
            self.events.append(("unlink", os.path.basename(path)))
            real_unlink(path, *args, **kwargs)

        def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            if flags & os.O_CREAT and str(path).endswith(".retired"):
                self.events.append(("create", os.path.basename(path)))
            return real_open(path, flags, *args, **kwargs)

        def exists(path: Any) -> bool:
            self.events.append(("exists", os.path.basename(path)))
            return real_exists(path)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "unlink", unlink)
        monkeypatch.setattr(os, "open", open_)
        monkeypatch.setattr(os.path, "exists", exists)

    def kinds(self, kind: str) -> list[tuple[str, str]]:
        return [event for event in self.events if event[0] == kind]


async def test_retire_makes_fences_durable_before_removing_any_ledger(
    ledger: FileCaptureLedger, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in ("a", "b"):
        await ledger.record(commit(key, 0))
    log = SyscallLog(monkeypatch, ledger)
    await ledger.retire(["a", "b", "c"])
    order = [e for e in log.events if e[0] in ("create", "fsync", "unlink")]
    first_sync = order.index(("fsync", "dir"))
    assert sorted(e[1] for e in order[:first_sync]) == [
        "a.lineage.retired",
        "b.lineage.retired",
        "c.lineage.retired",
    ]
    assert {e[0] for e in order[first_sync + 1 : -1]} == {"unlink"}  # removals only after
    assert order[-1] == ("fsync", "dir")  # and synced before the result is reported
    assert not (ledger.root / "a.lineage.jsonl").exists()


async def test_a_retried_retire_writes_nothing_but_still_syncs(
    ledger: FileCaptureLedger, monkeypatch: pytest.MonkeyPatch
) -> None:
    await ledger.retire(["a", "b"])
    before = {p.name: p.stat().st_ino for p in ledger.root.iterdir()}
    log = SyscallLog(monkeypatch, ledger)
    assert await ledger.retire(["a", "b"]) == RolloutRemoval(absent=["a", "b"])
    assert {p.name: p.stat().st_ino for p in ledger.root.iterdir()} == before
    assert log.kinds("fsync") == [("fsync", "dir"), ("fsync", "dir")]


async def test_delete_syncs_every_nonempty_batch_even_when_nothing_was_found(
    ledger: FileCaptureLedger, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = SyscallLog(monkeypatch, ledger)
    assert await ledger.delete(["nothing"]) == RolloutRemoval(absent=["nothing"])
    assert log.kinds("fsync") == [("fsync", "dir")]
    await ledger.delete([])
    assert log.kinds("fsync") == [("fsync", "dir")]


async def test_a_normal_append_never_looks_for_the_fence(
    ledger: FileCaptureLedger, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = SyscallLog(monkeypatch, ledger)
    await ledger.record(commit("r", 0))
    assert log.kinds("exists") == [("exists", "r.lineage.retired")]  # first row: checked once
    assert log.kinds("fsync") == [("fsync", "file"), ("fsync", "dir")]
    log.events.clear()
    await ledger.record(commit("r", 1))
    assert log.kinds("exists") == []
    assert log.kinds("fsync") == [("fsync", "file")]  # no directory sync for an append


async def test_import_syncs_the_directory_once_and_no_file(
    ledger: FileCaptureLedger, monkeypatch: pytest.MonkeyPatch
) -> None:
    await ledger.record(commit("r", 0))
    rows = ledger.export_rows("r")
    log = SyscallLog(monkeypatch, ledger)
    ledger.import_rows_many({f"r-a{n}": rows for n in range(1, 6)})
    assert log.kinds("fsync") == [("fsync", "dir")]


async def test_retire_leaves_a_reused_id_alone_when_delete_came_between_its_phases(
    tmp_path: Path,
) -> None:
    def between_phases(step: str) -> None:
        if step == "fences_synced":
            other._remove(["r"], unless_started=False)  # a delete ...
            other._append(
                "r", {"model_call_id": "new", "failure_reason": "x"}, failure=True, staging_key=""
            )  # ... and a reuse

    ledger = FileCaptureLedger(tmp_path, on_step=between_phases)
    other = FileCaptureLedger(tmp_path)
    try:
        await ledger.record(commit("r", 0))
        await ledger.retire(["r"])
        assert [row["model_call_id"] for row in other.export_rows("r")] == ["new"]
    finally:
        ledger.close()
        other.close()


async def test_no_lock_file_per_rollout_only_fixed_stripes(ledger: FileCaptureLedger) -> None:
    for i in range(200):
        await ledger.record(commit(f"k{i}", 0))
    await ledger.retire([f"k{i}" for i in range(200)])
    await ledger.delete([f"k{i}" for i in range(200)])
    assert sorted(p.name for p in ledger.root.iterdir()) == [LOCK_DIRECTORY]
    stripes = sorted(p.name for p in (ledger.root / LOCK_DIRECTORY).iterdir())
    assert stripes == [f"stripe-{i:03d}.lock" for i in range(DEFAULT_STRIPES)]


async def test_two_instances_on_one_directory_see_each_other(tmp_path: Path) -> None:
    first, second = FileCaptureLedger(tmp_path), FileCaptureLedger(tmp_path)
    try:
        await first.record(commit("r", 0))
        assert len((await second.manifest("r")).records) == 1  # cached by second now
        await first.record(commit("r", 1))
        assert len((await second.manifest("r")).records) == 2  # the tail was read
        await first.record(commit("r", 2))
        await second.record(commit("r", 3))  # the write path reads the tail too
        assert len((await first.manifest("r")).records) == 4
        await first.retire(["r"])
        await second.record(commit("r", 4))  # second's cache must not resurrect the ledger
        assert not (tmp_path / "r.lineage.jsonl").exists()
        with pytest.raises(RolloutRetiredError):
            await second.manifest("r")
    finally:
        first.close()
        second.close()


async def test_a_torn_last_line_is_ignored(ledger: FileCaptureLedger) -> None:
    await ledger.record(commit("r", 0))
    path = ledger.root / "r.lineage.jsonl"
    path.write_bytes(path.read_bytes() + b'{"model_call_id": "tor')
    other = FileCaptureLedger(ledger.root)
    try:
        assert len(other.export_rows("r")) == 1
    finally:
        other.close()


def test_the_row_cache_is_bounded_by_rollouts_and_rows() -> None:
    from participants._ledger.cache import CachedLedger

    cache = RowCache(max_rollouts=3, max_rows=10)
    for i in range(5):
        entry = CachedLedger(inode=i, offset=0)
        entry.add({"model_call_id": "c"})
        cache.store(f"k{i}", entry)
    assert cache.sizes() == {"ledger_rollouts": 3, "ledger_rows": 3}
    assert cache.get("k0") is None and cache.get("k4") is not None
    big = CachedLedger(inode=9, offset=0)
    for n in range(9):
        big.add({"model_call_id": f"c{n}"})
    cache.store("big", big)
    assert cache.sizes() == {"ledger_rollouts": 2, "ledger_rows": 10}
    huge = CachedLedger(inode=10, offset=0)
    for n in range(50):
        huge.add({"model_call_id": f"c{n}"})
    cache.store("huge", huge)  # the only entry is kept whatever its size
    assert cache.sizes() == {"ledger_rollouts": 1, "ledger_rows": 50}


async def test_the_cache_size_is_a_metric(tmp_path: Path) -> None:
    ledger = FileCaptureLedger(tmp_path, max_cached_rollouts=2)
    try:
        registry = CollectorRegistry()
        registry.register(LedgerCacheCollector(ledger))
        for i in range(3):
            await ledger.record(commit(f"k{i}", 0))

        def size(cache: str) -> float | None:
            return registry.get_sample_value(
                "midflight_capture_ledger_cache_size", {"cache": cache}
            )

        assert size("ledger_rollouts") == 2
        await ledger.retire(["k0", "k1", "k2"])
        assert size("ledger_rollouts") == 0 and size("ledger_rows") == 0
    finally:
        ledger.close()


async def test_the_longest_key_gets_every_capture_file(ledger: FileCaptureLedger) -> None:
    key = "k" * MAX_LEDGER_KEY_LENGTH  # each suffix still makes a legal file name
    await ledger.record(commit(key, 0))
    assert await ledger.mark_started(key)
    assert (await ledger.retire([key])).removed == [key]
    assert (ledger.root / f"{key}.lineage.retired").exists()


async def test_a_read_of_an_uncached_ledger_does_not_fill_the_cache(tmp_path: Path) -> None:
    # D256: a manifest, has_rows or export of a ledger this process does not cache reads it
    # whole and leaves the bounded cache to the ledgers the process is serving.
    writer = FileCaptureLedger(tmp_path)
    reader = FileCaptureLedger(tmp_path)
    try:
        for turn in range(3):
            await writer.record(commit("r", turn))
        await reader.record(commit("mine", 0))
        before = reader.cache_sizes()
        assert [c.model_call_id for c in (await reader.manifest("r")).records] == [
            "call-0",
            "call-1",
            "call-2",
        ]
        assert await reader.has_rows("r")
        assert len(reader.export_rows("r")) == 3
        assert reader.cache_sizes() == before == {"ledger_rollouts": 1, "ledger_rows": 1}
        # A cached ledger is still refreshed with what another process appended since.
        await writer.record(commit("mine", 1, call_id="c1-elsewhere"))
        assert [row["model_call_id"] for row in reader.export_rows("mine")] == [
            "call-0",
            "c1-elsewhere",
        ]
        assert reader.cache_sizes() == {"ledger_rollouts": 1, "ledger_rows": 2}
    finally:
        writer.close()
        reader.close()


async def test_a_torn_last_line_is_left_out_of_every_read(tmp_path: Path) -> None:
    ledger = FileCaptureLedger(tmp_path)
    try:
        await ledger.record(commit("r", 0))
        path = tmp_path / "r.lineage.jsonl"
        path.write_bytes(path.read_bytes() + b'{"model_call_id":"call-1","fing')  # a torn write
        assert len(ledger.export_rows("r")) == 1
        other = FileCaptureLedger(tmp_path)  # nothing cached: the read-through path
        try:
            assert [c.model_call_id for c in (await other.manifest("r")).records] == ["call-0"]
        finally:
            other.close()
    finally:
        ledger.close()
