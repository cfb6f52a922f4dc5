"""Generation cuts on the policy side: the cut round at close, and restored cuts.

When admission closes, every undelivered call already on a worker is listed in one inventory per
worker and the worker is asked to make its generated prefix durable. The round is bounded by half
of what is left of the prepare deadline, because a cut is optional: any failure (a refusal, an
unreachable or hung worker, a receipt that does not answer the inventory) only means the call is
regenerated after a restore, never a blocked checkpoint. Calls under constrained decoding are
never cut: a prefix decoded under a grammar cannot be handed to another decoder state.

After a restore, each target attempt may hold one restored cut; the re-issued call whose request
has the same conversation digest continues it. The cut stays restored until the call that used it
has started its response, so a re-issued call still undelivered at the next checkpoint keeps it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import anyio

from protocols import (
    GENERATION_CUT_SPAN,
    EpisodeId,
    GenerationCutInventory,
    GenerationCutPrefix,
    GenerationCutPrefixAck,
    GenerationCutReceipt,
    GenerationCutRecord,
    keys_covered_by,
)

from .._tracing import checkpoint_span, set_checkpoint_attributes
from .gate import ModelTicket

GUIDED_FIELDS: Final = (
    "guided_choice",
    "guided_grammar",
    "guided_json",
    "guided_regex",
    "guided_whitespace_pattern",
    "structural_tag",
    "structured_outputs",
)
"""Request fields that switch on constrained decoding when non-null."""

CutRequester = Callable[[str, GenerationCutInventory, float], Awaitable[GenerationCutReceipt]]
"""``(backend, inventory, budget_seconds) -> receipt``: asks one worker to cut its calls."""

CallAborter = Callable[[str, list[str]], Awaitable[None]]
"""Stops model calls on a worker (its URL, the call ids); returns once they have left."""


async def abort_on_workers(cancelled: Iterable[ModelTicket], aborter: CallAborter) -> None:
    """Stop the cancelled calls that reached a worker and had not started their response: one
    abort per worker for the whole batch, in the workers' order (D389)."""
    by_backend: dict[str, list[str]] = {}
    for ticket in cancelled:
        if ticket.backend is not None and not ticket.response_started:
            by_backend.setdefault(ticket.backend, []).append(ticket.model_call_id)
    for backend, call_ids in sorted(by_backend.items()):
        await aborter(backend, call_ids)


def generation_cut_restart_reason(body: Mapping[str, Any]) -> str | None:
    """Why a call with this request body may never be cut nor continue a cut, if it may not.

    Constrained decoding (a forced tool choice, a structured response format, a guided field)
    carries decoder state a token prefix does not capture.
    """
    tool_choice = body.get("tool_choice")
    if isinstance(tool_choice, str):
        if tool_choice not in ("auto", "none"):
            return f"tool_choice:{tool_choice}"
    elif tool_choice is not None:
        return "tool_choice:constrained"
    response_format = body.get("response_format")
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, Mapping) else None
        if kind != "text":
            return f"response_format:{kind if isinstance(kind, str) else 'unknown'}"
    for name in GUIDED_FIELDS:
        if body.get(name) is not None:
            return name
    return None


@dataclass(frozen=True)
class CutRound:
    """What one cut round did.

    Attributes:
        counts: ``cut``, ``cut_failed`` and ``cut_skipped`` calls.
        failures: Worker base URL → the error that failed its whole round.
    """

    counts: dict[str, int]
    failures: dict[str, str] = field(default_factory=dict)


def _prefix(ticket: ModelTicket, episode: EpisodeId) -> GenerationCutPrefix:
    return GenerationCutPrefix(
        ticket_id=ticket.model_call_id,
        rollout_id=episode.rollout_id,
        attempt=episode.attempt,
        model_call_id=ticket.model_call_id,
        admitted_at=ticket.admitted_at,
    )


