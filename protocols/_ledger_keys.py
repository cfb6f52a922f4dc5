"""Capture-ledger keys: the rule one key keeps, and a whole batch checked at once.

A ledger key is a capture key (``<rollout>`` or ``<rollout>-a<N>``) under a looser rule than a
rollout id's, because keys become file names in the file layout and SQLite rows in the other.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final

from ._errors import InvalidRolloutIdError

_LEDGER_KEY = re.compile(r"^[A-Za-z0-9._-]+$")
MAX_LEDGER_KEY_LENGTH: Final = 224
"""Longest ledger key: with its longest suffix (``.lineage.started``) a file name stays well under
255 bytes. Every capture key fits (a rollout id of 200 characters, ``-a`` and four digits)."""


def validate_ledger_key(key: object) -> str:
    """Check one capture-ledger key (a capture key, ``<rollout>`` or ``<rollout>-a<N>``).

    The ledger's rule is looser than a rollout id's: ASCII letters, digits, ``.``, ``_`` and
    ``-``, at least one. Keys become file names, so a key starting with ``.`` is refused too.

    Raises:
        InvalidRolloutIdError: The key is not a string or breaks the rule.
    """
    if not isinstance(key, str):
        raise InvalidRolloutIdError(f"a rollout id must be a string, not {type(key).__name__}")
    if len(key) > MAX_LEDGER_KEY_LENGTH:
        raise InvalidRolloutIdError(
            f"invalid rollout id {key[:40]!r}...: longer than {MAX_LEDGER_KEY_LENGTH} characters"
        )
    if not _LEDGER_KEY.fullmatch(key) or key.startswith("."):
        raise InvalidRolloutIdError(
            f"invalid rollout id {key[:200]!r}: use ASCII letters, digits, '.', '_' or '-', "
            "not starting with '.'"
        )
    return key


def validate_ledger_keys(keys: Iterable[str]) -> list[str]:
    """Check a whole batch of ledger keys before anything acts on any of them.

    Returns:
        The keys de-duplicated, first occurrence kept.

    Raises:
        TypeError: A bare string was passed where a sequence of rollout ids was expected.
        InvalidRolloutIdError: Any key breaks the rule; the whole batch is refused.
    """
    if isinstance(keys, str | bytes):
        raise TypeError("expected a sequence of rollout ids, got a bare string")
    given = list(keys)
    if not _all_ledger_keys(given):
        for key in given:
            validate_ledger_key(key)  # raises, naming the first key that breaks the rule
    return list(dict.fromkeys(given))


_LEDGER_KEY_TEXT = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._\n-]*")


def _all_ledger_keys(keys: list[str]) -> bool:
    """Whether every key keeps :func:`validate_ledger_key`'s rule, checked on all at once (D441).

    The keys joined by newlines must be allowed characters and newlines only, with no key empty,
    none starting with ``.``, none longer than the limit, and exactly one newline between two
    keys (a key holding a newline would pass as two); anything not a string makes the join fail.
    ``False`` means some key breaks the rule, and the caller names it.
    """
    if not keys:
        return True
    try:
        text = "\n".join(keys)
    except TypeError:
        return False
    return (
        _LEDGER_KEY_TEXT.fullmatch(text) is not None
        and "\n\n" not in text
        and "\n." not in text
        and not text.endswith("\n")
        and text.count("\n") == len(keys) - 1
        and max(map(len, keys)) <= MAX_LEDGER_KEY_LENGTH
    )
