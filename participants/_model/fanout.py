"""The fan-out of a policy model server with several processes (reference §3.11, §7.10).

The generic :class:`~participants.ProcessFanout` merges shards' records by episode, which is wrong
for the model in three ways this subclass fixes:

- **Undelivered calls, every shard's.** All shards share one ledger directory, so each reads
  every row, including those of calls held on *another* shard. Each shard's share lists its
  undelivered call ids; the fan-out leaves out their union from every episode's rows.
- **Restored cuts, claimed once.** The fan-out keeps the restored cuts. A shard asks for the cut
  of the call it is about to run (``claim_cut`` with the request's conversation digest); the
  first matching claim gets it, and a later one gets nothing. A claimed cut that no response used
  comes back (``return_cut``), so the next checkpoint carries it; an unclaimed one is carried too.
- **The ledger, imported once.** One shard (the lowest slot) imports the ledger and retires the
  continued attempts before the others are told which restored attempts to wait for; the
  directory is shared, so every shard reads the imported rows from then on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import anyio
import structlog

from protocols import (
    AdmissionClosedError,
    CheckpointError,
    EpisodeId,
    GenerationCutRecord,
    keys_covered_by,
)

from .._fanout.channel import MESSAGE_TIMEOUT_SECONDS, Dispatch
from .._fanout.group import ProcessFanout, ShardConnection
from .._fanout.messages import ClaimCut, ExportShare, InstallShare, ModelShare, ReturnCut
from .._fanout.placement import slot_of
from .._fanout.roster import ShardState
from .._runtime.participant import Record
from .records import checked_restore, model_commit_reply

_log = structlog.get_logger("midflight.fanout")


def merge_model_shares(
    episode_ids: Sequence[EpisodeId],
    shares: Sequence[ModelShare],
    unclaimed: Mapping[str, Mapping[str, Any]],
) -> list[Record]:
    """One model record per scoped episode with rows or a cut, from every shard's share.

    Rows: the fullest read of the shared ledger, minus the undelivered calls of *every* shard.
    Cut: the live cut of the latest-admitted undelivered call on any shard; else a restored cut
    a shard claimed and has not consumed; else a restored cut no shard claimed.
    """
    undelivered = {call_id for share in shares for call_id in share.undelivered}
    records: list[Record] = []
    for episode in sorted(set(episode_ids), key=lambda e: e.capture_key):
        key = episode.capture_key
        entries = [share.episodes[key] for share in shares if key in share.episodes]
        rows: list[dict[str, Any]] = max((e.rows for e in entries), key=len, default=[])
        kept = [row for row in rows if row.get("model_call_id") not in undelivered]
        live = [e for e in entries if e.cut is not None and e.cut_admitted_at is not None]
        held = [e.cut for e in entries if e.cut is not None and e.cut_admitted_at is None]
        cut: Mapping[str, Any] | None
        if live:
            latest = max(live, key=lambda e: e.cut_admitted_at or 0.0).cut
            cut = None if latest is None else latest.model_dump(mode="json")
        elif held and held[0] is not None:
            cut = held[0].model_dump(mode="json")
        else:
            cut = unclaimed.get(key)
        cuts = [] if cut is None else [dict(cut)]
        if kept or cuts:
            records.append(
                {"episode_id": episode.model_dump(), "rows": kept, "generation_cuts": cuts}
            )
    return records


class ModelProcessFanout(ProcessFanout):
    """The fan-out of a model server with ``expected`` shard processes.

    Args:
        instance: The server name.
        expected: How many shard processes the server runs.
    """

    def __init__(self, instance: str, *, expected: int) -> None:
        super().__init__("model", instance, expected=expected, placement="slot")
        self.cuts: dict[str, dict[str, Any]] = {}
        """Restored cuts no shard holds, by target capture key (JSON form)."""
        self.cut_claims: dict[str, int] = {}
        """Target capture key → pid of the shard that claimed its cut."""

    def dispatch(self, connection: ShardConnection) -> Dispatch:
        """Every fan-out message, with ``claim_cut`` and ``return_cut``."""
        return (
            super()
            .dispatch(connection)
            .on(ClaimCut, partial(self._on_claim_cut, connection))
            .on(ReturnCut, partial(self._on_return_cut, connection))
        )

    async def _on_claim_cut(
        self, connection: ShardConnection, message: ClaimCut
    ) -> GenerationCutRecord | None:
        shard = connection.registered(message.kind)
        record = self._claim_cut(shard, message.capture_key, message.request_digest)
        return None if record is None else GenerationCutRecord.model_validate(record)

    async def _on_return_cut(self, connection: ShardConnection, message: ReturnCut) -> None:
        shard = connection.registered(message.kind)
        self._return_cut(shard, message.capture_key, message.record.model_dump(mode="json"))

    def _claim_cut(self, shard: ShardState, key: str, digest: str) -> dict[str, Any] | None:
        # While a checkpoint is open the export reads self.cuts: a cut moving to a shard then
        # could be in neither share. The call waits for resume instead, and the cut is carried.
        if self.closed_request is not None:
            raise AdmissionClosedError("a checkpoint is open; claim the restored cut after resume")
        record = self.cuts.get(key)
        if record is None or record.get("request_digest") != digest:
            return None  # another request of the attempt never continues the cut
        del self.cuts[key]
        self.cut_claims[key] = shard.pid
        _log.info("shard.claimed_cut", participant=self.instance, pid=shard.pid, key=key)
        self.changes.notify()
        return record

    def _return_cut(self, shard: ShardState, key: str, record: dict[str, Any]) -> None:
        if self.cut_claims.get(key) != shard.pid:
            return  # retired or deleted meanwhile: the cut is gone for good
        del self.cut_claims[key]
        self.cuts[key] = record
        self.changes.notify()

    async def export(self, episode_ids: Sequence[EpisodeId] | None) -> list[Record]:
        """Every shard's share merged (:func:`merge_model_shares`), with unclaimed cuts.

        Raises:
            CheckpointError: No scope was given.
            InvalidCheckpointStateError: A shard is missing or was lost while closed.
        """
        if episode_ids is None:
            raise CheckpointError(
                "a model commit needs the episode_ids the controller continues from this checkpoint"
            )
        self._require_every_shard("export")
        replies = await self._fan_out(ExportShare(scope=list(episode_ids)))
        shares = [replies[pid] for pid in sorted(replies)]
        return merge_model_shares(episode_ids, shares, self.cuts)

    def commit_reply(self, records: Sequence[Record]) -> dict[str, Any]:
        """The model's reply fields (staging keys, episodes with a cut), as in one process."""
        return model_commit_reply(records)

    async def install(self, records: Sequence[Record], scope: Sequence[EpisodeId]) -> None:
        """Check every record, import the ledger on one shard, then arm every shard.

        Raises:
            CheckpointError: A shard has served, or the ledger refused the rows.
            InvalidCheckpointStateError: A record is malformed, or a shard was lost.
            CheckpointCoordinatorUnavailableError: A slot still has no shard at the deadline.
        """
        await self.await_every_slot("restore")
        if self.served_live_work():
            raise CheckpointError("restore needs fresh processes: one has served live work")
        ledgers, cuts = checked_restore(records, scope)  # nothing changes on a bad record
        shards = sorted(self.shards.values(), key=lambda s: s.slot)

        def part(shard: ShardState, *, importer: bool) -> InstallShare:
            targets = [k for k in ledgers if slot_of(_rollout(k), self.expected) == shard.slot]
            return InstallShare(
                records=list(records) if importer else [],
                scope=list(scope) if importer else [],
                manifest=self._manifest,
                import_ledger=importer,
                targets=sorted(targets),
                cut_keys=sorted(cuts),  # only these calls ask the fan-out for a cut
            )

        within = MESSAGE_TIMEOUT_SECONDS * 4
        await shards[0].channel.request(part(shards[0], importer=True), within=within)
        async with anyio.create_task_group() as group:
            for shard in shards[1:]:
                group.start_soon(self._install_one, shard, part(shard, importer=False))
        self.cuts = {key: cut.model_dump(mode="json") for key, cut in cuts.items()}
        self.cut_claims = {}
        self.changes.notify()

    async def delete_restored(self, episode_id: EpisodeId) -> None:
        """Drop its restored cut here too."""
        self.cuts.pop(episode_id.capture_key, None)
        self.cut_claims.pop(episode_id.capture_key, None)
        await super().delete_restored(episode_id)

    async def retire_many(self, episode_ids: Sequence[EpisodeId]) -> None:
        """Drop covered restored cuts (a later return of one is ignored), then every shard."""
        for key in keys_covered_by([*self.cuts, *self.cut_claims], episode_ids):
            self.cuts.pop(key, None)
            self.cut_claims.pop(key, None)
        await super().retire_many(episode_ids)

    def status_extra(self) -> dict[str, Any]:
        """The shards' fields, with the cuts this fan-out still holds."""
        merged = super().status_extra()
        held = set(merged.get("restored_generation_cuts", []))
        merged["restored_generation_cuts"] = sorted(held | set(self.cuts))
        return merged


def _rollout(key: str) -> str:
    return EpisodeId.from_capture_key(key).rollout_id
