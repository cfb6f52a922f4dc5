"""The model participant's checkpoint records, checked as a whole batch before any change.

A record is ``{"episode_id", "rows", "generation_cuts"}``. A restore imports each record's rows
as the ledger of the episode's next attempt, stamped with the capture key they were staged under,
and gives every scoped episode a ledger (empty without a record), so what a dead execution wrote
under that next attempt is cleared. Shared by the single-process participant and by the fan-out
of a model server with several processes, which validates before any shard changes anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import anyio.to_thread
from pydantic import TypeAdapter, ValidationError

from protocols import (
    MAX_LEDGER_BATCH,
    CaptureLedger,
    CheckpointError,
    EpisodeId,
    GenerationCutRecord,
    InvalidCheckpointStateError,
)

from .._runtime.participant import Record
from .._runtime.restore_batch import RestoreScope

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
    """Capture keys of attempts ``0..episode.attempt`` of the rollout.

    ``episode`` is valid, so its keys are formatted as ``EpisodeId.capture_key`` does rather than
    validated once more per attempt.
    """
    rollout = episode.rollout_id
    return [rollout, *(f"{rollout}-a{n}" for n in range(1, episode.attempt + 1))]


def checked_restore(
    records: Sequence[Record], scope: Sequence[EpisodeId]
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, GenerationCutRecord]]:
    """The ledgers to import and the restored cuts, both by next-attempt capture key.

    The records are checked as one batch: episode ids against the scope's index, every cut
    through one ``TypeAdapter`` call (D264, D265).

    Raises:
        InvalidCheckpointStateError: A record is malformed or outside the scope (nothing changed).
    """
    indexed = RestoreScope.of(scope)
    ledgers: dict[str, list[dict[str, Any]]] = {key: [] for key in indexed.next_keys(indexed)}
    sources = [_checked_record(record, index, indexed) for index, record in enumerate(records)]
    targets = indexed.next_keys(sources)  # one pass, not one call per record (D442)
    with_cut = [index for index, record in enumerate(records) if record["generation_cuts"]]
    try:
        checked = _CUTS.validate_python([records[i]["generation_cuts"][0] for i in with_cut])
    except ValidationError as exc:
        first = exc.errors()[0]["loc"][0]
        raise InvalidCheckpointStateError(
            f"model record {with_cut[int(first)]} holds a malformed generation cut"
        ) from None
    cuts: dict[str, GenerationCutRecord] = {}
    for index, cut in zip(with_cut, checked, strict=True):
        cuts[targets[index]] = cut
    for source, target, record in zip(sources, targets, records, strict=True):
        rows = record["rows"]
        ledgers[target] = stamp_carried_rows(source, rows) if rows else []
    return ledgers, cuts


_CUTS: TypeAdapter[list[GenerationCutRecord]] = TypeAdapter(list[GenerationCutRecord])


def _checked_record(record: Record, index: int, scope: RestoreScope) -> EpisodeId:
    # A dict is told by its exact type before ``isinstance`` asks the abstract class, and an
    # empty list of rows is not walked: 16,000 times per restore (D442).
    if (
        type(record) is not dict and not isinstance(record, Mapping)
    ) or record.keys() != MODEL_RECORD_FIELDS:
        raise InvalidCheckpointStateError(
            f"model record {index} must hold exactly {sorted(MODEL_RECORD_FIELDS)}"
        )
    source = scope.lookup(record["episode_id"])  # found there, it is in the scope
    if source is None:
        try:
            source = EpisodeId.model_validate(record["episode_id"])
        except ValueError:
            raise InvalidCheckpointStateError(
                f"model record {index} has no valid episode_id"
            ) from None
        if source not in scope:
            raise InvalidCheckpointStateError(f"model record {index} is outside the restore scope")
    rows = record["rows"]
    if not isinstance(rows, list) or (rows and not all(isinstance(r, Mapping) for r in rows)):
        raise InvalidCheckpointStateError(f"model record {index}: rows must be a list of objects")
    cuts = record["generation_cuts"]
    if not isinstance(cuts, list) or len(cuts) > 1:
        raise InvalidCheckpointStateError(f"model record {index}: at most one generation cut")
    return source


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


async def import_ledgers(ledger: CaptureLedger, ledgers: dict[str, list[dict[str, Any]]]) -> None:
    """Install a restore's ledgers in one batch, off the event loop.

    Raises:
        CheckpointError: The ledger refused the rows (nothing was installed).
    """
    try:
        await anyio.to_thread.run_sync(ledger.import_rows_many, ledgers)
    except ValueError as exc:
        raise CheckpointError(f"the capture ledger refused the restore: {exc}") from None


async def retire_ledgers(ledger: CaptureLedger, episodes: Sequence[EpisodeId]) -> None:
    """Retire the ledgers of ``episodes`` and of every earlier attempt, in bounded batches."""
    keys = list(dict.fromkeys(k for e in episodes for k in attempt_keys_through(e)))
    for start in range(0, len(keys), MAX_LEDGER_BATCH):
        await ledger.retire(keys[start : start + MAX_LEDGER_BATCH])
