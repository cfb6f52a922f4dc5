"""Builders of ledger commits for tests and for the child processes of the process tests."""

from __future__ import annotations

import hashlib
from typing import Any

from protocols import CallRecord, CaptureLedgerCommit
from protocols._lineage import FINGERPRINT_VERSION


def hex64(*parts: object) -> str:
    """A deterministic 64-hex digest of ``parts``."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def conversation(turns: int, *, rollout: str = "r") -> list[dict[str, Any]]:
    """System + user, then ``turns`` pairs of assistant output and tool reply."""
    items: list[dict[str, Any]] = [
        {"role": "system", "content": "counter"},
        {"role": "user", "content": f"{rollout} 0"},
    ]
    for turn in range(turns):
        items.append({"role": "assistant", "content": f"out {rollout} {turn}"})
        items.append({"role": "tool", "content": f"add {turn} -> {turn + 1} 0"})
    return items


def commit(
    key: str,
    turn: int,
    *,
    call_id: str | None = None,
    rollout: str = "r",
    delta: int = 5,
    response_id: str | None = None,
    output: str | None = None,
) -> CaptureLedgerCommit:
    """The commit of call ``turn`` (0-based) of a linear conversation, parent = turn - 1."""
    request = conversation(turn, rollout=rollout)
    response = [{"role": "assistant", "content": output or f"out {rollout} {turn}"}]
    call = call_id or f"call-{turn}"
    prev_len = delta * turn
    record = CallRecord(
        model_call_id=call,
        parent_call_id=None if turn == 0 else f"call-{turn - 1}",
        staging_key=f"stage/{key}/{call}",
        weight_version=1,
        prev_len=prev_len,
        delta_len=delta,
        cum_len=prev_len + delta,
        digest=hex64("digest", key, call, output),
        extras_digest=hex64("extras"),
        mode="text" if turn == 0 else "token_in",
        admitted_at=1.5,
        chain_hash=hex64("chain", key, call, output),
        cumulative_hash=hex64("cum", key, call, output),
        response_id=response_id or f"resp-{call}",
        fingerprint_version=FINGERPRINT_VERSION,
    )
    chain = (*(f"stage/{key}/call-{t}" for t in range(turn)), record.staging_key)
    return CaptureLedgerCommit.model_validate(
        {
            "rollout_id": key,
            "record": record,
            "staging_chain": chain,
            "request_items": request,
            "response_items": response,
        }
    )
