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
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.to_thread
import torch
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.utils import logging as transformers_logging

from protocols import InvalidRequestError

from .engine_api import EngineOptions, FinishReason, GenerationRequest, TokenSink
from .engines import EngineError
from .tiny_model import read_engine_file

DTYPES: Final = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
"""``--dtype`` → the torch type the model computes in."""
TORCH_THREADS: Final = 1
"""Intra-op threads of the forward passes: a tiny model gains nothing from more, and the drill's
other servers share the cores."""
FREE_DEADLINE_S: Final = 10.0
"""How long a cancelled call waits for the scheduler to drop its row before it lets go anyway."""


class LoadedModel:
    """A causal LM loaded for greedy decoding, with the tokens it may output and stop at.

    Args:
        directory: A ``save_pretrained`` directory.
        dtype: A key of :data:`DTYPES`.

    Raises:
        EngineError: The dtype is unknown, or the directory holds no loadable model.
    """

    def __init__(self, directory: Path, dtype: str) -> None:
        if dtype not in DTYPES:
            raise EngineError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
        transformers_logging.disable_progress_bar()
        transformers_logging.set_verbosity_error()
        torch.set_num_threads(TORCH_THREADS)
        try:
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=DTYPES[dtype])
        except (OSError, ValueError) as exc:
            raise EngineError(f"no model loads from {directory}: {exc}".splitlines()[0]) from exc
        self.model = model.eval()
        self.directory = directory
        self.dtype = dtype
        config = self.model.config
        self.vocab_size = int(config.vocab_size)
        self.max_positions = int(getattr(config, "max_position_embeddings", 1 << 30))
        engine_file = read_engine_file(directory)
        stops = engine_file.get("stop_token_ids")
        if stops is None:
            eos = self.model.generation_config.eos_token_id
            stops = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.stop_token_ids = frozenset(int(t) for t in stops)
        allowed = engine_file.get("output_token_ids")
        self.output_token_ids: torch.Tensor | None = (
            None if allowed is None else torch.tensor(sorted(set(allowed)), dtype=torch.long)
        )

    def choose(self, logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """Each row's greedy token and its log-prob, from last-position logits ``[rows, vocab]``."""
        allowed = self.output_token_ids
        scores = logits.float() if logits.dtype == torch.bfloat16 else logits
        if allowed is not None:
            scores = scores[:, allowed]
        log_probs = torch.log_softmax(scores, dim=-1)
        best = log_probs.argmax(dim=-1)
        chosen = best if allowed is None else allowed[best]
        picked = log_probs.gather(1, best[:, None])[:, 0]
        return [int(t) for t in chosen.tolist()], [float(p) for p in picked.tolist()]


@dataclass
class Batch:
    """The rows decoding together: their KV cache, attention mask and each row's next token.

    Row *r* has an unemitted ``next_tokens[r]`` (chosen by the last forward pass, not yet in its
    call's sink). Rows are left-padded to one length: ``mask`` is 0 over the padding.
    """

    cache: Any
    mask: torch.Tensor
    positions: torch.Tensor
    next_tokens: list[int]
    next_log_probs: list[float]

    @property
    def rows(self) -> int:
        """How many rows decode."""
        return len(self.next_tokens)


def _layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _select(batch: Batch, keep: Sequence[int], model: LoadedModel) -> Batch | None:
    """The rows ``keep`` of ``batch`` (their cache slices copied), or ``None`` when none stay."""
    if not keep:
        return None
    if list(keep) == list(range(batch.rows)):
        return batch
    index = torch.tensor(list(keep), dtype=torch.long)
    layers = [(k.index_select(0, index), v.index_select(0, index)) for k, v in _layers(batch.cache)]
    # Columns every remaining row pads are dropped too: a long-gone row no longer widens the rest.
    mask = batch.mask.index_select(0, index)
    first = int(mask.any(dim=0).nonzero()[0])
    layers = [(k[:, :, first:], v[:, :, first:]) for k, v in layers]
    return Batch(
        cache=DynamicCache(ddp_cache_data=layers, config=model.model.config),
        mask=mask[:, first:],
        positions=batch.positions.index_select(0, index),
        next_tokens=[batch.next_tokens[r] for r in keep],
        next_log_probs=[batch.next_log_probs[r] for r in keep],
    )


def _merge(first: Batch | None, second: Batch | None, model: LoadedModel) -> Batch | None:
    """One batch of both one's rows, then the other's, left-padded to the longer one."""
    if first is None or second is None:
        return first or second
    width = max(first.mask.shape[1], second.mask.shape[1])

    def pad(tensor: torch.Tensor, dim: int) -> torch.Tensor:
        missing = width - tensor.shape[dim]
        if missing == 0:
            return tensor
        shape = list(tensor.shape)
        shape[dim] = missing
        return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)

    layers = [
        (torch.cat([pad(k1, 2), pad(k2, 2)]), torch.cat([pad(v1, 2), pad(v2, 2)]))
        for (k1, v1), (k2, v2) in zip(_layers(first.cache), _layers(second.cache), strict=True)
    ]
    return Batch(
        cache=DynamicCache(ddp_cache_data=layers, config=model.model.config),
        mask=torch.cat([pad(first.mask, 1), pad(second.mask, 1)]),
        positions=torch.cat([first.positions, second.positions]),
        next_tokens=first.next_tokens + second.next_tokens,
        next_log_probs=first.next_log_probs + second.next_log_probs,
    )


