"""The structural rules of a staged call: lineage, lengths, masks and masked log-probs.

Root ⇔ no parent ⇔ ``prev_len == 0`` ⇔ mode ``text``; a child is ``token_in``. The staging
digest checks them before it hashes (``compute_staging_digest``); a joined cut prefix checks the
ones that hold for a call as a whole (``StagedPrefix``, D420).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress, repeat
from operator import ne, not_
from typing import Final

CAPTURE_MODES: Final = ("text", "token_in")
_MASKS: Final = frozenset({0.0, 1.0})


def check_lineage(
    parent_call_id: str | None, mode: str, prev_len: int, delta_len: int, cum_len: int
) -> None:
    """The rules of :func:`check_staged_layout` that hold for a call as a whole, not per token.

    Raises:
        ValueError: A rule is broken.
    """
    if parent_call_id == "":
        raise ValueError("parent_call_id must be non-empty when present")
    if mode not in CAPTURE_MODES:
        raise ValueError(f"unknown capture mode {mode!r}")
    if parent_call_id is None and (prev_len != 0 or mode != "text"):
        raise ValueError("a call without a parent must be a text-mode root with prev_len 0")
    if parent_call_id is not None and (prev_len == 0 or mode != "token_in"):
        raise ValueError("a child call must be token_in with prev_len > 0")
    if delta_len < 1:
        raise ValueError("a staged delta must hold at least one token")
    if cum_len != prev_len + delta_len:
        raise ValueError(f"cum_len {cum_len} is not prev_len + delta_len ({prev_len + delta_len})")


def check_staged_layout(
    *,
    parent_call_id: str | None,
    mode: str,
    prev_len: int,
    delta_len: int,
    cum_len: int,
    token_ids_delta: Sequence[int],
    token_mask_delta: Sequence[float],
    generation_log_probs_delta: Sequence[float],
) -> None:
    """The structural rules of a staged call, without hashing.

    Root ⇔ no parent ⇔ ``prev_len == 0`` ⇔ mode ``text``; a child is ``token_in``. The delta is
    non-empty, ``delta_len`` counts it, the three columns have equal lengths,
    ``cum_len == prev_len + delta_len``, masks are 0.0 or 1.0 and a masked-out log-prob is 0.0.

    Raises:
        ValueError: A rule is broken.
    """
    check_lineage(parent_call_id, mode, prev_len, delta_len, cum_len)
    if delta_len != len(token_ids_delta):
        raise ValueError(f"delta_len {delta_len} does not count {len(token_ids_delta)} token ids")
    if not len(token_ids_delta) == len(token_mask_delta) == len(generation_log_probs_delta):
        raise ValueError("token ids, masks and log-probs must have equal lengths")
    try:
        # Every mask 0.0 or 1.0, and no masked-out (``not mask``) log-prob other than 0.0.
        if _MASKS.issuperset(token_mask_delta) and not any(
            map(ne, compress(generation_log_probs_delta, map(not_, token_mask_delta)), repeat(0.0))
        ):
            return
    except TypeError:
        pass  # an unhashable mask: named below
    for mask, log_prob in zip(token_mask_delta, generation_log_probs_delta, strict=True):
        if mask not in (0.0, 1.0):
            raise ValueError(f"a token mask must be 0.0 or 1.0, got {mask!r}")
        if mask == 0.0 and log_prob != 0.0:
            raise ValueError("a masked-out (prompt) token must carry log-prob 0.0")
