"""What one shard process of a policy server contributes: its share of a commit, its cut claims.

With several processes every shard reads the one ledger directory, so a shard's share of a
commit is every scoped episode's rows (minus the calls held undelivered) and the cut it knows of;
the fan-out merges the shares. A restored cut lives with the fan-out until the first shard whose
call continues it claims it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any, Final

import anyio
import anyio.to_thread

from protocols import (
    AdmissionClosedError,
    CaptureLedger,
    EpisodeId,
    GenerationCutRecord,
    sorted_capture_keys,
)

from .gate import ModelGate, ModelTicket

SHARE_BATCH: Final = 512
"""Ledgers a shard reads per thread hop for its share of a commit (as the export does, D252)."""
CLAIM_RETRY_SECONDS: Final = 0.05
"""Pause before claiming a restored cut again while the fan-out is closed but not yet this
shard."""

CutClaimer = Callable[[str, str], Awaitable[dict[str, Any] | None]]
"""``(capture key, request digest) -> record or None``: ask the fan-out for a restored cut."""


async def claim_restored_cut(
    claim_cut: CutClaimer, gate: ModelGate, key: str, request_digest: str
) -> dict[str, Any] | None:
    """Claim the restored cut of ``key`` from the fan-out; ``None`` when there is none.

    Bounded like a waiting admission: with no answer in time the call regenerates, it never
    fails.
    """
    record = None
    with anyio.move_on_after(gate.admission_wait_seconds):
        while True:
            try:
                record = await claim_cut(key, request_digest)
                break
            except AdmissionClosedError:
                # A checkpoint is open: no cut moves until resume (the export carries it), so
                # wait like a new call; the fan-out may close before this shard does.
                if gate.accepting:
                    await anyio.sleep(CLAIM_RETRY_SECONDS)
                else:
                    await gate.wait_open()
    return record


async def share_episodes(
    ledger: CaptureLedger,
    episode_ids: Collection[EpisodeId],
    undelivered: set[str],
    live: Mapping[str, ModelTicket],
    restored: Mapping[str, GenerationCutRecord],
) -> dict[str, dict[str, Any]]:
    """Each scoped episode's rows without undelivered calls, its cut, and that cut's admission."""
    episodes: dict[str, dict[str, Any]] = {}
    keys = sorted_capture_keys(episode_ids)
    exported: list[list[dict[str, Any]]] = []
    for start in range(0, len(keys), SHARE_BATCH):  # one thread hop per batch, not per episode
        batch = keys[start : start + SHARE_BATCH]
        exported += await anyio.to_thread.run_sync(ledger.export_rows_many, batch)
    for key, rows in zip(keys, exported, strict=True):
        ticket = live.get(key)
        cut = ticket.cut_record if ticket is not None else restored.get(key)
        episodes[key] = {
            "rows": [row for row in rows if row.get("model_call_id") not in undelivered],
            "cut": None if cut is None else cut.model_dump(mode="json"),
            "cut_admitted_at": None if ticket is None else ticket.admitted_at,
        }
    return episodes
