"""The decoding core of the transformers engine: a causal LM loaded for greedy decoding, and the
batch operations the scheduler runs on its worker thread (prefill, one step, dropping rows,
merging batches), plus decoding one call alone (what the drill's oracle re-decodes with).

Rows are left-padded to one width; the attention mask is 0 over the padding and every row's
positions are explicit, so padding never shifts a row's rotary positions (D308).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.utils import logging as transformers_logging

from .engines import EngineError
from .tiny_model import read_engine_file

DTYPES: Final = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
"""``--dtype`` → the torch type the model computes in."""
TORCH_THREADS: Final = 1
"""Intra-op threads of the forward passes: a tiny model gains nothing from more, and the drill's
other servers share the cores."""


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


def select_rows(batch: Batch, keep: Sequence[int], model: LoadedModel) -> Batch | None:
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


def merge_batches(first: Batch | None, second: Batch | None, model: LoadedModel) -> Batch | None:
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


def model_summary(model: LoadedModel) -> dict[str, Any]:
    """What the drill reports of the model it ran."""
    return {
        "directory": str(model.directory),
        "dtype": model.dtype,
        "parameters": sum(p.numel() for p in model.model.parameters()),
        "config": json.loads(model.model.config.to_json_string()).get("model_type"),
    }
