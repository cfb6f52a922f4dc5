"""The in-memory capture ledger: the file ledger's observable semantics, for one process.

Valid only for a model server that runs as a single process (nothing is shared across
processes) and for tests. Rows are kept whole; there is no cache to bound.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import structlog

from protocols import (
    CaptureLedgerCommit,
    LineageResolution,
    RequestItems,
    RolloutManifest,
    RolloutRemoval,
    RolloutRetiredError,
    custody_row,
    encode_row,
    failure_row,
    manifest_from_rows,
    resolve_explicit_rows,
    resolve_rows,
    validate_ledger_key,
    validate_ledger_keys,
)

from .common import (
    LEDGER_SUFFIX,
    RETIRED_SUFFIX,
    STARTED_SUFFIX,
    check_repeat,
    doomed_keys,
    encode_ledger_batch,
    removal_result,
)
from .locks import StripedThreadLocks
from .threaded import RETIRED_UNRESOLVED

_log = structlog.get_logger("midflight.ledger")


class MemoryCaptureLedger:
    """A capture ledger held in memory, thread-safe, one process only."""

    def __init__(self) -> None:
        self._ledgers: dict[str, list[dict[str, Any]]] = {}
        self._fences: set[str] = set()
        self._started: set[str] = set()
        self._locks = StripedThreadLocks()

    def cache_sizes(self) -> dict[str, int]:
        """Always empty: the in-memory ledger has no cache (its rows are the ledger)."""
        return {"ledger_rollouts": 0, "ledger_rows": 0}

    def _append(self, key: str, row: dict[str, Any], *, failure: bool, staging_key: str) -> None:
        encode_row(row)  # the file ledger refuses what JSON cannot hold; so does this one
        with self._locks.hold(key):
            rows = self._ledgers.get(key)
            if rows:
                same = [r for r in rows if r.get("model_call_id") == row["model_call_id"]]
                if check_repeat(same, row, failure):
                    return
            elif key in self._fences:
                _log.warning(
                    "ledger_late_write_discarded",
                    rollout_id=key,
                    model_call_id=row["model_call_id"],
                    staging_key=staging_key,
                )
                return
            self._ledgers.setdefault(key, []).append(row)

    async def record(self, commit: CaptureLedgerCommit) -> None:
        """Append a committed call; see ``FileCaptureLedger.record``."""
        self._append(
            commit.rollout_id,
            custody_row(commit),
            failure=False,
            staging_key=commit.record.staging_key,
        )

    async def record_failure(self, rollout_id: str, model_call_id: str, reason: str) -> None:
        """Append a failure row; see ``FileCaptureLedger.record_failure``."""
        key = validate_ledger_key(rollout_id)
        self._append(key, failure_row(model_call_id, reason), failure=True, staging_key="")

    def _manifest_rows(self, key: str) -> list[dict[str, Any]]:
        with self._locks.hold(key):
            if key in self._fences:
                raise RolloutRetiredError(f"the capture ledger of {key!r} is retired")
            return list(self._ledgers.get(key, ()))

    async def manifest(self, rollout_id: str) -> RolloutManifest:
        """The manifest; ``RolloutRetiredError`` when retired, empty when absent."""
        key = validate_ledger_key(rollout_id)
        return manifest_from_rows(key, self._manifest_rows(key))

    async def has_rows(self, rollout_id: str) -> bool:
        """Whether any row exists; ``RolloutRetiredError`` when retired."""
        return bool(self._manifest_rows(validate_ledger_key(rollout_id)))

    def _resolvable_rows(self, key: str) -> list[dict[str, Any]] | None:
        with self._locks.hold(key):
            rows = self._ledgers.get(key)
            if not rows and key in self._fences:
                return None
            return list(rows or ())

    async def resolve(self, rollout_id: str, request_items: RequestItems) -> LineageResolution:
        """Which recorded call the request continues."""
        rows = self._resolvable_rows(validate_ledger_key(rollout_id))
        return RETIRED_UNRESOLVED if rows is None else resolve_rows(rows, request_items)

    async def resolve_explicit(
        self, source_capture_key: str, parent_call_id: str, request_items: RequestItems
    ) -> LineageResolution:
        """Check a named parent in ``source_capture_key``'s ledger."""
        rows = self._resolvable_rows(validate_ledger_key(source_capture_key))
        if rows is None:
            return RETIRED_UNRESOLVED
        return resolve_explicit_rows(rows, parent_call_id, request_items)

    def export_rows(self, rollout_id: str) -> list[dict[str, Any]]:
        """Every row in commit order (copies)."""
        key = validate_ledger_key(rollout_id)
        with self._locks.hold(key):
            return copy.deepcopy(self._ledgers.get(key, []))

    def export_rows_many(self, rollout_ids: Sequence[str]) -> list[list[dict[str, Any]]]:
        """``export_rows`` of each id, in order; every id is checked before any is read."""
        keys = [validate_ledger_key(key) for key in rollout_ids]
        return [self.export_rows(key) for key in keys]

    async def retire(self, rollout_ids: Sequence[str]) -> RolloutRemoval:
        """Fence every key, then remove their ledgers (two phases, as on disk)."""
        keys = validate_ledger_keys(rollout_ids)
        groups = self._locks.by_stripe(keys)
        for stripe, group in groups.items():
            with self._locks.hold_stripe(stripe):
                self._fences.update(group)
        removed: set[str] = set()
        for stripe, group in groups.items():
            with self._locks.hold_stripe(stripe):
                for key in group:
                    if key in self._fences and self._ledgers.pop(key, None) is not None:
                        removed.add(key)
        return removal_result(keys, removed)

    def _remove(self, rollout_ids: Sequence[str], *, unless_started: bool) -> RolloutRemoval:
        keys = validate_ledger_keys(rollout_ids)
        removed: set[str] = set()
        skipped: set[str] = set()
        for stripe, group in self._locks.by_stripe(keys).items():
            with self._locks.hold_stripe(stripe):
                for key in group:
                    if unless_started and key in self._started:
                        skipped.add(key)
                        continue
                    if self._ledgers.pop(key, None) is not None:
                        removed.add(key)
                    self._fences.discard(key)
                    self._started.discard(key)
        return removal_result(keys, removed, skipped)

    async def delete(self, rollout_ids: Sequence[str]) -> RolloutRemoval:
        """Remove ledgers, fences and start markers."""
        return self._remove(rollout_ids, unless_started=False)

    async def delete_unstarted(self, rollout_ids: Sequence[str]) -> RolloutRemoval:
        """``delete`` for keys not marked started; started keys are in neither list."""
        return self._remove(rollout_ids, unless_started=True)

    async def mark_started(self, rollout_id: str) -> bool:
        """Mark a restored attempt started; ``False`` when retired."""
        key = validate_ledger_key(rollout_id)
        with self._locks.hold(key):
            if key in self._fences:
                return False
            self._started.add(key)
            return True

    def import_rows(self, rollout_id: str, rows: Sequence[Mapping[str, Any]]) -> None:
        """``import_rows_many({rollout_id: rows})``."""
        self.import_rows_many({rollout_id: rows})

    def import_rows_many(self, ledgers: Mapping[str, Sequence[Mapping[str, Any]]]) -> None:
        """Install whole ledgers, wiping targets and later attempts first (as on disk)."""
        encode_ledger_batch(ledgers)  # validates everything before any change
        present = {
            f"{key}{suffix}"
            for keys, suffix in (
                (self._ledgers, LEDGER_SUFFIX),
                (self._fences, RETIRED_SUFFIX),
                (self._started, STARTED_SUFFIX),
            )
            for key in keys
        }
        for key in doomed_keys(present, list(ledgers)):
            with self._locks.hold(key):
                self._ledgers.pop(key, None)
                self._fences.discard(key)
                self._started.discard(key)
        for key, rows in ledgers.items():
            if rows:
                with self._locks.hold(key):
                    self._ledgers[key] = [copy.deepcopy(dict(row)) for row in rows]

    def close(self) -> None:
        """Nothing to release."""
