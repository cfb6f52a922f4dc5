"""The SQLite ledger's own guarantees: one transaction per write, a cache that notices other
processes' removals, one file for every rollout, and a directory of one layout only."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from participants import (
    FileCaptureLedger,
    LedgerLayoutError,
    SqliteCaptureLedger,
    live_ledger_keys,
)
from participants._ledger import sqlite_db
from participants._ledger.group import PendingAppend
from participants._ledger.removal import RETIRE_STEPS
from protocols import RolloutRetiredError, custody_row, encode_row, failure_row

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


def _count_groups(ledger: SqliteCaptureLedger, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every group the commit thread commits from now on."""
    groups: list[int] = []
    real = ledger._commit_group

    def counting(group: list[PendingAppend]) -> None:
        groups.append(len(group))
        real(group)

    monkeypatch.setattr(ledger._committer._shards[0], "_commit", counting)
    return groups


async def test_concurrent_appends_of_many_rollouts_commit_in_few_transactions(
    ledger: SqliteCaptureLedger, monkeypatch: pytest.MonkeyPatch
) -> None:
    groups = _count_groups(ledger, monkeypatch)
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
        assert len(second._resolvable_rows("r") or []) == 3  # the cached entry reads the tail
        await first.delete(["r"])
        await first.record(commit("r", 0, output="new"))
        for rows in (second._resolvable_rows("r") or [], second.export_rows("r")):
            # its cached first row is gone: read afresh
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


def writing_the_new_file(directory: Path) -> sqlite3.Connection:
    """Another process's view of a ledger being created: a new database in its rollback journal,
    inside a write transaction, as a process is between opening the file and switching it."""
    directory.mkdir()
    conn = sqlite3.connect(
        directory / "ledger.sqlite3", isolation_level=None, check_same_thread=False
    )
    conn.execute("CREATE TABLE early (a)")
    conn.execute("BEGIN IMMEDIATE")
    return conn


def test_a_ledger_opened_while_another_process_creates_it_waits_for_it(tmp_path: Path) -> None:
    # SQLite refuses the switch to WAL at once, without its busy handler, while another
    # connection holds a write lock: three workers opening one new directory met it (D431).
    other = writing_the_new_file(tmp_path / "ledger")
    released = threading.Timer(0.3, other.execute, ("COMMIT",))
    released.start()
    try:
        opened = SqliteCaptureLedger(tmp_path / "ledger")
    finally:
        released.join()
        other.close()
    assert stored(opened, "PRAGMA journal_mode") == [("wal",)]
    opened.close()


def test_a_ledger_kept_locked_past_the_busy_timeout_is_still_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_db, "BUSY_TIMEOUT_S", 0.2)
    other = writing_the_new_file(tmp_path / "ledger")
    try:
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            SqliteCaptureLedger(tmp_path / "ledger")
    finally:
        other.close()


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


