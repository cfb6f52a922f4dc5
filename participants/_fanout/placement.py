"""Which shard holds what: the slot of a rollout, a restore split by slot, an export made whole.

Data-plane requests of a rollout go to the shard of its **slot** (a stable hash of the rollout id,
modulo the number of shards), so state that spans requests lives there and a restore puts each
record back on the shard of its slot. State that lives inside one request is placed by **claim**
instead: every shard holds it and the first to use it claims it (``docs/workers.md``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from typing import Literal

from pydantic import ValidationError

from protocols import EpisodeId, InvalidCheckpointStateError

from .._runtime.participant import Record

Placement = Literal["slot", "claim"]
"""Where restored records go: ``slot`` — on the shard of the rollout's slot (state that spans
requests); ``claim`` — on every shard, used by the first that claims it (state inside one
request, such as an environment episode whose replacement ``/run`` lands on any shard)."""


def slot_of(rollout_id: str, processes: int) -> int:
    """The slot that owns ``rollout_id``: a stable hash, the same in every process."""
    digest = hashlib.sha256(rollout_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") % processes


def split_by_slot(
    records: Sequence[Record], scope: Sequence[EpisodeId], processes: int
) -> dict[int, tuple[list[Record], list[EpisodeId]]]:
    """Each slot's records and scope of a restore.

    Raises:
        InvalidCheckpointStateError: A record names no valid ``episode_id``.
    """
    by_slot: dict[int, tuple[list[Record], list[EpisodeId]]] = {
        slot: ([], []) for slot in range(processes)
    }
    try:
        for record in records:
            episode = EpisodeId.model_validate(record["episode_id"])
            by_slot[slot_of(episode.rollout_id, processes)][0].append(record)
    except (KeyError, TypeError, ValidationError) as exc:
        raise InvalidCheckpointStateError(f"a record names no valid episode_id: {exc}") from None
    for episode in scope:
        by_slot[slot_of(episode.rollout_id, processes)][1].append(episode)
    return by_slot


def distinct_records(shares: Iterable[Sequence[Record]]) -> list[Record]:
    """Every shard's exported records, each distinct record once, in the order first seen."""
    records: dict[str, Record] = {}
    for share in shares:
        for record in share:
            # Unclaimed restored records are held by every shard: carry each one once. The key
            # is the whole record, not its episode: one episode may hold several records (a
            # resources episode restored before its first boundary seeds a second session beside
            # the restored one), and keeping only the first lost the session the episode went on
            # with (five rollouts of `drill --rollouts 1000 --workers 2`).
            key = json.dumps(record, sort_keys=True)
            records.setdefault(key, record)
    return list(records.values())
