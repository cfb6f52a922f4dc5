"""The SQLite ledger's database: its schema, and a pool of connections that serve one thread each.

Every connection runs with ``synchronous=FULL`` (a commit is on disk before it returns) unless a
CPU benchmark asks for ``OFF``. One writer per process at a time holds a thread lock: SQLite's
busy handler sleeps in milliseconds, so this process's writers queue on the lock and only other
processes meet the busy timeout.
"""

from __future__ import annotations

import json
import queue
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final, Literal

from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_random_exponential

from protocols import decode_json

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

READ_MANY_KEYS: Final = 500
"""Keys per statement of the reads that return rows: bounds the text one statement returns."""
WRITE_MANY_KEYS: Final = 65_536
"""Keys per statement of the writes (marks, deletes, an import's wipe) and of the reads that
return keys alone. Each statement is a cursor step, and a step beside a busy event loop can wait
the switch interval for the GIL; these return at most their keys, so one statement takes a
whole restore or retire (D454)."""
INSERT_MANY_ROWS: Final = 2048
"""Rows per statement of :func:`insert_rows`."""

# Python's ``sqlite3`` lets go of the GIL around every step of a cursor, and a thread taking it
# back waits behind a busy event loop for up to the switch interval (5 ms) each time. So the
# statements below take many keys or rows at once, as a JSON array, and the reads return their
# rows joined into one text: one step per statement, not one per key or per row (D345). Every
# line is JSON ending in a newline and keys are safe names, so a row comes back as
# ``key<TAB>seq<TAB>line``.
_READ_SINCE_MANY: Final = (
    "SELECT group_concat(r.key || char(9) || r.seq || char(9) || CAST(r.line AS TEXT), '') "
    "FROM json_each(?) AS j JOIN rows AS r ON r.key = json_extract(j.value, '$[0]') "
    "AND (r.seq = json_extract(j.value, '$[1]') OR r.seq > json_extract(j.value, '$[2]'))"
)
_READ_SINCE_ONE: Final = (
    "SELECT group_concat(seq || char(9) || CAST(line AS TEXT), '') FROM rows "
    "WHERE key = ? AND (seq = ? OR seq > ?)"
)
"""``_READ_SINCE_MANY`` for one key, the common case (a resolve, a manifest): the index
``rows_by_key`` answers it without unpacking a JSON array, about 6 µs a read instead of 13."""
_FENCED_MANY: Final = (
    "SELECT group_concat(key, char(9)) FROM marks "
    "WHERE fenced AND key IN (SELECT value FROM json_each(?))"
)
_STARTED_MANY: Final = (
    "SELECT group_concat(key, char(9)) FROM marks "
    "WHERE started AND key IN (SELECT value FROM json_each(?))"
)
_INSERT_MANY: Final = (
    "INSERT INTO rows (key, rollout, attempt, line) "
    "SELECT json_extract(j.value, '$[0]'), json_extract(j.value, '$[1]'), "
    "json_extract(j.value, '$[2]'), "
    "substr(?2, json_extract(j.value, '$[3]'), json_extract(j.value, '$[4]')) "
    "FROM json_each(?1) AS j ORDER BY j.key"
)
"""Many rows in one step: ``?1`` a JSON array of ``[key, rollout, attempt, start, length]``,
``?2`` every row's line joined into one blob, which ``start`` (from 1) and ``length`` cut in
bytes. The lines never pass through JSON, so neither side escapes or parses them (D452)."""

_INSERT_ONE: Final = "INSERT INTO rows (key, rollout, attempt, line) VALUES (?, ?, ?, ?)"

Fetched = dict[str, list[tuple[int, str]]]
"""Per key, its ``(seq, line)`` pairs in commit order."""


def _batches(items: Sequence[Any], size: int | None = None) -> Iterator[str]:
    """``items`` as JSON arrays of at most ``size`` (``READ_MANY_KEYS``) each; a tuple is an
    array too."""
    size = size or READ_MANY_KEYS
    for start in range(0, len(items), size):
        yield json.dumps(list(items[start : start + size]))


def _inserted(seq: int | None) -> int:
    if seq is None:
        raise RuntimeError("an insert reported no sequence number")
    return seq


