"""The inference worker's engine: admit calls, have the inference engine decode them, stage them,
serve generation cuts.

The inference engine (:mod:`~e2e._worker.engine_api`; the deterministic one by default) appends
each call's tokens to the call's buffer as it produces them. A call whose continued prefix already
finished is answered without the engine (:func:`~e2e._worker.engine_api.prefix_finish`). A cut
round takes every listed call's buffer as it stands (decoding goes on), builds and stages the
records of up to ``CUT_BATCH`` calls and ``CUT_BATCH_TOKENS`` new tokens at a time as one staging
batch on a worker thread, and seals a batch only if it became durable within the round's deadline: the first cut of a call stages the
cumulative prefix, later cuts stage only what was generated since. A call that finished before the cut arrived
is answered from its completion evidence (a ``terminal_completion`` cut of its staged record).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final, NoReturn

import anyio
import anyio.to_thread

from participants import (
    CaptureError,
    RolloutTokenCapture,
    collector_paused,
    rebuild_generation_cut,
)
from protocols import (
    VERIFIED_INVENTORY,
    CaptureAdmission,
    CommitCoords,
    CompletionReply,
    CompletionRequest,
    GenerationCutInventory,
    GenerationCutPrefix,
    GenerationCutPrefixAck,
    GenerationCutReceipt,
    InvalidRequestError,
    StagedEntry,
    StaleAttemptError,
    TokenStagingStore,
    compute_chain_hash,
)

from .._servers.evidence import EvidenceLog
from .cuts import Finished, LiveCall, cut_batch, cut_batches, terminal_ack
from .deterministic import DeterministicEngine
from .engine_api import (
    FinishReason,
    GenerationEngine,
    GenerationRequest,
    StagedFinishReason,
    TokenSink,
    prefix_finish,
)

_log = logging.getLogger(__name__)

TERMINAL_EVIDENCE_SECONDS: Final = 3600.0
CUT_BATCH: Final = 4096
"""Most calls staged per batch of a cut round: one segment (two fsyncs) each, sealed when
durable, so a round that outlives its deadline keeps the batches that made it."""
CUT_BATCH_TOKENS: Final = 1 << 20
"""Most tokens the new records of one batch carry (D421): at a few hundred ns of CPU a token,
about a third of a second a batch on the project's VM, so a round of long calls that outlives
its deadline loses one batch, not all of it."""


class _EngineAdapter:
    """Reads capture material from the engine's own response dict."""

    def extract_prompt_ids(self, response: dict[str, Any]) -> list[int]:
        return list(response["prompt_token_ids"])

    def extract_generation(self, response: dict[str, Any]) -> tuple[list[int], list[float]]:
        return list(response["generated_token_ids"]), list(response["generated_logprobs"])

    def extract_extras(self, response: dict[str, Any]) -> dict[str, Any] | None:
        return None


@dataclass
class _Collected:
    """The tokens of a call that stages nothing (no admission)."""

    token_ids: list[int] = field(default_factory=list)

    def append(self, token_id: int, log_prob: float) -> None:
        self.token_ids.append(token_id)


