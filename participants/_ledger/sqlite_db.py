"""The SQLite ledger's database: its schema, and a pool of connections that serve one thread each.

Every connection runs with ``synchronous=FULL`` (a commit is on disk before it returns) unless a
CPU benchmark asks for ``OFF``. One writer per process at a time holds a thread lock: SQLite's
busy handler sleeps in milliseconds, so this process's writers queue on the lock and only other
processes meet the busy timeout.
"""

from __future__ import annotations

import queue
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Final, Literal

from .._storage.durable import make_directory_durable

SCHEMA_VERSION: Final = 1
BUSY_TIMEOUT_S: Final = 30.0
"""How long a write waits for another process's transaction before it fails."""

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS rows (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    key TEXT NOT NULL,
    rollout TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    line BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS rows_by_key ON rows (key, seq);
CREATE INDEX IF NOT EXISTS rows_by_rollout ON rows (rollout, attempt);
CREATE TABLE IF NOT EXISTS marks (
    key TEXT PRIMARY KEY,
    rollout TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    fenced INTEGER NOT NULL,
    started INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS marks_by_rollout ON marks (rollout, attempt);
"""


class LedgerDatabase:
    """One ledger database file: created with its schema, then pooled connections.

    Args:
        path: The database file (its directory exists).
        synchronous: ``FULL``, or ``OFF`` for CPU benchmarks only.

    Raises:
        RuntimeError: The file holds another schema version.
    """

    def __init__(self, path: Path, *, synchronous: Literal["FULL", "OFF"] = "FULL") -> None:
        if synchronous not in ("FULL", "OFF"):
            raise ValueError("synchronous must be FULL or OFF")
        self.path = path
        self.root = path.parent
        self._synchronous = synchronous
        self._idle: queue.SimpleQueue[sqlite3.Connection] = queue.SimpleQueue()
        self._all: list[sqlite3.Connection] = []
        self._guard = threading.Lock()
        self._write_lock = threading.Lock()
        self._closed = False
        self._create()

    def _create(self) -> None:
        new = not self.path.exists()
        with self.connection() as conn, self._write_lock:
            conn.execute("PRAGMA journal_mode = WAL")
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION):
                raise RuntimeError(
                    f"{self.path} holds ledger schema {version}; this code reads {SCHEMA_VERSION}"
                )
            conn.execute("BEGIN IMMEDIATE")
            try:
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        if new:
            make_directory_durable(self.root)  # the database's name survives a crash too

    def _open(self) -> sqlite3.Connection:
        conn = sqlite3.connect(
            self.path,
            timeout=BUSY_TIMEOUT_S,
            isolation_level=None,  # transactions are explicit: BEGIN IMMEDIATE … COMMIT
            check_same_thread=False,  # a pooled connection serves one thread at a time
            cached_statements=32,
        )
        # FULL: a commit is on disk before it returns (OFF only for CPU benchmarks).
        conn.execute(f"PRAGMA synchronous = {self._synchronous}")
        with self._guard:
            if self._closed:
                conn.close()
                raise RuntimeError("the capture ledger is closed")
            self._all.append(conn)
        return conn

    @contextmanager
    def connection(self) -> Iterator[sqlite3.Connection]:
        if self._closed:
            raise RuntimeError("the capture ledger is closed")
        try:
            conn = self._idle.get_nowait()
        except queue.Empty:
            conn = self._open()
        try:
            yield conn
        finally:
            self._idle.put(conn)

    @contextmanager
    def writing(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, committed durably on a clean exit and rolled back otherwise."""
        with self.connection() as conn, self._write_lock:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise

    def close(self) -> None:
        """Close every connection; the file stays."""
        with self._guard:
            self._closed = True
            connections, self._all = self._all, []
        for conn in connections:
            conn.close()
