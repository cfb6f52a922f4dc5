"""What the file-backed and in-memory ledgers share: names, repeat rules, restore planning."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from protocols import RolloutRemoval, encode_row, validate_ledger_keys, validate_row

LEDGER_SUFFIX: Final = ".lineage.jsonl"
RETIRED_SUFFIX: Final = ".lineage.retired"
STARTED_SUFFIX: Final = ".lineage.started"
CAPTURE_FILE_SUFFIXES: Final = (
    LEDGER_SUFFIX,
    STARTED_SUFFIX,
    RETIRED_SUFFIX,
    ".tokens.jsonl",
    ".tokens.incomplete",
    ".tokens.intents",
    ".tokens.state.json",
)
"""Every per-key file a dead execution can leave; lock files are stripes, never per key."""

_ATTEMPT: Final = re.compile(r"^(.+)-a([1-9][0-9]*)$")
_CAPTURE_NAME: Final = re.compile(
    r"(.+?)(?:-a([1-9][0-9]*))?("
    + "|".join(re.escape(suffix) for suffix in CAPTURE_FILE_SUFFIXES)
    + ")"
)
"""A capture file's name: rollout, attempt (absent for 0) and suffix, as ``split_attempt`` and
``CAPTURE_FILE_SUFFIXES`` read them (the shortest rollout that leaves an attempt and a suffix
is the longest key prefix ``split_attempt`` would strip, since both stop at the last ``-a<N>``)."""


def split_attempt(key: str) -> tuple[str, int]:
    """``"r-a2"`` → ``("r", 2)``; a key without the suffix is attempt 0 of itself.

    Exactly what ``_ATTEMPT.fullmatch`` splits, without the regular expression: a restore splits
    every one of its keys twice, once to wipe later attempts and once to fence earlier ones, and
    the match objects cost a third of that (D441). ``tests/participants/test_ledger.py`` checks
    the two agree.
    """
    rollout, separator, digits = key.rpartition("-a")
    if (
        separator
        and rollout
        and digits.isascii()
        and digits.isdigit()
        and digits[0] != "0"
        and "\n" not in rollout
    ):
        return rollout, int(digits)
    return key, 0


def check_repeat(existing: list[dict[str, Any]] | None, row: dict[str, Any], failure: bool) -> bool:
    """Whether ``row`` is already recorded (so the write is a no-op).

    Raises:
        ValueError: A committed row for the same call differs in any field ("conflicting").
    """
    if not existing:
        return False
    if row in existing:
        return True
    if failure:
        return False  # another reason for the same call is recorded as another row
    raise ValueError(
        f"conflicting ledger row for model call {row['model_call_id']!r}: a different row "
        "with that id is already recorded"
    )


def removal_result(
    keys: Sequence[str],
    removed: set[str],
    skipped: set[str] = frozenset(),  # type: ignore[assignment]
) -> RolloutRemoval:
    """Removed and absent keys in batch order; skipped (started) keys in neither list."""
    return RolloutRemoval(
        removed=[key for key in keys if key in removed],
        absent=[key for key in keys if key not in removed and key not in skipped],
    )


def encode_ledger_rows(
    ledgers: Mapping[str, Sequence[Mapping[str, Any]]],
) -> dict[str, list[bytes]]:
    """Validate every key and row of an import and encode each row as a line, changing nothing.

    Raises:
        TypeError: ``ledgers`` is not a mapping (a bare string included).
        InvalidRolloutIdError: A key is invalid.
        ValueError: A row is malformed.
    """
    if not isinstance(ledgers, Mapping):
        raise TypeError("import_rows_many expects a mapping of rollout id to rows")
    keys = validate_ledger_keys(list(ledgers))
    encoded: dict[str, list[bytes]] = {}
    for key in keys:
        rows = ledgers[key]
        if type(rows) is not list and isinstance(rows, str | bytes | Mapping):
            raise ValueError(f"the rows of {key!r} must be a sequence of row objects")
        encoded[key] = [encode_row(validate_row(row)) for row in rows]
    return encoded


def encode_ledger_batch(ledgers: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, bytes]:
    """``encode_ledger_rows`` with each ledger's lines joined: the file ledger's import."""
    return {key: b"".join(lines) for key, lines in encode_ledger_rows(ledgers).items()}


def doomed_keys(names: Iterable[str], targets: Iterable[str]) -> dict[str, list[str]]:
    """Which capture files an import deletes: per key, the suffixes present.

    A key is doomed when it belongs to the same rollout as a target and its attempt is the
    target's or later. Look-alikes (``r1-a2`` or ``r-a1x-a3`` for target ``r``) are other
    rollouts and are left alone.
    """
    # One regular expression per name: the directory holds every ledger of the server, so this
    # loop runs over far more names than the batch has targets (D258). A SQLite ledger's
    # directory holds no capture file at all, and then the targets are not even split (D434).
    match = _CAPTURE_NAME.fullmatch
    parsed_names = [(name, parsed) for name in names if (parsed := match(name)) is not None]
    if not parsed_names:
        return {}
    floors: dict[str, int] = {}
    for target in targets:
        rollout, attempt = split_attempt(target)
        floors[rollout] = min(attempt, floors.get(rollout, attempt))
    doomed: dict[str, list[str]] = {}
    for name, parsed in parsed_names:
        name_rollout, digits, suffix = parsed.groups()
        floor = floors.get(name_rollout)
        if floor is not None and (0 if digits is None else int(digits)) >= floor:
            key = name[: -len(suffix)]
            doomed.setdefault(key, []).append(suffix)
    return doomed


def write_all(fd: int, data: bytes) -> None:
    """``os.write`` until every byte is written."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def unlink_if_present(path: str) -> bool:
    """Remove ``path``; ``False`` when it did not exist."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True
