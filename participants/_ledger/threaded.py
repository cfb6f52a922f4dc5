"""The async surface both durable ledgers share: validate the ids, then do the file work in a thread.

``FileCaptureLedger`` and ``SqliteCaptureLedger`` differ in how they keep rows, fences and start
markers, not in what their async methods do around that: every id is validated before anything
changes, every blocking part runs off the event loop, appends go through the ledger's group
committer and reads through its read pool (D349). Each ledger supplies the blocking parts named
below.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, Final

import anyio.to_thread

from protocols import (
    CaptureLedgerCommit,
    LineageResolution,
    RequestItems,
    RolloutManifest,
    RolloutRemoval,
    custody_row,
    encode_row,
    failure_row,
    manifest_from_rows,
    resolve_explicit_rows,
    resolve_rows,
    validate_ledger_key,
    validate_ledger_keys,
)

from .group import GroupCommitter, PendingAppend
from .reads import ReadPool

RETIRED_UNRESOLVED: Final = LineageResolution(status="unresolved", reason="rollout_retired")


class ThreadedLedger:
    """The shared async methods; subclasses provide the blocking ``_…`` parts and a committer."""

    _committer: GroupCommitter
    _reads: ReadPool

    # -- the blocking parts each layout provides ---------------------------------------------------

    def _commit_stripe(self, key: str) -> int:
        """Which group-commit shard takes the appends of ``key``."""
        raise NotImplementedError

    def _manifest_rows(self, key: str) -> list[dict[str, Any]]:
        """The rows of ``key`` for a manifest; ``RolloutRetiredError`` when retired."""
        raise NotImplementedError

    def _resolvable_rows(self, key: str) -> list[dict[str, Any]] | None:
        """The rows of ``key`` to resolve against; ``None`` when it has none and is retired."""
        raise NotImplementedError

    def _retire(self, keys: list[str]) -> RolloutRemoval:
        raise NotImplementedError

    def _remove(self, keys: list[str], *, unless_started: bool) -> RolloutRemoval:
        raise NotImplementedError

    def _mark_started(self, key: str) -> bool:
        raise NotImplementedError

    def export_rows(self, rollout_id: str) -> list[dict[str, Any]]:
        """Every row in commit order (copies); ``[]`` without a ledger. Blocking."""
        raise NotImplementedError

    def export_rows_many(self, rollout_ids: Sequence[str]) -> list[list[dict[str, Any]]]:
        """``export_rows`` of each id, in order; every id is checked before any is read."""
        keys = [validate_ledger_key(key) for key in rollout_ids]
        return [self.export_rows(key) for key in keys]

    def import_rows_many(self, ledgers: Mapping[str, Sequence[Mapping[str, Any]]]) -> None:
        """Install whole ledgers on a fresh server. Blocking."""
        raise NotImplementedError

    # -- appending -------------------------------------------------------------------------------

    async def _submit(self, key: str, row: dict[str, Any], *, failure: bool, staging: str) -> None:
        # Encoded here, so a row JSON cannot hold fails its own caller before it is queued.
        item = PendingAppend(key, row, encode_row(row), failure, staging)
        await self._committer.submit(item, self._commit_stripe(key))

    async def record(self, commit: CaptureLedgerCommit) -> None:
        """Append a committed call; an identical repeat is a no-op.

        Concurrent appends are committed in groups (see ``docs/capture-ledger.md``); the call
        returns only once its row is durable.

        Raises:
            ValueError: A different row with the same ``model_call_id`` exists ("conflicting").
        """
        row = custody_row(commit)
        await self._submit(commit.rollout_id, row, failure=False, staging=commit.record.staging_key)

    async def record_failure(self, rollout_id: str, model_call_id: str, reason: str) -> None:
        """Append a failure row; an identical one already present is a no-op."""
        key = validate_ledger_key(rollout_id)
        await self._submit(key, failure_row(model_call_id, reason), failure=True, staging="")

    # -- queries ---------------------------------------------------------------------------------

    async def manifest(self, rollout_id: str) -> RolloutManifest:
        """The manifest of ``rollout_id``; empty when it has no ledger.

        Raises:
            RolloutRetiredError: The key is retired.
        """
        key = validate_ledger_key(rollout_id)
        rows = await self._reads.run(partial(self._manifest_rows, key))
        return manifest_from_rows(key, rows)

    async def has_rows(self, rollout_id: str) -> bool:
        """Whether the key has any row. Raises ``RolloutRetiredError`` when retired."""
        key = validate_ledger_key(rollout_id)
        return bool(await self._reads.run(partial(self._manifest_rows, key)))

    async def resolve(self, rollout_id: str, request_items: RequestItems) -> LineageResolution:
        """Which recorded call of ``rollout_id`` the request continues."""
        key = validate_ledger_key(rollout_id)
        rows = await self._reads.run(partial(self._resolvable_rows, key))
        return RETIRED_UNRESOLVED if rows is None else resolve_rows(rows, request_items)

    async def resolve_explicit(
        self, source_capture_key: str, parent_call_id: str, request_items: RequestItems
    ) -> LineageResolution:
        """Check that the request continues ``parent_call_id`` of ``source_capture_key``."""
        key = validate_ledger_key(source_capture_key)
        rows = await self._reads.run(partial(self._resolvable_rows, key))
        if rows is None:
            return RETIRED_UNRESOLVED
        return resolve_explicit_rows(rows, parent_call_id, request_items)

    # -- removal and restore ---------------------------------------------------------------------

    async def retire(self, rollout_ids: Sequence[str]) -> RolloutRemoval:
        """Fence every key, then remove its ledger and cached rows (durable before it returns).

        Raises:
            TypeError: ``rollout_ids`` is a bare string.
            InvalidRolloutIdError: Any id is invalid; nothing changed.
        """
        keys = validate_ledger_keys(rollout_ids)
        if not keys:
            return RolloutRemoval()
        return await anyio.to_thread.run_sync(self._retire, keys)

    async def delete(self, rollout_ids: Sequence[str]) -> RolloutRemoval:
        """Remove ledgers, fences, start markers and cached rows; the keys read as unused."""
        keys = validate_ledger_keys(rollout_ids)
        if not keys:
            return RolloutRemoval()
        return await anyio.to_thread.run_sync(lambda: self._remove(keys, unless_started=False))

    async def delete_unstarted(self, rollout_ids: Sequence[str]) -> RolloutRemoval:
        """``delete`` for keys without a start marker; started keys are in neither list."""
        keys = validate_ledger_keys(rollout_ids)
        if not keys:
            return RolloutRemoval()
        return await anyio.to_thread.run_sync(lambda: self._remove(keys, unless_started=True))

    async def mark_started(self, rollout_id: str) -> bool:
        """Mark a restored attempt started; ``False`` (no marker) when the key is retired."""
        key = validate_ledger_key(rollout_id)
        return await anyio.to_thread.run_sync(self._mark_started, key)

    def import_rows(self, rollout_id: str, rows: Sequence[Mapping[str, Any]]) -> None:
        """``import_rows_many({rollout_id: rows})``. Blocking."""
        self.import_rows_many({rollout_id: rows})