async def run_cut_round(
    tickets: Iterable[ModelTicket],
    *,
    checkpoint_id: str,
    server_name: str,
    requester: CutRequester,
    budget_seconds: float,
) -> CutRound:
    """Cut every eligible ticket, one inventory per worker, all workers at once.

    Each ticket gets ``cut`` (its ack) and, for a durable prefix, ``cut_record``. Never raises for
    a worker's failure: it is reported in the result.
    """
    by_backend: dict[str, list[tuple[ModelTicket, EpisodeId]]] = {}
    skipped = 0
    failures: dict[str, str] = {}
    for ticket in tickets:
        if ticket.response_started or ticket.backend is None:
            continue  # delivered, or not on a worker yet: it stays held, uncut
        if ticket.episode is None:
            continue  # an untagged call belongs to no episode: nothing could continue its cut
        if ticket.restart_reason is not None:
            skipped += 1
            continue
        by_backend.setdefault(ticket.backend, []).append((ticket, ticket.episode))

    async def cut_backend(backend: str, group: list[tuple[ModelTicket, EpisodeId]]) -> None:
        inventory = GenerationCutInventory.build(
            checkpoint_id=checkpoint_id,
            server_name=server_name,
            active_prefixes=[_prefix(t, e) for t, e in group],
        )
        acks: dict[str, GenerationCutPrefixAck] = {}
        try:
            with anyio.fail_after(max(budget_seconds, 0.0)):
                receipt = await requester(backend, inventory, budget_seconds)
            receipt.validate_for(inventory)
            acks = {ack.ticket_id: ack for ack in receipt.prefixes}
        except Exception as exc:  # a cut is optional: any failure regenerates
            failures[backend] = repr(exc)[:500]
        for ticket, episode in group:
            ack = acks.get(ticket.model_call_id)
            ticket.cut = ack or GenerationCutPrefixAck.failure(_prefix(ticket, episode))
            if ticket.cut.disposition == "durable_prefix" and ticket.request_digest:
                ticket.cut_record = GenerationCutRecord(
                    model_call_id=ticket.model_call_id,
                    request_digest=ticket.request_digest,
                    continuation=ticket.cut.continuation(),
                )

    with checkpoint_span(GENERATION_CUT_SPAN, id=checkpoint_id, workers=len(by_backend)) as span:
        async with anyio.create_task_group() as group:
            for backend, members in sorted(by_backend.items()):
                group.start_soon(cut_backend, backend, members)
        cut = sum(1 for g in by_backend.values() for t, _ in g if t.cut_record is not None)
        total = sum(len(g) for g in by_backend.values())
        counts = {"cut": cut, "cut_failed": total - cut, "cut_skipped": skipped}
        set_checkpoint_attributes(
            span, calls=total + skipped, failed_workers=len(failures), **counts
        )
    return CutRound(counts, failures)


def latest_cut_tickets(tickets: Iterable[ModelTicket]) -> dict[str, ModelTicket]:
    """Per capture key, the latest-admitted undelivered ticket holding a cut."""
    best: dict[str, ModelTicket] = {}
    for ticket in tickets:
        if ticket.cut_record is None or ticket.response_started or ticket.episode is None:
            continue
        key = ticket.episode.capture_key
        if key not in best or ticket.admitted_at > best[key].admitted_at:
            best[key] = ticket
    return best


def latest_cuts(tickets: Iterable[ModelTicket]) -> dict[str, GenerationCutRecord]:
    """One cut per capture key: that of the latest-admitted ticket holding one."""
    best = latest_cut_tickets(tickets)
    return {key: t.cut_record for key, t in best.items() if t.cut_record is not None}


class RestoredCuts:
    """The cuts this process restored, one per target attempt, until a call has used them."""

    def __init__(self) -> None:
        self.records: dict[str, GenerationCutRecord] = {}

    def take(self, ticket: ModelTicket, request_digest: str) -> GenerationCutRecord | None:
        """The restored cut of the ticket's attempt if its request matches; claimed by it."""
        if ticket.episode is None:
            return None
        record = self.records.get(ticket.episode.capture_key)
        if record is None or record.request_digest != request_digest:
            return None
        ticket.claimed_cut = record
        return record

    def settle(self, ticket: ModelTicket) -> None:
        """Free the cut a ticket used once its response has started (it is consumed)."""
        if ticket.claimed_cut is not None and ticket.response_started and ticket.episode:
            key = ticket.episode.capture_key
            if self.records.get(key) is ticket.claimed_cut:
                del self.records[key]

    def drop_covered(self, retired: Sequence[EpisodeId]) -> None:
        """Forget the restored cuts of attempts a retire of ``retired`` covers."""
        for key in keys_covered_by(self.records, retired):
            del self.records[key]
