"""The SQLite capture ledger: every ledger of a model server in one database file (WAL mode).

One file, ``<root>/ledger.sqlite3``, shared by every process of the server, holds two tables:
``rows`` (one row per ledger line, in commit order by an ``AUTOINCREMENT`` sequence that is never
reused) and ``marks`` (per capture key: a fence and a start marker). Each write is one transaction
made durable by one fsync of the write-ahead log (``synchronous=FULL``), so

- a group of appends from many rollouts costs one fsync, not one per ledger;
- a retire fences and removes its ledgers in one transaction: no moment exists where a ledger is
  gone and its fence is not durable, and a SIGKILL leaves all of it or none of it;
- an import wipes the targets and later attempts and installs its rows in one transaction;
- no file is created per rollout, so the cost of creating an inode (D255) is gone.

The rules are those of the file ledger (``docs/capture-ledger.md``); D340 records the choice and
the measurements. The row cache is the file ledger's, keyed by sequence numbers instead of
inodes and offsets: an entry remembers its first and last sequence, and a read asks for the first
again and for anything after the last. Rows are only ever removed a whole key at a time and
sequences are never reused, so a missing first row means the key was removed (and perhaps used
again) since, and the entry is read afresh.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Literal

from protocols import (
    RolloutRemoval,
    RolloutRetiredError,
    encode_row,
    validate_ledger_key,
)

from .._storage.durable import make_directory_durable
from .cache import DEFAULT_MAX_CACHED_ROLLOUTS, DEFAULT_MAX_CACHED_ROWS, RowCache
from .cache import CachedLedger as _Cached
from .common import (
    doomed_keys,
    encode_ledger_rows,
    removal_result,
    split_attempt,
    unlink_if_present,
)
from .group import GroupCommitter, PendingAppend, settle_all
from .layout import SQLITE_DATABASE, refuse_other_layout
from .locks import StripedThreadLocks
from .reads import ReadPool
from .removal import RETIRE_STEPS
from .sqlite_db import (
    LedgerDatabase,
    delete_keys,
    fenced_keys,
    insert_rows,
    keys_with_rows,
    parse_lines,
    read_ledgers,
    read_since_many,
    started_keys,
    upsert_marks,
    wipe_attempts,
)
from .staging import copy_entry, stage_key
from .threaded import ThreadedLedger

DATABASE_NAME: Final = SQLITE_DATABASE
DEFAULT_MAX_COMMIT_BATCH: Final = 1024
"""Most appends one transaction commits: one group is one fsync."""
_FENCED: Final = "SELECT fenced, started FROM marks WHERE key = ?"
_MARK: Final = (
    "INSERT INTO marks (key, rollout, attempt, fenced, started) VALUES (?, ?, ?, ?, ?) "
    "ON CONFLICT (key) DO UPDATE SET fenced = max(fenced, excluded.fenced), "
    "started = max(started, excluded.started)"
)


def _mark(key: str, *, fenced: int, started: int) -> tuple[str, str, int, int, int]:
    rollout, attempt = split_attempt(key)
    return key, rollout, attempt, fenced, started


class SqliteCaptureLedger(ThreadedLedger):
    """A capture ledger in one SQLite database, safe for many threads and processes.

    Args:
        root: The ledger directory (created if missing); the database is ``ledger.sqlite3``.
        max_cached_rollouts: Bound of the row cache, in ledgers.
        max_cached_rows: Bound of the row cache, in rows.
        on_step: Called with each name of ``RETIRE_STEPS`` inside the retire's transaction
            (tests only).
        max_commit_batch: Most appends one transaction commits.
        synchronous: SQLite's ``synchronous`` setting. ``FULL`` (a commit is on disk before it
            returns) is what every rule needs; ``OFF`` is for CPU benchmarks only, as
            ``bench hotpath`` stubs ``os.fsync`` for the file layout.
    """

    def __init__(
        self,
        root: Path,
        *,
        max_cached_rollouts: int = DEFAULT_MAX_CACHED_ROLLOUTS,
        max_cached_rows: int = DEFAULT_MAX_CACHED_ROWS,
        on_step: Callable[[str], None] | None = None,
        max_commit_batch: int = DEFAULT_MAX_COMMIT_BATCH,
        synchronous: Literal["FULL", "OFF"] = "FULL",
    ) -> None:
        self.root = Path(root)
        make_directory_durable(self.root)
        refuse_other_layout(self.root, this="sqlite")
        self._db = LedgerDatabase(self.root / DATABASE_NAME, synchronous=synchronous)
        self.path = self._db.path
        self._cache = RowCache(max_cached_rollouts, max_cached_rows)
        # A key's cache entry is refreshed by one thread at a time; the commit thread stages
        # its rows on a copy and installs it only once the transaction is durable.
        self._locks = StripedThreadLocks()
        self._on_step = on_step or (lambda _name: None)
        # One thread commits every queued append: SQLite takes one writer at a time anyway,
        # and one transaction for everything queued is one fsync for all of it.
        self._committer = GroupCommitter(self._commit_group, shards=1, max_batch=max_commit_batch)
        self._reads = ReadPool()

    # -- reading -------------------------------------------------------------------------------

    def _refresh(self, conn: sqlite3.Connection, key: str) -> _Cached | None:
        """The cached rows of ``key`` brought up to date (one statement); ``None`` when it has no
        row. Under the key's lock."""
        entry = self._cache.get(key)
        first, last = (0, 0) if entry is None else (entry.inode, entry.offset)
        fetched = read_since_many(conn, [(key, first, last)]).get(key, [])
        return self._merge(key, entry, first, fetched)

    def _merge(
        self, key: str, entry: _Cached | None, first: int, fetched: list[tuple[int, str]]
    ) -> _Cached | None:
        """Bring ``entry`` (cached as far as ``first`` … its offset) up to date with ``fetched``:
        row ``first`` if still there, then every row after the offset."""
        if entry is not None and fetched and fetched[0][0] == first:
            fresh = [line for seq, line in fetched if seq > entry.offset]
            if fresh:
                for row in parse_lines(fresh):
                    entry.add(row)
                entry.offset = fetched[-1][0]
                self._cache.store(key, entry)
            return entry
        # Uncached, or its first row is gone: removed (and maybe used again) since. Sequences
        # are never reused, so every row the key has now came after the cached offset.
        self._cache.pop(key)
        if not fetched:
            return None
        entry = _Cached(inode=fetched[0][0], offset=fetched[-1][0])
        for row in parse_lines([line for _, line in fetched]):
            entry.add(row)
        self._cache.store(key, entry)
        return entry

    def _rows(self, conn: sqlite3.Connection, key: str, *, keep: bool) -> list[dict[str, Any]]:
        """A copy of the rows of ``key``; ``keep=False`` leaves an uncached ledger uncached
        (D256)."""
        if keep or key in self._cache:
            with self._locks.hold(key):
                entry = self._refresh(conn, key)
                return [] if entry is None else list(entry.rows)
        return read_ledgers(conn, [key])[0]

    @staticmethod
    def _fenced(conn: sqlite3.Connection, key: str) -> bool:
        mark = conn.execute(_FENCED, (key,)).fetchone()
        return bool(mark and mark[0])

    def _read(self, key: str, *, keep: bool) -> list[dict[str, Any]] | None:
        """The rows of ``key``, or ``None`` when it has none and is retired.

        Rows are read before the fence: a retire removes rows and fences in one transaction, so
        rows seen mean "not retired when read", and no rows with a fence seen after means
        retired by then.
        """
        with self._db.connection() as conn:
            rows = self._rows(conn, key, keep=keep)
            if not rows and self._fenced(conn, key):
                return None
            return rows

    def _resolvable_rows(self, key: str) -> list[dict[str, Any]] | None:
        return self._read(key, keep=True)

    def _commit_stripe(self, key: str) -> int:
        return 0  # one commit thread: SQLite takes one writer at a time

    def _manifest_rows(self, key: str) -> list[dict[str, Any]]:
        rows = self._read(key, keep=False)
        if rows is None:
            raise RolloutRetiredError(f"the capture ledger of {key!r} is retired")
        return rows

    def export_rows(self, rollout_id: str) -> list[dict[str, Any]]:
        """Every row in commit order, read from the database (rows of its own, not the cache's);
        ``[]`` without a ledger. Blocking."""
        return self.export_rows_many([rollout_id])[0]

    def export_rows_many(self, rollout_ids: Sequence[str]) -> list[list[dict[str, Any]]]:
        """``export_rows`` of each id, in order, read in a few statements (fresh objects, not the
        cache's). Blocking.

        Raises:
            InvalidRolloutIdError: Any id is not a valid ledger key; nothing is read.
        """
        keys = [validate_ledger_key(key) for key in rollout_ids]
        with self._db.connection() as conn:
            return read_ledgers(conn, keys)

    def cache_sizes(self) -> dict[str, int]:
        """Sizes of the row cache (``ledger_rollouts``, ``ledger_rows``) for the metric."""
        return self._cache.sizes()

    # -- writing -------------------------------------------------------------------------------

    def _refresh_many(self, conn: sqlite3.Connection, keys: list[str]) -> dict[str, _Cached | None]:
        """Every key's cache entry brought up to date, read in one statement per 500 keys, and a
        copy of each to stage rows on (``None``: no row). Inside the write transaction."""
        marks = []
        for key in keys:
            cached = self._cache.get(key)
            marks.append((key, 0, 0) if cached is None else (key, cached.inode, cached.offset))
        found = read_since_many(conn, marks)
        staged: dict[str, _Cached | None] = {}
        for key, first, last in marks:
            with self._locks.hold(key):
                entry = self._cache.get(key)
                if ((0, 0) if entry is None else (entry.inode, entry.offset)) != (first, last):
                    entry = self._refresh(conn, key)  # a reader moved it meanwhile: read it alone
                else:
                    entry = self._merge(key, entry, first, found.get(key, []))
                staged[key] = None if entry is None else copy_entry(entry)
        return staged

    def _commit_group(self, group: list[PendingAppend]) -> None:
        """Commit a group from the commit thread in one transaction, then wake its callers.

        The transaction is a fixed handful of statements however many rows and keys it holds
        (D345): one read of every key's new rows, one of the empty keys' fences, one insert.
        """
        by_key: dict[str, list[PendingAppend]] = {}
        for item in group:
            by_key.setdefault(item.key, []).append(item)
        entries: dict[str, _Cached] = {}
        try:
            with self._db.writing() as conn:
                current = self._refresh_many(conn, list(by_key))
                empty = [key for key, entry in current.items() if entry is None or not entry.rows]
                fenced = fenced_keys(conn, empty) if empty else set()
                inserts: list[tuple[str, str, int, bytes]] = []
                owners: list[_Cached] = []
                for key, items in by_key.items():
                    staged, entry = stage_key(key, items, current[key], fenced.__contains__)
                    if not staged:
                        continue
                    assert entry is not None
                    rollout, attempt = split_attempt(key)
                    for item in staged:
                        inserts.append((key, rollout, attempt, item.line))
                        owners.append(entry)
                    entries[key] = entry
                for entry, seq in zip(owners, insert_rows(conn, inserts), strict=True):
                    if entry.inode == 0:
                        entry.inode = seq
                    entry.offset = seq
        except Exception as exc:  # the transaction failed: nothing of it is on disk
            for item in group:
                if item.error is None:
                    item.error = exc
        else:
            for key, entry in entries.items():
                with self._locks.hold(key):
                    self._cache.store(key, entry)
        settle_all(group)  # after the commit: a woken caller's row is durable

    def _append(self, key: str, row: dict[str, Any], *, failure: bool, staging_key: str) -> None:
        """Append one row from the calling thread (tests). Blocking."""
        item = PendingAppend(key, row, encode_row(row), failure, staging_key)
        self._commit_group([item])
        if item.error is not None:
            raise item.error

    # -- removal -------------------------------------------------------------------------------

    def _retire(self, keys: list[str]) -> RolloutRemoval:
        try:
            with self._db.writing() as conn:
                upsert_marks(conn, [_mark(key, fenced=1, started=0) for key in keys])
                self._on_step(RETIRE_STEPS[0])
                removed = keys_with_rows(conn, keys)
                delete_keys(conn, keys, marks=False)
                self._on_step(RETIRE_STEPS[1])
        finally:
            self._cache.pop_many(keys)
        return removal_result(keys, removed)

    def _remove(self, keys: list[str], *, unless_started: bool) -> RolloutRemoval:
        try:
            with self._db.writing() as conn:
                skipped = started_keys(conn, keys) if unless_started else set()
                doomed = [key for key in keys if key not in skipped]
                removed = keys_with_rows(conn, doomed)
                delete_keys(conn, doomed, marks=True)
        finally:
            self._cache.pop_many(keys)
        return removal_result(keys, removed, skipped)

    def _mark_started(self, key: str) -> bool:
        with self._db.writing() as conn:
            if self._fenced(conn, key):
                return False  # a retired attempt's calls are refused; its marker would linger
            conn.execute(_MARK, _mark(key, fenced=0, started=1))
            return True

    # -- restore -------------------------------------------------------------------------------

    def import_rows_many(self, ledgers: Mapping[str, Sequence[Mapping[str, Any]]]) -> None:
        """Install whole ledgers on a fresh server in one transaction. Blocking.

        The rows, fences and start markers of each target and of every later attempt of the same
        rollout belong to executions that died after an earlier restore; they go in the same
        transaction that installs the new rows, so a crash leaves the old state or the new.

        Raises:
            TypeError: ``ledgers`` is not a mapping.
            InvalidRolloutIdError: A key is invalid; nothing changed.
            ValueError: A row is malformed; nothing changed.
        """
        encoded = encode_ledger_rows(ledgers)
        floors: dict[str, int] = {}
        inserts: list[tuple[str, str, int, bytes]] = []
        for key, lines in encoded.items():
            rollout, attempt = split_attempt(key)
            floor = floors.get(rollout)
            if floor is None or attempt < floor:
                floors[rollout] = attempt
            if lines:
                inserts.extend((key, rollout, attempt, line) for line in lines)
        # Capture files a file-layout execution left in this directory (tokens, old ledgers).
        for key, suffixes in doomed_keys(os.listdir(self.root), list(encoded)).items():
            for suffix in suffixes:
                unlink_if_present(str(self.root / f"{key}{suffix}"))
        try:
            with self._db.writing() as conn:
                wipe_attempts(conn, list(floors.items()))
                insert_rows(conn, inserts)
        finally:
            self._cache.pop_many(encoded)

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def commit_threads(self) -> int:
        """How many threads commit appends (one: SQLite has one writer at a time)."""
        return self._committer.shards

    def close(self) -> None:
        """Answer queued reads, commit queued appends, drop the cache and close every
        connection; the file stays."""
        self._reads.close()
        self._committer.close()
        self._cache.clear()
        self._db.close()
