"""The file-backed capture ledger: one directory shared by every process of a model server.

Per capture key ``<id>``: ``<id>.lineage.jsonl`` (the ledger, one JSON row per line in commit
order), ``<id>.lineage.retired`` (an empty fence: the key is retired and late rows are discarded)
and ``<id>.lineage.started`` (an empty start marker of a restored attempt). Locks are the fixed
stripe files of ``_ledger_locks``; no per-key lock file exists. The state machine and the
durability argument are in ``docs/capture-ledger.md``.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from protocols import (
    RolloutRetiredError,
    decode_json,
    encode_row,
    validate_ledger_key,
)

from .cache import DEFAULT_MAX_CACHED_ROLLOUTS, DEFAULT_MAX_CACHED_ROWS
from .cache import CachedLedger as _Cached
from .common import (
    LEDGER_SUFFIX,
    write_all,
)
from .group import (
    DEFAULT_COMMIT_THREADS,
    DEFAULT_MAX_COMMIT_BATCH,
    GroupCommitter,
    PendingAppend,
)
from .locks import DEFAULT_STRIPES
from .reads import FILE_LAYOUT_READ_THREADS, ReadPool
from .removal import LedgerDirectory
from .staging import stage_key

_log = structlog.get_logger("midflight.ledger")


def _parse_lines(data: bytes) -> tuple[list[dict[str, Any]], int]:
    """The rows of whole ledger lines in ``data`` and how many bytes they take.

    A torn last line (a crash mid-write) is left out. The lines are parsed as one JSON array:
    an encoded row never holds a raw newline (``encode_row`` escapes it), so the array is the
    rows in order, and one decoder call costs less than one per line.
    """
    complete = data.rfind(b"\n") + 1
    if complete == 0:
        return [], 0
    rows: list[dict[str, Any]] = decode_json(
        b"[" + data[: complete - 1].replace(b"\n", b",") + b"]"
    )
    return rows, complete


class FileCaptureLedger(LedgerDirectory):
    """A capture ledger in one directory, safe for many threads and processes.

    Args:
        root: The ledger directory (created if missing).
        stripes: Number of stripe lock files; the same for every process sharing ``root``.
        max_cached_rollouts: Bound of the row cache, in ledgers.
        max_cached_rows: Bound of the row cache, in rows.
        on_step: Called with each name of ``RETIRE_STEPS`` (tests only).
        commit_threads: Group-commit shards, each with its own thread (``_ledger_group``).
        max_commit_batch: Most appends one shard commits as a group.
    """

    def __init__(
        self,
        root: Path,
        *,
        stripes: int = DEFAULT_STRIPES,
        max_cached_rollouts: int = DEFAULT_MAX_CACHED_ROLLOUTS,
        max_cached_rows: int = DEFAULT_MAX_CACHED_ROWS,
        on_step: Callable[[str], None] | None = None,
        commit_threads: int = DEFAULT_COMMIT_THREADS,
        max_commit_batch: int = DEFAULT_MAX_COMMIT_BATCH,
    ) -> None:
        super().__init__(
            root,
            stripes=stripes,
            max_cached_rollouts=max_cached_rollouts,
            max_cached_rows=max_cached_rows,
            on_step=on_step,
        )
        self._committer = GroupCommitter(
            self._commit_group, shards=commit_threads, max_batch=max_commit_batch
        )
        self._reads = ReadPool(threads=FILE_LAYOUT_READ_THREADS)

    # -- paths and small helpers ------------------------------------------------------------

    @property
    def commit_threads(self) -> int:
        """How many group-commit shards (each with its own thread) append rows."""
        return self._committer.shards

    def _commit_stripe(self, key: str) -> int:
        return self._locks.stripe(key)

    def commit_shard(self, key: str) -> int:
        """The group-commit shard whose thread appends the rows of ``key``."""
        return self._locks.stripe(key) % self._committer.shards

    def cache_sizes(self) -> dict[str, int]:
        """Sizes of the row cache (``ledger_rollouts``, ``ledger_rows``) for the metric."""
        return self._cache.sizes()

    # -- reading ------------------------------------------------------------------------------

    def _refresh(self, key: str, fd: int) -> _Cached:
        """The rows of the open ledger ``fd``, parsing only what was appended since last time."""
        status = os.fstat(fd)
        entry = self._cache.get(key)
        if entry is None or entry.inode != status.st_ino or entry.offset > status.st_size:
            entry = _Cached(inode=status.st_ino, offset=0)
        if entry.offset < status.st_size:
            rows, consumed = _parse_lines(os.pread(fd, status.st_size - entry.offset, entry.offset))
            for row in rows:
                entry.add(row)
            entry.offset += consumed
            self._cache.store(key, entry)
        return entry

    def _rows_locked(self, key: str) -> list[dict[str, Any]] | None:
        """The rows of ``key``, or ``None`` when it has no ledger file."""
        try:
            fd = os.open(self._path(key, LEDGER_SUFFIX), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            return self._refresh(key, fd).rows
        finally:
            os.close(fd)

    def _rows_read_through(self, key: str) -> list[dict[str, Any]] | None:
        """``_rows_locked`` for reads that append nothing (manifest, has_rows, export).

        A cached ledger is refreshed as usual; an uncached one is parsed and *not* stored: a
        rollout this process did not serve is read once at its end (its manifest, its export)
        and would only push the ledgers it is serving out of the bounded cache (D256).
        """
        if key in self._cache:
            return self._rows_locked(key)
        try:
            fd = os.open(self._path(key, LEDGER_SUFFIX), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            return _parse_lines(os.pread(fd, size, 0) if size else b"")[0]
        finally:
            os.close(fd)

    # -- writing ------------------------------------------------------------------------------

    def _append_group(self, key: str, items: list[PendingAppend]) -> None:
        """Append the rows of one ledger under its stripe lock with one fsync.

        A refused row (a conflicting repeat) gets its own ``error`` and the others go on; rows
        already present and late rows of a retired key are no-ops. Raises only for what fails
        the whole group (an I/O error), leaving the caller to hand it to every row.
        """
        path = self._path(key, LEDGER_SUFFIX)
        stripe = self._locks.acquire(key)
        try:
            try:
                fd: int | None = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC)
            except FileNotFoundError:
                fd = None
            try:
                entry = self._refresh(key, fd) if fd is not None else None
                staged, entry = stage_key(key, items, entry, self._fenced)
                lines = [item.line for item in staged]
                if not lines:
                    return
                assert entry is not None
                created = fd is None
                if fd is None:
                    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
                    entry.inode = os.fstat(fd).st_ino
                data = b"".join(lines)
                try:
                    write_all(fd, data)
                    # The rows must survive a crash before any of their callers is woken.
                    os.fsync(fd)
                    if created:
                        self._sync_root()  # and so must the new ledger's name
                except BaseException:
                    self._cache.pop(key)  # the cached rows may not be on disk: read them again
                    raise
                entry.offset += len(data)
                self._cache.store(key, entry)
            finally:
                if fd is not None:
                    os.close(fd)
        finally:
            self._locks.release(stripe)

    def _commit_group(self, group: list[PendingAppend]) -> None:
        """Commit a group from the shard thread: per ledger one append, then wake its callers."""
        by_key: dict[str, list[PendingAppend]] = {}
        for item in group:
            by_key.setdefault(item.key, []).append(item)
        for key, items in by_key.items():
            try:
                self._append_group(key, items)
            except Exception as exc:  # this ledger's I/O failed: its callers hear, no one else
                for item in items:
                    if item.error is None:
                        item.error = exc
            for item in items:
                item.settle()  # after the fsync: a woken caller's row is durable

    def _append(self, key: str, row: dict[str, Any], *, failure: bool, staging_key: str) -> None:
        """Append one row from the calling thread (tests, and no group to join). Blocking."""
        item = PendingAppend(key, row, encode_row(row), failure, staging_key)
        self._append_group(key, [item])
        if item.error is not None:
            raise item.error

    # -- queries ------------------------------------------------------------------------------

    def _manifest_rows(self, key: str) -> list[dict[str, Any]]:
        with self._locks.hold(key):
            if self._fenced(key):
                raise RolloutRetiredError(f"the capture ledger of {key!r} is retired")
            return list(self._rows_read_through(key) or ())

    def _resolvable_rows(self, key: str) -> list[dict[str, Any]] | None:
        with self._locks.hold(key):
            rows = self._rows_locked(key)
            if not rows and self._fenced(key):
                return None
            return list(rows or ())

    def export_rows(self, rollout_id: str) -> list[dict[str, Any]]:
        """Every row in commit order (copies); ``[]`` without a ledger. Blocking."""
        key = validate_ledger_key(rollout_id)
        with self._locks.hold(key):
            return copy.deepcopy(self._rows_read_through(key) or [])

    def close(self) -> None:
        """Answer queued reads, commit queued appends, drop the cache and close descriptors; the
        files stay."""
        self._reads.close()
        self._committer.close()
        super().close()
