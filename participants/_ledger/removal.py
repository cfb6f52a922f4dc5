"""The ledger directory's lifecycle files: fences, start markers, removal and restore imports.

Everything here works on names in the directory rather than on rows: a retire writes fences and
syncs them before any ledger goes, a delete makes a key unused again, a start marker protects a
restored attempt from ``delete_unstarted``, and an import installs whole ledgers at once (D51).
``FileCaptureLedger`` adds the rows on top.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import structlog

from protocols import RolloutRemoval

from .._storage.durable import make_directory_durable
from .cache import RowCache
from .common import (
    LEDGER_SUFFIX,
    RETIRED_SUFFIX,
    STARTED_SUFFIX,
    doomed_keys,
    encode_ledger_batch,
    removal_result,
    unlink_if_present,
    write_all,
)
from .layout import refuse_other_layout
from .locks import StripedFileLocks
from .threaded import ThreadedLedger

_log = structlog.get_logger("midflight.ledger")

RETIRE_STEPS: Final = ("fences_synced", "ledgers_removed")
"""Named points of a retire; a test hook can freeze at each to prove crash safety."""


class LedgerDirectory(ThreadedLedger):
    """One ledger directory: its paths, stripe locks, row cache, and the name-level operations.

    Args:
        root: The ledger directory (created if missing).
        stripes: Number of stripe lock files; the same for every process sharing ``root``.
        max_cached_rollouts: Bound of the row cache, in ledgers.
        max_cached_rows: Bound of the row cache, in rows.
        on_step: Called with each name of ``RETIRE_STEPS`` (tests only).
    """

    def __init__(
        self,
        root: Path,
        *,
        stripes: int,
        max_cached_rollouts: int,
        max_cached_rows: int,
        on_step: Callable[[str], None] | None = None,
    ) -> None:
        self.root = Path(root)
        make_directory_durable(self.root)
        refuse_other_layout(self.root, this="file")
        self._prefix = f"{self.root}{os.sep}"
        self._locks = StripedFileLocks(self.root, stripes)
        self._cache = RowCache(max_cached_rollouts, max_cached_rows)
        self._dir_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._on_step = on_step or (lambda _name: None)

    # -- paths and small helpers ------------------------------------------------------------

    def _path(self, key: str, suffix: str) -> str:
        return f"{self._prefix}{key}{suffix}"

    def _fenced(self, key: str) -> bool:
        return os.path.exists(self._path(key, RETIRED_SUFFIX))

    def _sync_root(self) -> None:
        os.fsync(self._dir_fd)

    # -- removal ------------------------------------------------------------------------------

    def _retire(self, keys: list[str]) -> RolloutRemoval:
        groups = self._locks.by_stripe(keys)
        changed = False
        try:
            for stripe, group in groups.items():
                with self._locks.hold_stripe(stripe):
                    for key in group:
                        try:
                            fd = os.open(
                                self._path(key, RETIRED_SUFFIX),
                                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                                0o644,
                            )
                        except FileExistsError:
                            continue  # never touch an existing fence: retries write nothing
                        os.close(fd)
                        changed = True
            # Every fence must be durable before any ledger goes — also when this batch wrote
            # none, since an overlapping or crashed retire may have left unsynced fences.
            self._sync_root()
            self._on_step("fences_synced")
            removed: set[str] = set()
            for stripe, group in groups.items():
                with self._locks.hold_stripe(stripe):
                    for key in group:
                        self._cache.pop(key)
                        if not self._fenced(key):
                            continue  # a delete and a reuse came between: leave the new ledger
                        if unlink_if_present(self._path(key, LEDGER_SUFFIX)):
                            removed.add(key)
                            changed = True
            self._on_step("ledgers_removed")
            self._sync_root()  # the removals are durable before success is reported
        except BaseException:
            if changed:
                self._best_effort_sync("retire")
            raise
        return removal_result(keys, removed)

    def _remove(self, keys: list[str], *, unless_started: bool) -> RolloutRemoval:
        removed: set[str] = set()
        skipped: set[str] = set()
        try:
            for stripe, group in self._locks.by_stripe(keys).items():
                with self._locks.hold_stripe(stripe):
                    for key in group:
                        if unless_started and os.path.exists(self._path(key, STARTED_SUFFIX)):
                            skipped.add(key)
                            continue
                        self._cache.pop(key)
                        if unlink_if_present(self._path(key, LEDGER_SUFFIX)):
                            removed.add(key)
                        unlink_if_present(self._path(key, RETIRED_SUFFIX))
                        unlink_if_present(self._path(key, STARTED_SUFFIX))
        except BaseException:
            self._best_effort_sync("delete")
            raise
        # Every non-empty batch syncs, even when nothing was found: an earlier crashed delete
        # may have removed names without syncing, and a reused id must never see them return.
        self._sync_root()
        return removal_result(keys, removed, skipped)

    def _best_effort_sync(self, operation: str) -> None:
        try:
            self._sync_root()
        except OSError as exc:  # never mask the original error
            _log.error("ledger_sync_failed", operation=operation, error=str(exc))

    def _mark_started(self, key: str) -> bool:
        with self._locks.hold(key):
            if self._fenced(key):
                return False  # a retired attempt's calls are refused; its marker would linger
            fd = os.open(self._path(key, STARTED_SUFFIX), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC)
            os.close(fd)
            self._sync_root()  # a forgotten marker would let delete_unstarted drop a live ledger
            return True

    # -- restore ------------------------------------------------------------------------------

    def import_rows_many(self, ledgers: Mapping[str, Sequence[Mapping[str, Any]]]) -> None:
        """Install whole ledgers on a fresh server. Blocking.

        Capture files of each target and of every later attempt of the same rollout belong to
        executions that died after an earlier restore; they are deleted first, fences included.
        No per-file fsync: the checkpoint is the durable copy and a crash means importing again;
        one directory sync per batch makes the new names durable.

        Raises:
            TypeError: ``ledgers`` is not a mapping.
            InvalidRolloutIdError: A key is invalid; nothing changed.
            ValueError: A row is malformed; nothing changed.
        """
        encoded = encode_ledger_batch(ledgers)
        doomed = doomed_keys(os.listdir(self.root), list(encoded))
        # Every doomed file goes before any ledger is written (D51); each phase holds each
        # stripe once for the whole batch instead of once per key (D258).
        for stripe, group in self._locks.by_stripe(doomed).items():
            with self._locks.hold_stripe(stripe):
                for key in group:
                    self._cache.pop(key)
                    for suffix in doomed[key]:
                        unlink_if_present(self._path(key, suffix))
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        for stripe, group in self._locks.by_stripe(encoded).items():
            with self._locks.hold_stripe(stripe):
                for key in group:
                    self._cache.pop(key)
                    data = encoded[key]
                    if not data:
                        continue
                    fd = os.open(self._path(key, LEDGER_SUFFIX), flags, 0o644)
                    try:
                        write_all(fd, data)
                    finally:
                        os.close(fd)
        self._sync_root()  # one sync makes every removal and new name of the batch durable

    def close(self) -> None:
        """Drop the cache and close descriptors; the files stay."""
        self._cache.clear()
        self._locks.close()
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1
