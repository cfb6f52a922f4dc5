"""The transformers engine (``--engine transformers``): a real decoder-only transformer on the CPU.

A Hugging Face ``transformers`` causal LM (the tiny model of ``midflight model tiny``, or any
``save_pretrained`` directory) decodes greedily with a KV cache, many calls together. One
scheduler task runs beside the calls for the server's lifetime (:meth:`TransformersEngine.running`)
and repeats one iteration:

1. every row's newest token goes to its call's sink (a cut stages the sink as it stands, so a cut
   takes a real mid-generation prefix while decoding goes on), and a row that generated a stop
   token or its last allowed token finishes;
2. on a worker thread, the rows that finished or were cancelled leave the batch (their slice of
   the KV cache is dropped), the remaining rows decode one step together, and calls that arrived
   meanwhile are prefilled (prompt + durable prefix, left-padded) and join the batch: continuous
   batching, one forward pass per step for the whole batch.

Greedy means the argmax of the logits over the tokens the model may output (``midflight.json``
beside the model names them; every token otherwise); a token's log-prob is its log-softmax over
those tokens. A continuation is a fresh prefill of prompt + prefix, whose arithmetic differs from
the uninterrupted decode's: in ``float32`` a near-tie between two logits can then flip and the
continuation diverge after the cut; ``float64`` (the default) makes such a flip need two logits
within about 1e-13 of each other, which no drill has met (D306).

Needs the ``engine`` extra (``pip install -e '.[engine]'``).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Final

import anyio
import anyio.to_thread
import torch

from protocols import InvalidRequestError

from .engine_api import EngineOptions, FinishReason, GenerationRequest, TokenSink
from .engines import EngineError
from .transformers_decode import Batch, LoadedModel, merge_batches, prefill, select_rows, step

FREE_DEADLINE_S: Final = 10.0
"""How long a cancelled call waits for the scheduler to drop its row before it lets go anyway."""


@dataclass(eq=False)
class _Slot:
    """One call waiting for, or decoding in, the batch."""

    request: GenerationRequest
    sink: TokenSink
    done: anyio.Event = field(default_factory=anyio.Event)
    freed: anyio.Event = field(default_factory=anyio.Event)
    generated: int = 0
    finish: FinishReason | None = None
    error: BaseException | None = None
    cancelled: bool = False


class TransformersEngine:
    """Greedy continuous-batching decoding of a ``transformers`` causal LM on the CPU.

    Args:
        model: The loaded model.
        max_batch: Most calls decoding together; later calls wait for a row.
        step_delay_s: A pause before each decode step: a tiny model paced like a larger one,
            so that a drill's checkpoints find calls mid-generation (0: as fast as it runs).
    """

    name: Final = "transformers"
    weight_version: Final = 0

    def __init__(
        self, model: LoadedModel, *, max_batch: int = 64, step_delay_s: float = 0.0
    ) -> None:
        self.model = model
        self.max_batch = max(1, max_batch)
        self.step_delay_s = max(0.0, step_delay_s)
        self._pending: list[_Slot] = []
        self._rows: list[_Slot] = []
        self._batch: Batch | None = None
        self._wake = anyio.Event()
        self._serving = False

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """The model's stop tokens (``midflight.json``, else its generation config's EOS)."""
        return self.model.stop_token_ids

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Run the scheduler for as long as the server serves."""
        async with anyio.create_task_group() as group:
            group.start_soon(self._schedule)
            self._serving = True
            try:
                yield
            finally:
                self._serving = False
                group.cancel_scope.cancel()

    async def generate(self, request: GenerationRequest, tokens: TokenSink) -> FinishReason:
        """Queue the call for the batch and wait until it finishes (see the module docstring).

        Raises:
            InvalidRequestError: A token id is outside the vocabulary, or prompt + ``max_tokens``
                is longer than the model's positions.
            RuntimeError: The engine is not running.
        """
        if not self._serving:
            raise RuntimeError("the transformers engine is not running")
        if request.remaining_tokens <= 0:
            return "length"
        inputs = (*request.prompt_token_ids, *request.prefix_token_ids)
        if not inputs:
            raise InvalidRequestError("the transformers engine needs a non-empty prompt")
        if any(not 0 <= t < self.model.vocab_size for t in inputs):
            raise InvalidRequestError(
                f"a token id is outside the model's vocabulary (0-{self.model.vocab_size - 1})"
            )
        longest = len(request.prompt_token_ids) + request.max_tokens
        if longest > self.model.max_positions:
            raise InvalidRequestError(
                f"prompt + max_tokens is {longest} tokens; the model has "
                f"{self.model.max_positions} positions"
            )
        slot = _Slot(request, tokens)
        self._pending.append(slot)
        self._wake.set()
        try:
            await slot.done.wait()
        except BaseException:
            slot.cancelled = True  # the scheduler drops its row (or its queue entry) next
            self._wake.set()
            with anyio.move_on_after(FREE_DEADLINE_S, shield=True):
                await slot.freed.wait()
            raise
        if slot.error is not None:
            raise slot.error
        assert slot.finish is not None
        return slot.finish

    async def _schedule(self) -> None:
        while True:
            self._emit()
            keep = [
                r for r, slot in enumerate(self._rows) if slot.finish is None and not slot.cancelled
            ]
            for slot in self._pending:
                if slot.cancelled:
                    slot.freed.set()
            self._pending = [slot for slot in self._pending if not slot.cancelled]
            room = self.max_batch - len(keep)
            joining, self._pending = self._pending[:room], self._pending[room:]
            if not keep and not joining:
                for slot in self._rows:
                    slot.freed.set()
                self._rows, self._batch = [], None
                await self._wake.wait()
                self._wake = anyio.Event()
                continue
            kept = set(keep)
            leaving = [slot for r, slot in enumerate(self._rows) if r not in kept]
            staying = [self._rows[r] for r in keep]
            if self.step_delay_s:
                await anyio.sleep(self.step_delay_s)
            try:
                self._batch = await anyio.to_thread.run_sync(
                    self._advance, self._batch, keep, [self._inputs(s) for s in joining]
                )
            except Exception as exc:  # a failed forward fails the calls it carried, not the engine
                for slot in (*staying, *joining):
                    slot.error, slot.finish = exc, "abort"
                    slot.done.set()
                    slot.freed.set()
                self._rows, self._batch = [], None
                continue
            finally:
                for slot in leaving:
                    slot.freed.set()
            self._rows = staying + joining

    @staticmethod
    def _inputs(slot: _Slot) -> tuple[int, ...]:
        return (*slot.request.prompt_token_ids, *slot.request.prefix_token_ids)

    def _advance(
        self, batch: Batch | None, keep: list[int], joining: list[tuple[int, ...]]
    ) -> Batch | None:
        """On the worker thread: drop the rows not kept, decode a step, prefill the newcomers."""
        with torch.inference_mode():
            return self._advance_batch(batch, keep, joining)

    def _advance_batch(
        self, batch: Batch | None, keep: list[int], joining: list[tuple[int, ...]]
    ) -> Batch | None:
        kept = None if batch is None else select_rows(batch, keep, self.model)
        stepped = None if kept is None else step(self.model, kept)
        joined = prefill(self.model, joining) if joining else None
        return merge_batches(stepped, joined, self.model)

    def _emit(self) -> None:
        """Every row's newest token to its sink; a row that stopped or hit its limit finishes."""
        if self._batch is None:
            return
        for slot, token, log_prob in zip(
            self._rows, self._batch.next_tokens, self._batch.next_log_probs, strict=True
        ):
            if slot.finish is not None or slot.cancelled:
                continue
            slot.sink.append(token, log_prob)
            slot.generated += 1
            if token in slot.request.stop_token_ids:
                slot.finish = "stop"
            elif slot.generated >= slot.request.remaining_tokens:
                slot.finish = "length"
            if slot.finish is not None:
                slot.done.set()


def build_transformers_engine(options: EngineOptions) -> TransformersEngine:
    """The registry's factory: the model of ``options.model`` loaded in ``options.dtype``.

    Raises:
        EngineError: No model directory was given, or none loads from it.
    """
    if options.model is None:
        raise EngineError("the transformers engine needs --model DIR (midflight model tiny DIR)")
    return TransformersEngine(
        LoadedModel(options.model, options.dtype),
        max_batch=options.max_batch,
        step_delay_s=options.token_delay_ms / 1000,
    )
