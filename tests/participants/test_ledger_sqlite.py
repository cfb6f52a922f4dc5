"""The SQLite ledger's own guarantees: one transaction per write, a cache that notices other
processes' removals, one file for every rollout, and a directory of one layout only."""

from __future__ import annotations

import contextlib
import sqlite3
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from participants import (
    FileCaptureLedger,
    LedgerLayoutError,
    SqliteCaptureLedger,
    live_ledger_keys,
)
from participants._ledger.removal import RETIRE_STEPS
from protocols import RolloutRetiredError, custody_row

from .ledger_factory import commit

pytestmark = pytest.mark.anyio


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[SqliteCaptureLedger]:
    made = SqliteCaptureLedger(tmp_path / "ledger")
    yield made
    made.close()


def stored(ledger: SqliteCaptureLedger, sql: str) -> list[tuple[object, ...]]:
    with contextlib.closing(sqlite3.connect(ledger.path)) as conn:
        return list(conn.execute(sql))


async def test_the_database_is_in_wal_mode_and_every_rollout_shares_its_one_file(
    ledger: SqliteCaptureLedger,
) -> None:
    for index in range(50):
        await ledger.record(commit(f"k{index}", 0))
    await ledger.retire([f"k{index}" for index in range(25)])
    assert stored(ledger, "PRAGMA journal_mode") == [("wal",)]
    names = {path.name for path in ledger.root.iterdir()}
    assert names <= {"ledger.sqlite3", "ledger.sqlite3-wal", "ledger.sqlite3-shm"}
    assert stored(ledger, "SELECT count(DISTINCT key) FROM rows") == [(25,)]


async def test_concurrent_appends_of_many_rollouts_commit_in_few_transactions(
    ledger: SqliteCaptureLedger, monkeypatch: pytest.MonkeyPatch
) -> None:
    groups: list[int] = []
    real = ledger._commit_group

    def counting(group: list[object]) -> None:
        groups.append(len(group))
        real(group)  # type: ignore[arg-type]

    monkeypatch.setattr(ledger._committer._shards[0], "_commit", counting)
    async with anyio.create_task_group() as group:
        for index in range(200):
            group.start_soon(ledger.record, commit(f"c{index}", 0))
    assert sum(groups) == 200
    assert len(groups) < 50  # one transaction (one fsync) carries many rollouts' rows
    assert stored(ledger, "SELECT count(*) FROM rows") == [(200,)]


@pytest.mark.parametrize("step", RETIRE_STEPS)
async def test_a_retire_that_dies_inside_its_transaction_changes_nothing(
    ledger: SqliteCaptureLedger, step: str
) -> None:
    await ledger.record(commit("a", 0))
    await ledger.record(commit("b", 0))

    def die(name: str) -> None:
        if name == step:
            raise RuntimeError(f"killed at {name}")

    ledger._on_step = die
    with pytest.raises(RuntimeError, match="killed"):
        await ledger.retire(["a", "b"])
    assert stored(ledger, "SELECT count(*) FROM marks") == [(0,)]  # no fence without removal
    assert len((await ledger.manifest("a")).records) == 1
    ledger._on_step = lambda _name: None
    assert (await ledger.retire(["a", "b"])).removed == ["a", "b"]
    with pytest.raises(RolloutRetiredError):
        await ledger.manifest("a")


async def test_a_cached_ledger_removed_and_reused_by_another_process_is_read_afresh(
    tmp_path: Path,
) -> None:
    first, second = SqliteCaptureLedger(tmp_path), SqliteCaptureLedger(tmp_path)
    try:
        await first.record(commit("r", 0, output="old"))
        await first.record(commit("r", 1, output="old"))
        await second.resolve("r", [])  # the write-side read: second caches "r"
        assert "r" in second._cache
        await first.record(commit("r", 2, output="old"))
        assert len(second.export_rows("r")) == 3  # the tail is read
        await first.delete(["r"])
        await first.record(commit("r", 0, output="new"))
        rows = second.export_rows("r")  # its cached first row is gone: read afresh
        assert [row["model_call_id"] for row in rows] == ["call-0"]
        assert rows[0]["digest"] == commit("r", 0, output="new").record.cumulative_hash
        await first.retire(["r"])
        await second.record(commit("r", 4))  # second's cache must not resurrect the ledger
        assert stored(first, "SELECT count(*) FROM rows WHERE key = 'r'") == [(0,)]
        with pytest.raises(RolloutRetiredError):
            await second.manifest("r")
    finally:
        first.close()
        second.close()


