"""The model participant's checkpoint records, checked as a whole batch before any change.

A record is ``{"episode_id", "rows", "generation_cuts"}``. A restore imports each record's rows
as the ledger of the episode's next attempt, stamped with the capture key they were staged under,
and gives every scoped episode a ledger (empty without a record), so what a dead execution wrote
under that next attempt is cleared. Shared by the single-process participant and by the
coordinator of a several-worker model server, which validates before any worker changes anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from protocols import (
    EpisodeId,
    GenerationCutRecord,
    InvalidCheckpointStateError,
    capture_key,
)

from ._participant import Record

MODEL_RECORD_FIELDS: Final = frozenset({"episode_id", "rows", "generation_cuts"})


def stamp_carried_rows(
    source: EpisodeId, rows: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Rows as the next attempt's ledger holds them: every custody row names where it was staged.

    A row that already carries a ``capture_key`` (a chain of restores) keeps its original stamp;
    failure rows have no staging key and stay as they are.
    """
    stamped = []
    for row in rows:
        copy = dict(row)
        if copy.get("staging_key") and not copy.get("capture_key"):
            copy["capture_key"] = source.capture_key
        stamped.append(copy)
    return stamped


def attempt_keys_through(episode: EpisodeId) -> list[str]:
    """Capture keys of attempts ``0..episode.attempt`` of the rollout."""
    return [capture_key(episode.rollout_id, n) for n in range(episode.attempt + 1)]


def checked_restore(
    records: Sequence[Record], scope: Sequence[EpisodeId]
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, GenerationCutRecord]]:
    """The ledgers to import and the restored cuts, both by next-attempt capture key.

    Raises:
        InvalidCheckpointStateError: A record is malformed or outside the scope (nothing changed).
    """
    wanted = {episode.capture_key: episode for episode in scope}
    ledgers: dict[str, list[dict[str, Any]]] = {
        episode.next_attempt().capture_key: [] for episode in scope
    }
    cuts: dict[str, GenerationCutRecord] = {}
    for index, record in enumerate(records):
        source, cut = _checked_record(record, index, wanted)
        target = source.next_attempt().capture_key
        ledgers[target] = stamp_carried_rows(source, record["rows"])
        if cut is not None:
            cuts[target] = cut
    return ledgers, cuts


def _checked_record(
    record: Record, index: int, wanted: Mapping[str, EpisodeId]
) -> tuple[EpisodeId, GenerationCutRecord | None]:
    if not isinstance(record, Mapping) or set(record) != MODEL_RECORD_FIELDS:
        raise InvalidCheckpointStateError(
            f"model record {index} must hold exactly {sorted(MODEL_RECORD_FIELDS)}"
        )
    try:
        source = EpisodeId.model_validate(record["episode_id"])
    except ValueError:
        raise InvalidCheckpointStateError(f"model record {index} has no valid episode_id") from None
    if source.capture_key not in wanted:
        raise InvalidCheckpointStateError(f"model record {index} is outside the restore scope")
    rows = record["rows"]
    if not isinstance(rows, list) or not all(isinstance(r, Mapping) for r in rows):
        raise InvalidCheckpointStateError(f"model record {index}: rows must be a list of objects")
    cuts = record["generation_cuts"]
    if not isinstance(cuts, list) or len(cuts) > 1:
        raise InvalidCheckpointStateError(f"model record {index}: at most one generation cut")
    try:
        cut = GenerationCutRecord.model_validate(cuts[0]) if cuts else None
    except ValueError:
        raise InvalidCheckpointStateError(
            f"model record {index} holds a malformed generation cut"
        ) from None
    return source, cut


def model_commit_reply(records: Sequence[Record]) -> dict[str, Any]:
    """Rows to keep staged and the episodes whose record carries a generation cut.

    ``staging_keys`` (sorted union), ``staging_keys_by_episode`` and ``generation_cut_episodes``
    (sorted capture keys; D155).
    """
    by_episode: dict[str, list[str]] = {}
    with_cut: list[str] = []
    for record in records:
        key = EpisodeId.model_validate(record["episode_id"]).capture_key
        keys = {str(r["staging_key"]) for r in record["rows"] if r.get("staging_key")}
        for cut in record["generation_cuts"]:  # the staged prefix must outlive the commit
            keys.update(str(k) for k in cut["continuation"]["staging_keys"])
        if record["generation_cuts"]:
            with_cut.append(key)
        by_episode[key] = sorted(keys)
    union = sorted({k for keys in by_episode.values() for k in keys})
    return {
        "staging_keys": union,
        "staging_keys_by_episode": by_episode,
        "generation_cut_episodes": sorted(with_cut),
    }
