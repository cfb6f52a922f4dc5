"""Which on-disk layout a ledger directory holds, and its live ledgers read without a ledger.

A directory holds one layout: the files of ``FileCaptureLedger`` (``<key>.lineage.jsonl`` and its
fence and start marker) or the one database of ``SqliteCaptureLedger`` (``ledger.sqlite3``).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path
from typing import Final

from protocols import MidflightError

from .common import LEDGER_SUFFIX, RETIRED_SUFFIX, STARTED_SUFFIX

SQLITE_DATABASE: Final = "ledger.sqlite3"
"""The one file of the SQLite layout (``SqliteCaptureLedger``)."""
_FILE_LAYOUT_SUFFIXES: Final = (LEDGER_SUFFIX, RETIRED_SUFFIX, STARTED_SUFFIX)


def refuse_other_layout(root: Path, *, this: str) -> None:
    """Refuse a directory that holds the other layout's ledgers: they would read as absent.

    Raises:
        LedgerLayoutError: ``root`` holds ledgers of the layout that is not ``this``.
    """
    if this == "file":
        if (root / SQLITE_DATABASE).exists():
            raise LedgerLayoutError(
                f"{root} holds a SQLite capture ledger ({SQLITE_DATABASE}); open it with the "
                "sqlite layout, or use another directory"
            )
        return
    with os.scandir(root) as entries:
        for entry in entries:
            if entry.name.endswith(_FILE_LAYOUT_SUFFIXES):
                raise LedgerLayoutError(
                    f"{root} holds file-layout capture ledgers ({entry.name}, …); open it with "
                    "the file layout, or use another directory"
                )


class LedgerLayoutError(MidflightError, RuntimeError):
    """A ledger directory holds the other on-disk layout."""


def live_ledger_keys(root: Path) -> list[str]:
    """The keys that have rows in ``root``, in either layout, sorted; ``[]`` without a ledger.

    Read-only and without a ledger object, for an oracle or an operator that must not change
    what it counts (the drill's leftover figure ``live_ledgers``).
    """
    database = root / SQLITE_DATABASE
    if database.exists():
        uri = f"{database.resolve().as_uri()}?mode=ro"
        with contextlib.closing(sqlite3.connect(uri, uri=True)) as conn:
            return [key for (key,) in conn.execute("SELECT DISTINCT key FROM rows ORDER BY key")]
    if not root.is_dir():
        return []
    return sorted(
        name.removesuffix(LEDGER_SUFFIX)
        for name in os.listdir(root)
        if name.endswith(LEDGER_SUFFIX)
    )
