"""The policy-model participant: its gate, the capture ledger's checkpoint side, retire.

A checkpoint of the policy server holds, per episode in scope, the episode's ledger rows minus
the calls still undelivered (their responses are held; the agent will re-issue them after a
restore), as ``{"episode_id", "rows", "generation_cuts"}``: at most one durable generation cut per
episode (see :mod:`participants._model.cuts`), which the re-issued call continues.
A restore, in a fresh process only, imports each scoped episode's rows as the ledger of its next
attempt (stamping carried rows with the capture key they were staged under) and retires the
ledgers of the attempts it continues, so a late row of the crashed attempt can never recreate one.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any, Final

import anyio
import anyio.to_thread
from prometheus_client import CollectorRegistry

from protocols import (
    CaptureLedger,
    CheckpointError,
    CheckpointRequest,
    EpisodeId,
    GenerationCutRecord,
    ParticipantKind,
    PrepareReport,
    StaleAttemptError,
    keys_covered_by,
)

from .._runtime.clock import Clock, SystemClock
from .._runtime.participant import BaseParticipant, Record
from .._runtime.report import build_report
from .._runtime.telemetry import GenerationCutTelemetry
from .cuts import (
    CallAborter,
    CutRequester,
    RestoredCuts,
    abort_on_workers,
    latest_cut_tickets,
    latest_cuts,
    run_cut_round,
)
from .gate import DEFAULT_ADMISSION_WAIT_SECONDS, ModelGate, ModelTicket
from .records import checked_restore, import_ledgers, model_commit_reply, retire_ledgers
from .shares import claim_restored_cut, share_episodes

EXPORT_BATCH: Final = 512
"""Ledgers an export reads per worker-thread hop: one hop per episode cost more than the reads."""
MODEL_FAULTS: Final = frozenset({"export-undelivered", "ignore-cuts", "skip-ledger-import"})
"""Fault switches the model participant knows (``midflight drill --fault``)."""


class ModelParticipant(BaseParticipant):
    """The policy server's participant (kind ``model``).

    Args:
        ledger: The capture ledger this server owns.
        instance: The server name (``policy`` in the reference deployment).
        admission_wait_seconds: Bound of a call waiting for a checkpoint to resume.
        faults: Drill fault switches (:data:`MODEL_FAULTS`).
        cut_requester: Asks a worker to cut its calls; ``None`` takes no generation cuts.
        call_aborter: Stops calls on a worker (backend, model call ids) and returns once they
            left; a retire calls it for every call it cancelled that reached a worker, so a
            retired call stops generating and stages nothing after the retire (D245). ``None``:
            the worker notices the dropped connection on its own.
        clock: Where the remaining prepare deadline is read (inject a ``ManualClock`` in tests).
        registry: Where the ``midflight_generation_cuts`` counter lives (the control plane's
            registry, so ``/metrics`` shows it); a registry of its own when omitted.
    """

    kind: ParticipantKind = "model"

    def __init__(
        self,
        ledger: CaptureLedger,
        instance: str = "policy",
        *,
        admission_wait_seconds: float = DEFAULT_ADMISSION_WAIT_SECONDS,
        faults: Collection[str] = (),
        cut_requester: CutRequester | None = None,
        call_aborter: CallAborter | None = None,
        clock: Clock | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        super().__init__()
        unknown = set(faults) - MODEL_FAULTS
        if unknown:
            raise ValueError(
                f"unknown model faults {sorted(unknown)}; known: {sorted(MODEL_FAULTS)}"
            )
        # Drill fault switches: each breaks one guarantee so the drill can show it notices.
        self.faults = frozenset(faults)
        self.instance = instance
        self.ledger = ledger
        self.gate = ModelGate(lambda: self.marks, self.changes.notify, admission_wait_seconds)
        self.restored_targets: set[str] = set()
        self.restored_cuts = RestoredCuts()
        self.cut_requester = cut_requester
        self.call_aborter = call_aborter
        self.clock: Clock = clock or SystemClock()
        self.cut_counts: dict[str, int] = {}
        self.cut_telemetry = GenerationCutTelemetry(instance, registry)
        self.served = False
        # Set by a FanoutShard when this is one shard process of several: the fan-out holds the
        # restored cuts, and a call claims its own before continuing it.
        self.claim_cut: Callable[[str, str], Awaitable[dict[str, Any] | None]] | None = None
        self.return_cut: Callable[[str, dict[str, Any]], Awaitable[None]] | None = None
        self.restored_cut_keys: set[str] = set()  # target keys whose cut the fan-out holds

    # -- data plane -----------------------------------------------------------------------

    async def admit(self, episode: EpisodeId | None) -> ModelTicket:
        """Admit a call of ``episode`` (waiting while closed); mark a restored attempt started.

        An untagged call (``episode=None``) passes the same gate and, like any call, makes this
        process one that has served calls (restore refuses it).

        Raises:
            StaleAttemptError: The attempt is retired or fenced, or its ledger is.
            AdmissionClosedError: A checkpoint stayed open too long.
        """
        ticket = await self.gate.admit(episode)
        self.served = True
        if episode is None:
            return ticket
        key = episode.capture_key
        if key in self.restored_targets:
            # The attempt starts here: its ledger must outlive a commit's delete_restored.
            self.restored_targets.discard(key)
            try:
                started = await self.ledger.mark_started(key)
            except BaseException:
                self.gate.release(ticket)
                raise
            if not started:
                self.gate.release(ticket)
                raise StaleAttemptError(f"the capture ledger of {key} is retired")
        return ticket

    def take_restored_cut(self, ticket: ModelTicket) -> GenerationCutRecord | None:
        """The restored cut the call of ``ticket`` continues, if its request matches one.

        A call under constrained decoding never continues a cut.
        """
        if ticket.restart_reason is not None or ticket.request_digest is None:
            return None
        if "ignore-cuts" in self.faults:
            return None
        return self.restored_cuts.take(ticket, ticket.request_digest)

    def release(self, ticket: ModelTicket) -> None:
        """The call has left the server: a restored cut it delivered is consumed."""
        self.restored_cuts.settle(ticket)
        self.gate.release(ticket)

    def is_checkpoint_open(self) -> bool:
        """Whether admission is closed (ledger retire and delete are refused meanwhile)."""
        return not self.gate.accepting

    # -- participant interface ------------------------------------------------------------

    async def close_admission(self, request: CheckpointRequest) -> None:
        """New calls wait; responses not yet started are held; calls on a worker are cut once.

        The cut round gets half of the time left before the deadline: the later stages of the
        checkpoint need the rest, and a cut that does not make it only costs a regeneration.
        """
        self.gate.close()
        self.cut_counts = {}
        if self.cut_requester is not None:
            budget = (request.deadline_ts - self.clock.time()) / 2
            cut_round = await run_cut_round(
                list(self.gate.tickets.values()),
                checkpoint_id=request.checkpoint_id,
                server_name=self.instance,
                requester=self.cut_requester,
                budget_seconds=budget,
            )
            self.cut_counts = cut_round.counts
            self.cut_telemetry.cut_round(
                request.checkpoint_id, cut_round.counts, cut_round.failures
            )
        self.changes.notify()

    async def open_admission(self) -> None:
        """Admit the waiting calls and deliver the held responses."""
        self.cut_counts = {}
        self.gate.open()
        self.changes.notify()

    def readiness(self) -> PrepareReport:
        """Generations and held responses never block; a response being sent does, briefly."""
        return build_report(
            self.gate.in_transmission() if not self.gate.accepting else [],
            counts={
                "inflight": len(self.gate.tickets),
                "held": self.gate.held_count(),
                "cut": self.cut_counts.get("cut", 0),
                "cut_failed": self.cut_counts.get("cut_failed", 0),
                "cut_skipped": self.cut_counts.get("cut_skipped", 0),
            },
        )

    async def export(self, episode_ids: Sequence[EpisodeId] | None) -> list[Record]:
        """Each scoped episode's ledger rows minus its undelivered calls, and its cut.

        The cut is that of the episode's latest-admitted undelivered call (a client retry can
        leave two; only the latest is awaited), else a restored cut no call has consumed yet.

        Raises:
            CheckpointError: No scope was given (the model needs the episodes continued).
        """
        if episode_ids is None:
            raise CheckpointError(
                "a model commit needs the episode_ids the controller continues from this checkpoint"
            )
        undelivered = self.gate.undelivered()  # taken on the loop while admission is closed
        live_cuts = latest_cuts(self.gate.tickets.values())
        if "export-undelivered" in self.faults:
            undelivered = set()
        records: list[Record] = []
        episodes = sorted(set(episode_ids), key=lambda e: e.capture_key)
        exported: list[list[dict[str, Any]]] = []
        for start in range(0, len(episodes), EXPORT_BATCH):  # one thread hop per batch
            keys = [episode.capture_key for episode in episodes[start : start + EXPORT_BATCH]]
            exported += await anyio.to_thread.run_sync(self.ledger.export_rows_many, keys)
        for episode, rows in zip(episodes, exported, strict=True):
            kept = [row for row in rows if row.get("model_call_id") not in undelivered]
            key = episode.capture_key
            cut = live_cuts.get(key) or self.restored_cuts.records.get(key)
            cuts = [] if cut is None else [cut.model_dump(mode="json")]
            if kept or cuts:
                records.append(
                    {"episode_id": episode.model_dump(), "rows": kept, "generation_cuts": cuts}
                )
        return records

    def commit_reply(self, records: Sequence[Record]) -> dict[str, Any]:
        """Rows to keep staged and the episodes whose record carries a cut (see
        :func:`model_commit_reply`)."""
        return model_commit_reply(records)

    def _refuse_restore_if_served(self) -> None:
        if self.served:
            raise CheckpointError(
                "a model restore needs a freshly started server; this one has served calls"
            )

    async def install(self, records: Sequence[Record], scope: Sequence[EpisodeId]) -> None:
        """Import every scoped episode's rows under its next attempt; retire attempts 0..N.

        Raises:
            CheckpointError: This process has served calls, or the ledger refused the rows.
            InvalidCheckpointStateError: A record is malformed or outside the scope.
        """
        self._refuse_restore_if_served()
        ledgers, cuts = checked_restore(records, scope)  # the whole batch before any change
        # The import writes attempts N+1 (and wipes later ones), the retire fences attempts
        # 0..N: disjoint keys, both idempotent, so they run at once (D270). Both finish before
        # the restore answers; a failure of either fails it, and a retried restore redoes both.
        failures: list[Exception] = []

        async def run(step: Callable[[], Awaitable[None]]) -> None:
            try:
                await step()
            except Exception as exc:  # raised below as itself, never as an exception group
                failures.append(exc)

        async with anyio.create_task_group() as group:
            group.start_soon(run, functools.partial(self._import_ledgers, ledgers))
            group.start_soon(run, functools.partial(self._retire_ledgers, list(scope)))
        if failures:
            raise failures[0]
        self.restored_targets = set(ledgers)
        self.restored_cuts.records = cuts
        self.changes.notify()

    async def _import_ledgers(self, ledgers: dict[str, list[dict[str, Any]]]) -> None:
        if "skip-ledger-import" in self.faults:
            ledgers = {key: [] for key in ledgers}
        await import_ledgers(self.ledger, ledgers)

    # -- one shard process of several (the fan-out is participants._model.fanout) -------

    async def prefetch_restored_cut(self, ticket: ModelTicket) -> None:
        """Claim from the fan-out the restored cut this call's request continues, if any.

        Exactly one shard gets a cut: the fan-out hands it to the first matching claim.
        """
        if self.claim_cut is None or ticket.episode is None or "ignore-cuts" in self.faults:
            return
        if ticket.restart_reason is not None or ticket.request_digest is None:
            return
        key = ticket.episode.capture_key
        if key not in self.restored_cut_keys or key in self.restored_cuts.records:
            return  # no cut was restored for it, or this shard holds it already
        record = await claim_restored_cut(self.claim_cut, self.gate, key, ticket.request_digest)
        if record is not None:
            self.restored_cuts.records[key] = GenerationCutRecord.model_validate(record)

    async def return_unused_cut(self, ticket: ModelTicket) -> None:
        """Give a claimed cut back when the call left without a response (not when retired)."""
        if self.return_cut is None or ticket.episode is None or ticket.response_started:
            return
        key = ticket.episode.capture_key
        record = self.restored_cuts.records.get(key)
        if record is None or record is not ticket.claimed_cut:
            return  # never claimed here, or dropped by a retire meanwhile
        del self.restored_cuts.records[key]
        self.changes.notify()
        await self.return_cut(key, record.model_dump(mode="json"))

    async def export_share(self, episode_ids: Sequence[EpisodeId] | None) -> dict[str, Any]:
        """This shard's share of a commit: rows, undelivered call ids, cuts with admission time.

        Every shard reads the one ledger directory, so a row of a call held on another shard is
        in this share too: the fan-out leaves out the union of undelivered ids.

        Raises:
            CheckpointError: No scope was given.
        """
        if episode_ids is None:
            raise CheckpointError(
                "a model commit needs the episode_ids the controller continues from this checkpoint"
            )
        undelivered = set() if "export-undelivered" in self.faults else self.gate.undelivered()
        live = latest_cut_tickets(self.gate.tickets.values())
        episodes = await share_episodes(
            self.ledger, episode_ids, undelivered, live, self.restored_cuts.records
        )
        return {"undelivered": sorted(undelivered), "episodes": episodes}

    async def install_share(
        self, records: Sequence[Record], scope: Sequence[EpisodeId], options: dict[str, Any]
    ) -> None:
        """One shard's part of a restore: ``options["import"]`` imports the ledger (one shard
        only: the directory is shared); every shard waits for ``options["targets"]``.

        Raises:
            CheckpointError: This process has served calls, or the ledger refused the rows.
            InvalidCheckpointStateError: A record is malformed or outside the scope.
        """
        self._refuse_restore_if_served()
        if options["import"]:
            ledgers, _cuts = checked_restore(records, scope)  # the cuts stay with the fan-out
            await self._import_ledgers(ledgers)
            await self._retire_ledgers(list(scope))
        self.restored_targets = {str(key) for key in options["targets"]}
        self.restored_cut_keys = {str(key) for key in options["cut_keys"]}
        self.restored_cuts.records = {}
        self.changes.notify()

    def served_live_work(self) -> bool:
        """Whether any call was admitted here."""
        return self.served

    def restored_pending(self) -> list[EpisodeId]:
        """Restored attempts whose first call has not arrived."""
        return [EpisodeId.from_capture_key(key) for key in sorted(self.restored_targets)]

    async def delete_restored(self, episode_id: EpisodeId) -> None:
        """Drop a restored attempt left out of a commit; keep its ledger if it has started."""
        self.restored_targets.discard(episode_id.capture_key)
        self.restored_cuts.records.pop(episode_id.capture_key, None)
        await self.ledger.delete_unstarted([episode_id.capture_key])

    async def retire(self, episode_id: EpisodeId) -> None:
        """``retire_many`` of the one attempt."""
        await self.retire_many([episode_id])

    async def retire_many(self, episode_ids: Sequence[EpisodeId]) -> None:
        """Cancel the covered calls and stop them on their workers, then retire ledgers 0..N of
        every attempt: one abort per worker and one ledger transaction per batch of keys for the
        whole request, not one of each per attempt (D389)."""
        cancelled = await self.gate.cancel_covered(episode_ids)
        if self.call_aborter is not None:
            await abort_on_workers(cancelled, self.call_aborter)
        self.restored_targets.difference_update(keys_covered_by(self.restored_targets, episode_ids))
        self.restored_cuts.drop_covered(episode_ids)
        await self._retire_ledgers(episode_ids)
        self.changes.notify()

    async def _retire_ledgers(self, episodes: Sequence[EpisodeId]) -> None:
        await retire_ledgers(self.ledger, episodes)

    def status_extra(self) -> dict[str, Any]:
        """Whether admission is open, restored attempts pending, calls waiting to be admitted."""
        return {
            "accepting": self.gate.accepting,
            "restored_pending": sorted(self.restored_targets),
            "restored_generation_cuts": sorted(self.restored_cuts.records),
            "waiting": self.gate.waiting,
        }