@dataclass
class WorkerEngine:
    """State and behaviour of one worker process.

    Args:
        store: Where records and cuts are staged.
        evidence: The worker's evidence log.
        inference: The inference engine that decodes the calls.
        cut_timeout_ms: How long a cut round may take; a call its round has not made durable by
            then is acked ``durable_failure``.
        name: The worker's name, part of receipt snapshot ids.
        clock: Monotonic seconds, injectable for tests.
        forget_prefix: Fault switch ``continue-without-prefix``: the inference engine is handed
            a continued call without its durable prefix (what an engine that skips the prefix's
            prefill would decode); the drill's re-decoding must catch it.
    """

    store: TokenStagingStore
    evidence: EvidenceLog
    inference: GenerationEngine = field(default_factory=DeterministicEngine)
    cut_timeout_ms: float = 5000.0
    name: str = "worker"
    clock: Callable[[], float] = time.monotonic
    forget_prefix: bool = False
    live: dict[str, LiveCall] = field(default_factory=dict)
    finished: OrderedDict[str, Finished] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        self.capture = RolloutTokenCapture(self.store, adapter=_EngineAdapter())
        self._cut_round = anyio.Lock()

    # --- completions -----------------------------------------------------------------------

    async def complete(self, request: CompletionRequest) -> CompletionReply:
        """Generate a whole completion, continuing a cut when the request carries one.

        Raises:
            InvalidRequestError: The admission, prefix or cut does not fit the request.
        """
        admission = _admission_with_cut(request)
        if admission is None:
            return await self._complete_uncaptured(request)
        if admission.model_call_id in self.live:
            raise InvalidRequestError(f"model call {admission.model_call_id!r} is already running")
        live = await anyio.to_thread.run_sync(self._begin, admission, request)
        if admission.model_call_id in self.live:  # checked again: the thread let others run
            raise InvalidRequestError(f"model call {admission.model_call_id!r} is already running")
        live.scope, live.left = anyio.CancelScope(), anyio.Event()
        self.live[admission.model_call_id] = live
        coords: CommitCoords | None = None
        finish: StagedFinishReason = "length"  # set once the engine has finished the call
        try:
            with live.scope:  # cancelled by an abort (a retire), or with the request
                reason = await self._generate(live.generation, live)
                if reason == "abort":  # the engine gave the call up: stage nothing, as an abort
                    _stale(admission, live)
                finish = reason
                response = {
                    "prompt_token_ids": live.engine_prompt,
                    "generated_token_ids": live.generated,
                    "generated_logprobs": live.log_probs,
                }
                # Never abandoned: an abort waits until the record is staged, or was never.
                coords = await anyio.to_thread.run_sync(
                    self.capture.complete_call_from_response, live.call, response
                )
                self._remember_finished(live, coords, finish)
        finally:
            self.live.pop(admission.model_call_id, None)
            live.left.set()
        if coords is None:
            _stale(admission, live)
        cut = admission.generation_cut
        await anyio.to_thread.run_sync(
            self.evidence.append,
            {
                "event": "generation",
                "capture_key": admission.rollout_id,
                "model_call_id": admission.model_call_id,
                "tokens_generated": len(live.generated),
                "tokens_continued": live.continued,
                "max_tokens": live.max_tokens,
                "continued_from": None if cut is None else cut.source_model_call_id,
                "source_capture_key": None if cut is None else cut.source_capture_key,
                "disposition": coords.disposition,
                "staging_key": coords.staging_key,
                "at": time.time(),
            },
        )
        completion = [*live.generation.prefix_token_ids, *live.generated]
        return CompletionReply(token_ids=completion, finish_reason=finish, ng_commit_coords=coords)

    async def _complete_uncaptured(self, request: CompletionRequest) -> CompletionReply:
        """A call without an admission: decoded, never staged."""
        uncaptured = GenerationRequest(
            prompt_token_ids=tuple(request.prompt_token_ids),
            max_tokens=request.max_tokens,
            stop_token_ids=self.inference.stop_token_ids,
        )
        collected = _Collected()
        finish = await self._generate(uncaptured, collected)
        if finish == "abort":
            raise StaleAttemptError("the engine gave the call up; nothing of it was staged")
        return CompletionReply(token_ids=collected.token_ids, finish_reason=finish)

    async def _generate(self, request: GenerationRequest, tokens: TokenSink) -> FinishReason:
        """The engine decodes the call, unless its continued prefix already finished it."""
        finished = prefix_finish(request)
        if finished is not None:
            return finished
        if self.forget_prefix and request.prefix_token_ids:
            request = replace(request, prefix_token_ids=(), max_tokens=request.remaining_tokens)
        return await self.inference.generate(request, tokens)

    async def abort(self, model_call_ids: Sequence[str]) -> list[str]:
        """Stop the named calls and wait until they have left; the ids that were running.

        A call stopped while it decodes stages nothing; one already staging its final record
        finishes that first (the thread is never abandoned), so once this returns nothing more
        of these calls is staged.
        """
        running = {i: self.live[i] for i in dict.fromkeys(model_call_ids) if i in self.live}
        for live in running.values():
            assert live.scope is not None  # set before the call is live
            live.scope.cancel()
        for live in running.values():
            assert live.left is not None
            await live.left.wait()
            async with live.cut_lock:  # a cut of it staging right now finishes first
                pass
        if running:
            _log.info("aborted %d call(s): %s", len(running), sorted(running))
        return list(running)

    def _begin(self, admission: CaptureAdmission, request: CompletionRequest) -> LiveCall:
        """Resolve the prefix and the cut, and admit the call (blocking: store reads, hashing)."""
        prompt = list(request.prompt_token_ids)
        prefix = self._fetch_prefix(admission)
        snapshot = None
        cut = admission.generation_cut
        if cut is not None:
            records = [self._fetch(key, "generation cut").record for key in cut.staging_keys]
            try:
                snapshot = rebuild_generation_cut(records)
            except ValueError as exc:
                raise InvalidRequestError(f"the generation cut does not rebuild: {exc}") from exc
        try:
            call = self.capture.begin_call(
                admission,
                prefix_token_ids=prefix,
                generation_cut=snapshot,
                generation_cut_staging_keys=None if cut is None else cut.staging_keys,
                weight_version=self.inference.weight_version,
            )
        except CaptureError as exc:
            raise InvalidRequestError(str(exc)) from exc
        if prompt[: admission.prev_len] != call.prefix_token_ids:
            raise InvalidRequestError("the prompt does not start with the admitted token prefix")
        continued: list[int] = []
        if snapshot is not None:
            carried = prompt[admission.prev_len :]
            split = len(carried)
            if (
                snapshot.token_ids_delta[:split] != carried
                or any(mask != 0.0 for mask in snapshot.token_mask_delta[:split])
                or any(mask != 1.0 for mask in snapshot.token_mask_delta[split:])
            ):
                raise InvalidRequestError("the generation cut does not continue this prompt")
            continued = snapshot.token_ids_delta[split:]
            if len(continued) > request.max_tokens:
                raise InvalidRequestError("the generation cut is longer than max_tokens")
        generation = GenerationRequest(
            prompt_token_ids=tuple(prompt),
            max_tokens=request.max_tokens,
            prefix_token_ids=tuple(continued),
            prefix_weight_version=None if snapshot is None else snapshot.weight_version,
            stop_token_ids=self.inference.stop_token_ids,
        )
        return LiveCall(
            call=call,
            generation=generation,
            engine_prompt=prompt + continued,
            max_tokens=request.max_tokens,
            continued=len(continued),
        )

    def _fetch(self, key: str, what: str) -> StagedEntry:
        try:
            entry = self.store.get(key)
        except ValueError as exc:
            raise InvalidRequestError(
                f"the staged {what} record {key!r} is corrupt: {exc}"
            ) from exc
        if entry is None:
            raise InvalidRequestError(f"no staged {what} record under {key!r}")
        return entry

    def _fetch_prefix(self, admission: CaptureAdmission) -> list[int] | None:
        """The parent prefix of a ``staging_chain`` admission, its chain of hashes verified."""
        if admission.mode != "token_in" or admission.required_prefix_token_ids:
            return None
        prefix: list[int] = []
        chain: str | None = None
        for key in admission.staging_chain:
            record = self._fetch(key, "parent").record
            if compute_chain_hash(chain, record.token_ids_delta) != record.chain_hash:
                raise InvalidRequestError(f"the staging chain breaks at {key!r}")
            prefix += record.token_ids_delta
            chain = record.chain_hash
        if chain != admission.parent_chain_hash:
            raise InvalidRequestError("the staging chain does not end at the parent's chain hash")
        return prefix

    def _remember_finished(
        self, live: LiveCall, coords: CommitCoords, finish_reason: StagedFinishReason
    ) -> None:
        now = self.clock()
        while self.finished:
            oldest = next(iter(self.finished.values()))
            if now - oldest.finished_at < TERMINAL_EVIDENCE_SECONDS:
                break
            self.finished.popitem(last=False)
        self.finished[live.call.model_call_id] = Finished(
            capture_key=live.capture_key,
            coords=coords,
            generated_count=live.continued + len(live.generated),
            max_tokens=live.max_tokens,
            finish_reason=finish_reason,
            finished_at=now,
        )

    # --- generation cuts -------------------------------------------------------------------

    async def cut(self, inventory: GenerationCutInventory) -> GenerationCutReceipt:
        """Make the generated prefix of every listed call durable, within the cut deadline.

        The round is staged in batches (at most :data:`CUT_BATCH` calls and
        :data:`CUT_BATCH_TOKENS` new tokens per segment of the staging store, so a batch costs a
        bounded number of fsyncs however many calls it holds); each
        batch is sealed once durable. A call whose batch fails or outlives the deadline is acked
        ``durable_failure``. Decoding is never paused.
        """
        prefixes = inventory.active_prefixes
        acks: dict[str, GenerationCutPrefixAck] = {}  # a call without one is a durable_failure
        running: list[tuple[GenerationCutPrefix, LiveCall]] = []
        for prefix in prefixes:
            live = self.live.get(prefix.model_call_id)
            if live is None:
                acks[prefix.ticket_id] = terminal_ack(
                    self.finished.get(prefix.model_call_id), inventory.checkpoint_id, prefix
                )
            elif live.capture_key == prefix.capture_key:
                running.append((prefix, live))
        # No full collection of every live call's tokens mid-round; the deadline ends it (D422).
        with anyio.move_on_after(self.cut_timeout_ms / 1000), collector_paused():
            async with self._cut_round:  # rounds one after another: each call's cuts in order
                for batch in cut_batches(running, calls=CUT_BATCH, tokens=CUT_BATCH_TOKENS):
                    try:
                        acks.update(
                            await cut_batch(
                                self.capture, self.store, inventory.checkpoint_id, batch
                            )
                        )
                    except Exception:
                        # A cut is optional: its failure only costs regeneration after a restore.
                        _log.exception("a generation-cut batch of %d call(s) failed", len(batch))
        cut_id = uuid.uuid4().hex
        # The inventory was verified when its request was parsed: not digested again here.
        return GenerationCutReceipt.model_validate(
            {
                "checkpoint_id": inventory.checkpoint_id,
                "cut_id": cut_id,
                "inventory_digest": inventory.inventory_digest,
                "inventory": inventory,
                "backend_snapshot_id": f"{self.name}/{cut_id}",
                "prefixes": [
                    acks.get(prefix.ticket_id) or GenerationCutPrefixAck.failure(prefix)
                    for prefix in prefixes
                ],
            },
            context={VERIFIED_INVENTORY: inventory},
        )


def _stale(admission: CaptureAdmission, live: LiveCall) -> NoReturn:
    """Refuse the reply of a call stopped before it was staged (aborted, or given up)."""
    raise StaleAttemptError(
        f"model call {admission.model_call_id!r} was aborted after "
        f"{len(live.generated)} tokens; nothing of it was staged"
    )


def _admission_with_cut(request: CompletionRequest) -> CaptureAdmission | None:
    """The request's admission, carrying ``ng_generation_cut`` when it came separately."""
    admission, cut = request.ng_capture, request.ng_generation_cut
    if admission is None:
        if cut is not None:
            raise InvalidRequestError("ng_generation_cut needs ng_capture")
        return None
    if cut is None or admission.generation_cut == cut:
        return admission
    if admission.generation_cut is not None:
        raise InvalidRequestError("ng_generation_cut differs from ng_capture.generation_cut")
    return admission.model_copy(update={"generation_cut": cut})