def read_since_many(conn: sqlite3.Connection, marks: Sequence[tuple[str, int, int]]) -> Fetched:
    """For each ``(key, first, last)``: the key's row ``first`` if it is still there, and every
    row after ``last`` (``(key, 0, 0)``: all its rows). Keys without such rows are left out;
    each key may appear once."""
    found: Fetched = {}
    if len(marks) == 1:
        key, first, last = marks[0]
        (text,) = conn.execute(_READ_SINCE_ONE, (key, first, last)).fetchone()
        if text:
            lines = [entry.split("\t", 1) for entry in text.split("\n")[:-1]]
            found[key] = sorted((int(seq), line) for seq, line in lines)
        return found
    for chunk in _batches(marks):
        (text,) = conn.execute(_READ_SINCE_MANY, (chunk,)).fetchone()
        for entry in (text or "").split("\n")[:-1]:  # each row ends in a newline
            key, seq, line = entry.split("\t", 2)
            found.setdefault(key, []).append((int(seq), line))
    for lines in found.values():
        lines.sort()  # group_concat promises no order: the sequence does
    return found


def parse_lines(lines: Sequence[str]) -> list[dict[str, Any]]:
    """The rows of ledger lines, parsed as one JSON array."""
    rows: list[dict[str, Any]] = decode_json("[" + ",".join(lines) + "]")
    return rows


def read_ledgers(conn: sqlite3.Connection, keys: Sequence[str]) -> list[list[dict[str, Any]]]:
    """The rows of each key in commit order, one statement per 500 keys."""
    found = read_since_many(conn, [(key, 0, 0) for key in dict.fromkeys(keys)])
    return [parse_lines([line for _, line in found.get(key, ())]) for key in keys]


def fenced_keys(conn: sqlite3.Connection, keys: Sequence[str]) -> set[str]:
    """Which of ``keys`` carry a fence, one statement per ``WRITE_MANY_KEYS`` keys."""
    return _marked(conn, _FENCED_MANY, keys)


def started_keys(conn: sqlite3.Connection, keys: Sequence[str]) -> set[str]:
    """Which of ``keys`` carry a start marker, one statement per ``WRITE_MANY_KEYS`` keys."""
    return _marked(conn, _STARTED_MANY, keys)


def _marked(conn: sqlite3.Connection, statement: str, keys: Sequence[str]) -> set[str]:
    found: set[str] = set()
    for chunk in _batches(keys, WRITE_MANY_KEYS):
        (text,) = conn.execute(statement, (chunk,)).fetchone()
        found.update(text.split("\t") if text else ())
    return found


_KEYS_WITH_ROWS: Final = (
    "SELECT group_concat(key, char(9)) FROM (SELECT DISTINCT key FROM rows "
    "WHERE key IN (SELECT value FROM json_each(?)))"
)
_DELETE_ROWS: Final = "DELETE FROM rows WHERE key IN (SELECT value FROM json_each(?))"
_DELETE_MARKS: Final = "DELETE FROM marks WHERE key IN (SELECT value FROM json_each(?))"
_MARK_MANY: Final = (
    "INSERT INTO marks (key, rollout, attempt, fenced, started) "
    "SELECT json_extract(j.value, '$[0]'), json_extract(j.value, '$[1]'), "
    "json_extract(j.value, '$[2]'), json_extract(j.value, '$[3]'), json_extract(j.value, '$[4]') "
    "FROM json_each(?) AS j WHERE true "  # WHERE: an upsert after a SELECT needs one to parse
    "ON CONFLICT (key) DO UPDATE SET fenced = max(fenced, excluded.fenced), "
    "started = max(started, excluded.started)"
)
_WIPE_ROWS: Final = (
    "DELETE FROM rows WHERE seq IN (SELECT r.seq FROM json_each(?) AS j JOIN rows AS r "
    "ON r.rollout = json_extract(j.value, '$[0]') AND r.attempt >= json_extract(j.value, '$[1]'))"
)
_WIPE_MARKS: Final = (
    "DELETE FROM marks WHERE key IN (SELECT m.key FROM json_each(?) AS j JOIN marks AS m "
    "ON m.rollout = json_extract(j.value, '$[0]') AND m.attempt >= json_extract(j.value, '$[1]'))"
)