async def test_an_import_wipes_later_attempts_and_their_marks_in_one_transaction(
    ledger: SqliteCaptureLedger,
) -> None:
    await ledger.record(commit("r-a1", 0))
    await ledger.record(commit("r-a2", 0))
    assert await ledger.mark_started("r-a2")
    await ledger.retire(["r"])
    rows = [dict(row) for row in ledger.export_rows("r-a1")]
    ledger.import_rows_many({"r-a1": rows})
    assert stored(ledger, "SELECT key FROM rows ORDER BY seq") == [("r-a1",)]
    assert stored(ledger, "SELECT key FROM marks") == [("r",)]  # attempt 0 keeps its fence
    with pytest.raises(ValueError):  # a malformed row: nothing changes
        ledger.import_rows_many({"q": [{"model_call_id": "x"}], "r-a1": []})
    assert stored(ledger, "SELECT key FROM rows ORDER BY seq") == [("r-a1",)]


async def test_a_directory_holds_one_layout(tmp_path: Path) -> None:
    file_ledger = FileCaptureLedger(tmp_path / "f")
    await file_ledger.record(commit("r", 0))
    file_ledger.close()
    with pytest.raises(LedgerLayoutError, match="file layout"):
        SqliteCaptureLedger(tmp_path / "f")
    SqliteCaptureLedger(tmp_path / "s").close()
    with pytest.raises(LedgerLayoutError, match="sqlite layout"):
        FileCaptureLedger(tmp_path / "s")


async def test_a_database_of_another_schema_is_refused(tmp_path: Path) -> None:
    SqliteCaptureLedger(tmp_path).close()
    with contextlib.closing(sqlite3.connect(tmp_path / "ledger.sqlite3")) as conn:
        conn.execute("PRAGMA user_version = 99")
    with pytest.raises(RuntimeError, match="schema 99"):
        SqliteCaptureLedger(tmp_path)


async def test_a_closed_ledger_refuses_work(ledger: SqliteCaptureLedger) -> None:
    await ledger.record(commit("r", 0))
    ledger.close()
    with pytest.raises(RuntimeError, match="closed"):
        await ledger.record(commit("r", 1))
    with pytest.raises(RuntimeError, match="closed"):
        await ledger.manifest("r")


@pytest.mark.parametrize("layout", ["sqlite", "file"])
async def test_live_ledger_keys_reads_either_layout_and_writes_nothing(
    tmp_path: Path, layout: str
) -> None:
    assert live_ledger_keys(tmp_path / "none") == []
    opened = SqliteCaptureLedger if layout == "sqlite" else FileCaptureLedger
    ledger = opened(tmp_path / layout)
    try:
        for key in ("b", "a", "c-a1"):
            await ledger.record(commit(key, 0))
        await ledger.retire(["b"])
        before = sorted(path.name for path in (tmp_path / layout).iterdir())
        assert live_ledger_keys(tmp_path / layout) == ["a", "c-a1"]
        assert sorted(path.name for path in (tmp_path / layout).iterdir()) == before
    finally:
        ledger.close()


def test_threads_refreshing_one_ledger_never_cache_a_row_twice(
    ledger: SqliteCaptureLedger,
) -> None:
    calls = 150
    ledger._append("r", custody_row(commit("r", 0)), failure=False, staging_key="s")
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            ledger._read("r", keep=True)  # each refresh parses what was appended since

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    readers = [threading.Thread(target=read) for _ in range(8)]
    try:
        for thread in readers:
            thread.start()
        for turn in range(1, calls):
            ledger._append("r", custody_row(commit("r", turn)), failure=False, staging_key="s")
    finally:
        stop.set()
        for thread in readers:
            thread.join(30)
        sys.setswitchinterval(interval)
    rows = ledger._read("r", keep=True)  # from the cache every reader refreshed
    assert rows is not None
    assert [row["model_call_id"] for row in rows] == [f"call-{t}" for t in range(calls)]
