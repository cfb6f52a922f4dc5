"""Generation cuts on the deterministic worker: the state of a live call, and a cut batch.

A cut round splits its calls into batches of a bounded number of calls and of new tokens
(:func:`cut_batches`, D421). A batch takes each call's cut lock without yielding, fixes how many
tokens each call's cut covers (decoding goes on past that point), then builds every new record,
stages them as one staging batch (``put_entries``: one segment, two fsyncs) and builds every ack,
all in one worker-thread job. Each call keeps its staged records as a ``StagedPrefix`` whose
columns are encoded once, so a later cut's chunk hashes and receipt digest cost no pass over the
call's earlier tokens (D420). A batch is sealed only once it is durable; a call that finished
before the cut arrived is answered from its completion evidence (a ``terminal_completion`` ack,
D251).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import anyio
import anyio.to_thread

from participants import ActiveCall, RolloutTokenCapture, put_entries
from protocols import (
    CommitCoords,
    GenerationCutPrefix,
    GenerationCutPrefixAck,
    StagedEntry,
    StagedPrefix,
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
    staged: StagedPrefix = field(init=False, repr=False)
    staged_keys: list[str] = field(default_factory=list)
    staged_count: int = 0
    last_sequence: int = 0
    sealed_sequence: int = 0
    cut_lock: anyio.Lock = field(default_factory=anyio.Lock)
    # Made on the event loop once the call is admitted (_begin runs in a worker thread).
    scope: anyio.CancelScope | None = None
    left: anyio.Event | None = None

    def __post_init__(self) -> None:
        self.staged = RolloutTokenCapture.staged_prefix(self.call)

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


def new_tokens(live: LiveCall) -> int:
    """Tokens the call's next cut record would carry: its whole delta first, then a chunk."""
    if not live.staged:
        return len(live.engine_prompt) - live.call.admission.prev_len + len(live.generated)
    return max(len(live.generated) - live.staged_count, 0)


def cut_batches(
    running: Sequence[tuple[GenerationCutPrefix, LiveCall]], *, calls: int, tokens: int
) -> Iterator[list[tuple[GenerationCutPrefix, LiveCall]]]:
    """``running`` in order, in batches of at most ``calls`` calls whose new records carry at
    most ``tokens`` tokens together (a call carrying more is a batch of its own), D421."""
    batch: list[tuple[GenerationCutPrefix, LiveCall]] = []
    weight = 0
    for item in running:
        carried = new_tokens(item[1])
        if batch and (len(batch) >= calls or weight + carried > tokens):
            yield batch
            batch, weight = [], 0
        batch.append(item)
        weight += carried
    if batch:
        yield batch


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
        for plan, (longer, _) in zip(plans, staged, strict=True):
            if longer is not None and plan.key is not None:
                live = plan.live
                live.staged = longer
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
) -> list[tuple[StagedPrefix | None, GenerationCutPrefixAck]]:
    """Build every new cut record, stage them as one batch, and build every ack (blocking;
    the calls' cut locks are held, so their staged records cannot change meanwhile). Each call
    with a new record gets its prefix through it, to keep once the batch is durable."""
    built: list[tuple[CutPlan, StagedPrefix | None]] = []
    entries = []
    for plan in plans:
        prefix = None
        if plan.key is not None:
            prefix = build_cut_prefix(capture, plan.live, plan.count)
            entries.append(StagedEntry(staging_key=plan.key, record=prefix.records[-1]))
        built.append((plan, prefix))
    put_entries(store, entries)
    results: list[tuple[StagedPrefix | None, GenerationCutPrefixAck]] = []
    for plan, prefix in built:
        live = plan.live
        keys = live.staged_keys if plan.key is None else [*live.staged_keys, plan.key]
        sealed = live.staged_count if prefix is None else plan.count
        sequence = live.sealed_sequence if prefix is None else plan.sequence
        ack = GenerationCutPrefixAck(
            **plan.prefix.fields(),
            disposition="durable_prefix",
            cut_kind="active_prefix",
            frozen_buffer_id=f"active/{checkpoint_id}/{sequence}",
            staging_keys=list(keys),
            prefix_token_count=live.continued + sealed,
            prefix_digest=(live.staged if prefix is None else prefix).digest,
            effective_output_limit=live.max_tokens,
        )
        results.append((prefix, ack))
    return results


def build_cut_prefix(capture: RolloutTokenCapture, live: LiveCall, count: int) -> StagedPrefix:
    """The call's staged prefix extended by its next cut record (the cumulative record first,
    then chunks of what was generated since), each column encoded once (D423)."""
    return capture.build_cut(
        live.call,
        live.staged,
        prompt_token_ids=live.engine_prompt,
        generated_token_ids=live.generated[live.staged_count : count],
        generated_logprobs=live.log_probs[live.staged_count : count],
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
