"""Generation cuts on the deterministic worker: the state of a live call, and a cut batch.

A batch of a cut round takes each call's cut lock without yielding, fixes how many tokens each
call's cut covers (decoding goes on past that point), then builds every new record, stages them
as one staging batch (``put_entries``: one segment, two fsyncs) and builds every ack, all in one
worker-thread job. A batch is sealed only once it is durable; a call that finished before the cut
arrived is answered from its completion evidence (a ``terminal_completion`` ack, D251).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio
import anyio.to_thread

from participants import ActiveCall, RolloutTokenCapture, put_entries, rebuild_generation_cut
from protocols import (
    CommitCoords,
    GenerationCutPrefix,
    GenerationCutPrefixAck,
    StagedCallRecord,
    StagedEntry,
    TokenStagingStore,
    generation_cut_staging_key,
)

from .engine_api import GenerationRequest, StagedFinishReason


@dataclass
class LiveCall:
    """A call being decoded, and what its cuts have sealed so far."""

    call: ActiveCall
    generation: GenerationRequest
    engine_prompt: list[int]
    max_tokens: int
    continued: int
    generated: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    staged: list[StagedCallRecord] = field(default_factory=list)
    staged_keys: list[str] = field(default_factory=list)
    staged_count: int = 0
    last_sequence: int = 0
    sealed_sequence: int = 0
    cut_lock: anyio.Lock = field(default_factory=anyio.Lock)
    # Made on the event loop once the call is admitted (_begin runs in a worker thread).
    scope: anyio.CancelScope | None = None
    left: anyio.Event | None = None

    @property
    def capture_key(self) -> str:
        return self.call.rollout_id

    def append(self, token_id: int, log_prob: float) -> None:
        """Take the engine's next token (the call is the engine's :class:`TokenSink`)."""
        self.generated.append(token_id)
        self.log_probs.append(log_prob)


@dataclass(frozen=True)
class Finished:
    """Completion evidence of a call, kept for a cut that races its delivery."""

    capture_key: str
    coords: CommitCoords
    generated_count: int
    max_tokens: int
    finish_reason: StagedFinishReason
    finished_at: float


@dataclass(frozen=True)
class CutPlan:
    """One call of a cut batch: what it stages (``key`` None: nothing new since its last cut)."""

    prefix: GenerationCutPrefix
    live: LiveCall
    key: str | None
    count: int
    sequence: int


async def cut_batch(
    capture: RolloutTokenCapture,
    store: TokenStagingStore,
    checkpoint_id: str,
    batch: list[tuple[GenerationCutPrefix, LiveCall]],
) -> dict[str, GenerationCutPrefixAck]:
    """Stage and seal one batch of a round; the acks of its calls."""
    held: list[LiveCall] = []
    try:
        for _, live in batch:
            if not live.cut_lock.locked():  # no wait, no yield: thousands are taken at once
                live.cut_lock.acquire_nowait()
            else:
                await live.cut_lock.acquire()  # an abort is waiting on this call: take turns
            held.append(live)
        plans = []
        for prefix, live in batch:
            count = len(live.generated)  # decoding goes on past this point; the cut stops here
            key = None
            if not live.staged or count > live.staged_count:
                live.last_sequence += 1
                key = generation_cut_staging_key(live.call.model_call_id, live.last_sequence)
            plans.append(CutPlan(prefix, live, key, count, live.last_sequence))
        # One hop to a worker thread and one staging batch for the whole batch.
        staged = await anyio.to_thread.run_sync(
            stage_batch, capture, store, checkpoint_id, plans, abandon_on_cancel=True
        )
        # Reached only if the batch is durable within the deadline: seal it.
        for plan, (record, _) in zip(plans, staged, strict=True):
            if record is not None and plan.key is not None:
                live = plan.live
                live.staged.append(record)
                live.staged_keys.append(plan.key)
                live.staged_count = plan.count
                live.sealed_sequence = plan.sequence
        return {plan.prefix.ticket_id: ack for plan, (_, ack) in zip(plans, staged, strict=True)}
    finally:
        for live in held:
            live.cut_lock.release()


def stage_batch(
    capture: RolloutTokenCapture,
    store: TokenStagingStore,
    checkpoint_id: str,
    plans: list[CutPlan],
) -> list[tuple[StagedCallRecord | None, GenerationCutPrefixAck]]:
    """Build every new cut record, stage them as one batch, and build every ack (blocking;
    the calls' cut locks are held, so their staged records cannot change meanwhile)."""
    built: list[tuple[CutPlan, StagedCallRecord | None]] = []
    entries = []
    for plan in plans:
        record = None
        if plan.key is not None:
            record = build_cut_record(capture, plan.live, plan.count)
            entries.append(StagedEntry(staging_key=plan.key, record=record))
        built.append((plan, record))
    put_entries(store, entries)
    results = []
    for plan, record in built:
        live = plan.live
        staged = live.staged if record is None else [*live.staged, record]
        keys = live.staged_keys if plan.key is None else [*live.staged_keys, plan.key]
        sealed = live.staged_count if record is None else plan.count
        sequence = live.sealed_sequence if record is None else plan.sequence
        snapshot = rebuild_generation_cut(staged)
        ack = GenerationCutPrefixAck(
            **plan.prefix.fields(),
            disposition="durable_prefix",
            cut_kind="active_prefix",
            frozen_buffer_id=f"active/{checkpoint_id}/{sequence}",
            staging_keys=list(keys),
            prefix_token_count=live.continued + sealed,
            prefix_digest=snapshot.digest,
            effective_output_limit=live.max_tokens,
        )
        results.append((record, ack))
    return results


def build_cut_record(capture: RolloutTokenCapture, live: LiveCall, count: int) -> StagedCallRecord:
    """The next cut record of a live call: the cumulative prefix first, then chunks."""
    generated = live.generated[:count]
    log_probs = live.log_probs[:count]
    if not live.staged:
        return capture.build_prefix_record(
            live.call,
            prompt_token_ids=live.engine_prompt,
            generated_token_ids=generated,
            generated_logprobs=log_probs,
        )
    return capture.build_generation_chunk_record(
        live.call,
        staged=live.staged,
        generated_token_ids=generated[live.staged_count :],
        generated_logprobs=log_probs[live.staged_count :],
    )


def terminal_ack(
    finished: Finished | None, checkpoint_id: str, prefix: GenerationCutPrefix
) -> GenerationCutPrefixAck:
    """The ack of a call that finished before the cut: its staged record, if any."""
    if finished is None or finished.capture_key != prefix.capture_key:
        return GenerationCutPrefixAck.failure(prefix)
    coords = finished.coords
    if coords.disposition != "staged" or coords.digest is None or coords.staging_key is None:
        return GenerationCutPrefixAck.failure(prefix, terminal_finish_reason=finished.finish_reason)
    return GenerationCutPrefixAck(
        **prefix.fields(),
        disposition="durable_prefix",
        cut_kind="terminal_completion",
        frozen_buffer_id=f"terminal/{checkpoint_id}",
        staging_keys=[coords.staging_key],
        prefix_token_count=finished.generated_count,
        prefix_digest=coords.digest,
        effective_output_limit=finished.max_tokens,
        terminal_finish_reason=finished.finish_reason,
    )