async def test_an_export_of_many_reads_them_in_one_statement_per_batch_of_keys(
    ledger: SqliteCaptureLedger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One cursor step per batch, not one per row: each step lets go of the GIL (D345)."""
    tricky = 'tab\there, newline\nthere, quote " and \u00e9'  # a reason is free text
    for index in range(7):
        await ledger.record(commit(f"r{index}", 0, rollout=f"r{index}"))
        await ledger.record_failure(f"r{index}", "call-1", tricky)
    keys = [f"r{index}" for index in reversed(range(7))] + ["absent"]
    expected = [ledger.export_rows(key) for key in keys]
    monkeypatch.setattr(sqlite_db, "READ_MANY_KEYS", 3)
    statements: list[str] = []
    with contextlib.closing(sqlite3.connect(ledger.path)) as conn:
        conn.set_trace_callback(statements.append)
        assert sqlite_db.read_ledgers(conn, keys) == expected
    assert len(statements) == 3  # 8 keys, 3 a statement
    assert expected[-1] == [] and expected[0][0]["model_call_id"] == "call-0"
    assert expected[0][1]["failure_reason"] == tricky
    other = SqliteCaptureLedger(ledger.root)  # another process's view reads the same
    try:
        assert other.export_rows_many(keys) == expected
    finally:
        other.close()


def _traced(ledger: SqliteCaptureLedger, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every statement any of the ledger's connections runs from now on."""
    statements: list[str] = []
    for conn in ledger._db._all:
        conn.set_trace_callback(statements.append)
    real_open = ledger._db._open

    def traced_open() -> sqlite3.Connection:
        conn = real_open()
        conn.set_trace_callback(statements.append)
        return conn

    monkeypatch.setattr(ledger._db, "_open", traced_open)
    return statements


def _group(keys: list[str], turn: int) -> list[PendingAppend]:
    items = []
    for key in keys:
        row = custody_row(commit(key, turn, rollout=key))
        items.append(PendingAppend(key, row, encode_row(row), False, ""))
    return items


async def test_a_group_commit_is_a_few_statements_however_many_rows_it_holds(
    ledger: SqliteCaptureLedger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each statement is a step that lets go of the GIL; under a busy loop every one of them
    waits to get it back, so a group may not cost one per key or per row (D345)."""
    await ledger.retire(["fenced"])
    statements = _traced(ledger, monkeypatch)
    counts = []
    for keys, turn in ((["one", "two"], 0), ([f"k{i}" for i in range(300)] + ["fenced"], 0)):
        statements.clear()
        ledger._commit_group(_group(keys, turn))
        counts.append(len(statements))
    statements.clear()
    again = _group([f"k{i}" for i in range(300)], 1) + _group(["k1"], 2)
    ledger._commit_group(again)  # cached keys with rows: no fence to read
    counts.append(len(statements))
    statements.clear()
    ledger._commit_group(_group(["three"], 0))  # one row: one insert that names its number
    assert counts[0] == counts[1] <= 7 and counts[2] < counts[1] and len(statements) <= 5
    assert stored(ledger, "SELECT count(*) FROM rows WHERE key = 'fenced'") == [(0,)]
    fresh = SqliteCaptureLedger(ledger.root)  # what is on disk, not what is cached
    try:
        assert [len(rows) for rows in fresh.export_rows_many(["k0", "k1", "one", "three"])] == [
            2,
            3,
            1,
            1,
        ]
        assert fresh.export_rows("k1") == ledger.export_rows("k1")
        entry = ledger._cache.get("k1")
        assert entry is not None
        seqs = stored(ledger, "SELECT min(seq), max(seq) FROM rows WHERE key = 'k1'")
        assert seqs == [(entry.inode, entry.offset)]  # the cache knows the rows' sequences
    finally:
        fresh.close()


async def test_a_group_wakes_its_callers_loop_once(
    ledger: SqliteCaptureLedger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wake-up from the commit thread is a write that lets go of the GIL (D345)."""
    groups = _count_groups(ledger, monkeypatch)
    loop = asyncio.get_running_loop()
    wakeups: list[object] = []
    real_wake = loop.call_soon_threadsafe

    def call_soon_threadsafe(callback: Any, *args: Any, **kwargs: Any) -> Any:
        wakeups.append(callback)
        return real_wake(callback, *args, **kwargs)

    monkeypatch.setattr(loop, "call_soon_threadsafe", call_soon_threadsafe)
    async with anyio.create_task_group() as group:
        for index in range(100):
            group.start_soon(ledger.record, commit(f"w{index}", 0, rollout=f"w{index}"))
    assert sum(groups) == 100
    assert len(wakeups) == len(groups) < 100


async def test_retire_delete_and_import_are_a_few_statements_however_many_keys_they_name(
    ledger: SqliteCaptureLedger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retire at the end of every rollout runs beside a busy loop too (D345), and a restore's
    import and retire name thousands of keys: not one statement per 500 of them (D454)."""
    statements = _traced(ledger, monkeypatch)
    counts: dict[str, list[int]] = {"import": [], "retire": [], "delete": []}

    def counted(name: str) -> None:
        counts[name].append(len(statements))
        statements.clear()

    assert sqlite_db.READ_MANY_KEYS < 1_200 <= sqlite_db.WRITE_MANY_KEYS
    for size in (2, 1_200):
        keys = [f"s{size}-{index}" for index in range(size)]
        ledgers = {key: [custody_row(commit(key, 0, rollout=key))] for key in keys}
        statements.clear()
        await anyio.to_thread.run_sync(ledger.import_rows_many, ledgers)
        counted("import")
        await ledger.retire(keys[: size // 2])
        counted("retire")
        await ledger.delete(keys)
        counted("delete")
        assert not live_ledger_keys(ledger.root)
    for name, (small, large) in counts.items():
        assert small == large <= 8, name


async def test_many_rows_go_in_as_one_blob_of_their_lines_cut_in_bytes(
    ledger: SqliteCaptureLedger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An import and a group commit bind their rows' lines as one blob, never as text inside
    JSON that both sides would escape and parse (D452); each stored line is exactly its row's."""
    tricky = 'tab\there, newline\nthere, quote " back\\slash and \u00e9'  # a reason is free text
    statements = _traced(ledger, monkeypatch)
    keys = [f"b{index}" for index in range(40)]
    ledgers = {
        key: [custody_row(commit(key, 0, rollout=key)), failure_row("call-1", tricky * (i % 3))]
        if i % 3
        else [custody_row(commit(key, 0, rollout=key))]
        for i, key in enumerate(keys)
    }
    await anyio.to_thread.run_sync(ledger.import_rows_many, ledgers)
    imported = [encode_row(row) for key in keys for row in ledgers[key]]
    group = _group([f"g{index}" for index in range(30)], 0)
    ledger._commit_group(group)
    appended = [item.line for item in group]
    inserts = [sql for sql in statements if sql.startswith("INSERT INTO rows")]
    assert len(inserts) == 2
    for sql, lines in zip(inserts, (imported, appended), strict=True):
        assert f"x'{b''.join(lines).hex()}'" in sql  # every line, in order, in one blob
        assert '\\"' not in sql  # no line escaped into a JSON string
    fresh = SqliteCaptureLedger(ledger.root)  # what is on disk, not what is cached
    try:
        assert fresh.export_rows_many(keys) == [ledgers[key] for key in keys]
    finally:
        fresh.close()
    on_disk = stored(ledger, "SELECT line FROM rows ORDER BY seq")
    assert [line for (line,) in on_disk] == imported + appended
