"""Staging a commit group's rows of one key, for both layouts: which rows are written (repeats
and late rows are no-ops, a conflict fails only its own caller), added to the key's cache entry
so later rows of the group see them."""

from __future__ import annotations

from collections.abc import Callable

import structlog

from .cache import CachedLedger as _Cached
from .common import check_repeat
from .group import PendingAppend

_log = structlog.get_logger("midflight.ledger")


def copy_entry(entry: _Cached) -> _Cached:
    """A cache entry to stage rows on without touching the one readers see."""
    return _Cached(
        inode=entry.inode,
        offset=entry.offset,
        rows=list(entry.rows),
        by_call_id={call: list(rows) for call, rows in entry.by_call_id.items()},
    )


def stage_key(
    key: str, items: list[PendingAppend], entry: _Cached | None, fenced: Callable[[str], bool]
) -> tuple[list[PendingAppend], _Cached | None]:
    """The rows of ``items`` to write, each added to ``entry`` (a new one if ``None``).

    ``fenced(key)`` is asked at most once, and only while the ledger is empty: a retire removes a
    ledger only after (file) or together with (SQLite) its durable fence, so rows mean "not
    retired".
    """
    staged: list[PendingAppend] = []
    retired: bool | None = None
    for item in items:
        row = item.row
        if entry is not None and entry.rows:
            try:
                if check_repeat(entry.by_call_id.get(row["model_call_id"]), row, item.failure):
                    continue
            except ValueError as exc:
                item.error = exc  # this caller's conflict; its neighbours go on
                continue
        else:
            retired = fenced(key) if retired is None else retired
            if retired:
                _log.warning(
                    "ledger_late_write_discarded",
                    rollout_id=key,
                    model_call_id=row["model_call_id"],
                    staging_key=item.staging_key,
                )
                continue
        if entry is None:
            entry = _Cached(inode=0, offset=0)
        entry.add(row)  # later rows of this group see it (repeats, conflicts)
        staged.append(item)
    return staged, entry