def keys_with_rows(conn: sqlite3.Connection, keys: Sequence[str]) -> set[str]:
    """Which of ``keys`` have at least one row, one statement per ``WRITE_MANY_KEYS`` keys."""
    return _marked(conn, _KEYS_WITH_ROWS, keys)


def delete_keys(conn: sqlite3.Connection, keys: Sequence[str], *, marks: bool) -> None:
    """Delete the rows (and with ``marks`` the marks) of ``keys``, one statement per
    ``WRITE_MANY_KEYS``."""
    for chunk in _batches(keys, WRITE_MANY_KEYS):
        conn.execute(_DELETE_ROWS, (chunk,))
        if marks:
            conn.execute(_DELETE_MARKS, (chunk,))


def upsert_marks(conn: sqlite3.Connection, marks: Sequence[tuple[str, str, int, int, int]]) -> None:
    """Set ``(key, rollout, attempt, fenced, started)`` marks; a set flag is never cleared."""
    for chunk in _batches(marks, WRITE_MANY_KEYS):
        conn.execute(_MARK_MANY, (chunk,))


def wipe_attempts(conn: sqlite3.Connection, floors: Sequence[tuple[str, int]]) -> None:
    """Delete the rows and marks of every ``(rollout, attempt)`` and of its later attempts."""
    for chunk in _batches(floors, WRITE_MANY_KEYS):
        conn.execute(_WIPE_ROWS, (chunk,))
        conn.execute(_WIPE_MARKS, (chunk,))


def insert_rows(conn: sqlite3.Connection, rows: Sequence[tuple[str, str, int, bytes]]) -> list[int]:
    """Insert ``(key, rollout, attempt, line)`` rows in order, inside the caller's transaction;
    the sequence number each got, in the same order.

    ``AUTOINCREMENT`` gives every new row a number above any the table ever held, so the rows
    above the largest number before the insert are exactly these (the transaction holds the
    write lock), in the order they went in.
    """
    if len(rows) <= 1:  # one row is one step anyway, and its number comes with it
        return [_inserted(conn.execute(_INSERT_ONE, row).lastrowid) for row in rows]
    (before,) = conn.execute("SELECT coalesce(max(seq), 0) FROM rows").fetchone()
    for start in range(0, len(rows), INSERT_MANY_ROWS):
        chunk = rows[start : start + INSERT_MANY_ROWS]
        where: list[list[str | int]] = []
        at = 1
        for key, rollout, attempt, line in chunk:
            where.append([key, rollout, attempt, at, len(line)])
            at += len(line)
        conn.execute(_INSERT_MANY, (json.dumps(where), b"".join([row[3] for row in chunk])))
    (text,) = conn.execute("SELECT group_concat(seq) FROM rows WHERE seq > ?", (before,)).fetchone()
    seqs = sorted(int(seq) for seq in text.split(","))
    if len(seqs) != len(rows):
        raise RuntimeError(f"{len(rows)} rows inserted but {len(seqs)} new sequence numbers")
    return seqs


def _refused_at_once(error: BaseException) -> bool:
    """SQLite answered busy or locked (its extended codes included)."""
    return isinstance(error, sqlite3.OperationalError) and (error.sqlite_errorcode & 0xFF) in (
        sqlite3.SQLITE_BUSY,
        sqlite3.SQLITE_LOCKED,
    )


def _enter_wal(conn: sqlite3.Connection) -> None:
    """Put the database in WAL mode, waiting out other processes that open it at the same moment.

    Leaving the rollback journal takes a write lock over a read lock already held, and SQLite
    refuses that at once, without its busy handler, while another connection holds a write lock
    (so two such connections cannot wait on each other forever). Processes that create one
    ledger together meet it; the switch is idempotent, so it is retried until the busy timeout
    (D431).
    """
    for attempt in Retrying(
        retry=retry_if_exception(_refused_at_once),
        stop=stop_after_delay(BUSY_TIMEOUT_S),
        wait=wait_random_exponential(multiplier=0.005, max=0.25),
        reraise=True,
    ):
        with attempt:
            conn.execute("PRAGMA journal_mode = WAL")


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
            _enter_wal(conn)
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
