"""Rebuilding a rollout's token sequence from its ledger manifest and the staging store.

The drill never trusts a server's word for what was generated: it walks the manifest's last call
back to its root through ``parent_call_id`` and concatenates the staged token deltas, reading the
worker's staging store directly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from participants import FileTokenStagingStore
from protocols import MidflightError


class TokenSequenceError(MidflightError, ValueError):
    """The manifest and the staging store do not add up to one token sequence."""


def call_chain(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The calls from the root to the last (longest) call, following ``parent_call_id``.

    Raises:
        TokenSequenceError: A parent is missing or the lengths do not chain.
    """
    if not records:
        return []
    by_id = {record["model_call_id"]: record for record in records}
    leaf = max(records, key=lambda record: (record["cum_len"], records.index(record)))
    chain = [leaf]
    while chain[-1].get("parent_call_id") is not None:
        parent = by_id.get(chain[-1]["parent_call_id"])
        if parent is None:
            raise TokenSequenceError(f"parent {chain[-1]['parent_call_id']} is not in the manifest")
        if parent["cum_len"] != chain[-1]["prev_len"]:
            raise TokenSequenceError(
                f"call {chain[-1]['model_call_id']} does not extend its parent"
            )
        chain.append(parent)
        if len(chain) > len(records):
            raise TokenSequenceError("the parent links form a cycle")
    chain.reverse()
    return chain


def token_sequence(records: Sequence[Mapping[str, Any]], staging_root: Path) -> list[int]:
    """Every token of the rollout's final call, rebuilt from the staged deltas.

    Raises:
        TokenSequenceError: A staged record is missing or disagrees with the manifest.
    """
    store = FileTokenStagingStore(staging_root)
    tokens: list[int] = []
    for record in call_chain(records):
        entry = store.get(record["staging_key"])
        if entry is None:
            raise TokenSequenceError(f"staging key {record['staging_key']} is missing")
        if entry.record.digest != record["digest"] or entry.record.prev_len != len(tokens):
            raise TokenSequenceError(f"staged record {record['staging_key']} does not match")
        tokens.extend(entry.record.token_ids_delta)
    return tokens