def prefill(model: LoadedModel, inputs: Sequence[Sequence[int]]) -> Batch:
    """A batch of ``inputs`` (each a prompt + prefix), left-padded, with each first token chosen."""
    with torch.inference_mode():
        return _prefill(model, inputs)


def _prefill(model: LoadedModel, inputs: Sequence[Sequence[int]]) -> Batch:
    width = max(len(tokens) for tokens in inputs)
    ids = torch.zeros((len(inputs), width), dtype=torch.long)
    mask = torch.zeros((len(inputs), width), dtype=torch.long)
    for row, tokens in enumerate(inputs):
        ids[row, width - len(tokens) :] = torch.tensor(list(tokens), dtype=torch.long)
        mask[row, width - len(tokens) :] = 1
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.model.config)
    logits = model.model(
        input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True
    ).logits[:, -1]
    tokens, log_probs = model.choose(logits)
    return Batch(cache, mask, positions[:, -1], tokens, log_probs)


def step(model: LoadedModel, batch: Batch) -> Batch:
    """Feed every row its next token; each row's following token chosen."""
    with torch.inference_mode():
        return _step(model, batch)


def _step(model: LoadedModel, batch: Batch) -> Batch:
    ids = torch.tensor(batch.next_tokens, dtype=torch.long)[:, None]
    mask = torch.cat([batch.mask, batch.mask.new_ones((batch.rows, 1))], dim=1)
    positions = batch.positions + 1
    logits = model.model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions[:, None],
        cache=batch.cache,
        use_cache=True,
    ).logits[:, -1]
    tokens, log_probs = model.choose(logits)
    return Batch(batch.cache, mask, positions, tokens, log_probs)


def greedy_decode(
    model: LoadedModel, tokens: Sequence[int], max_new: int, stop_token_ids: frozenset[int]
) -> list[int]:
    """What the model decodes alone after ``tokens``: at most ``max_new`` tokens, stop included
    (the oracle's re-decoding)."""
    out: list[int] = []
    if max_new <= 0:
        return out
    batch = prefill(model, [tokens])
    while True:
        token = batch.next_tokens[0]
        out.append(token)
        if token in stop_token_ids or len(out) >= max_new:
            return out
        batch = step(model, batch)


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
        kept = None if batch is None else _select(batch, keep, self.model)
        stepped = None if kept is None else step(self.model, kept)
        joined = prefill(self.model, joining) if joining else None
        return _merge(stepped, joined, self.model)

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


def model_summary(model: LoadedModel) -> dict[str, Any]:
    """What the drill reports of the model it ran."""
    return {
        "directory": str(model.directory),
        "dtype": model.dtype,
        "parameters": sum(p.numel() for p in model.model.parameters()),
        "config": json.loads(model.model.config.to_json_string()).get("model_type"),
    }
