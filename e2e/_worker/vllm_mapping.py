"""The vLLM engine's side that needs no vLLM: what a call becomes in vLLM's terms, and what vLLM
streams back becomes in ours.

:mod:`~e2e._worker.vllm_engine` hands these plain values to vLLM's classes; keeping them here,
as dicts and functions over duck-typed outputs, lets the tests pin every choice on a machine
without vLLM (or a GPU). The names below are vLLM 0.33.0's, read in its source (the module
docstring of :mod:`~e2e._worker.vllm_engine` says where):

- :func:`engine_arg_kwargs` → ``AsyncEngineArgs(**kwargs)``: the model directory and its tokenizer,
  ``dtype`` (:data:`VLLM_DTYPES`), ``seed``, ``max_num_seqs`` (``--max-batch``), ``enforce_eager``,
  a small ``gpu_memory_utilization`` and ``logprobs_mode="processed_logprobs"``.
- :func:`sampling_kwargs` → ``SamplingParams(**kwargs, output_kind=RequestOutputKind.DELTA)``:
  greedy, ``max_tokens`` the call's remaining tokens, stop on exactly the request's stop ids
  (``ignore_eos``: vLLM adds nothing of its own), only the model's output tokens allowed, the
  sampled token's log-prob and no text.
- :func:`stream_call` reads ``AsyncLLM.generate``'s ``RequestOutput`` deltas into the call's
  :class:`~e2e._worker.engine_api.TokenSink`, and frees the vLLM request when the call stops early.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Protocol

import anyio

from .engine_api import EngineOptions, FinishReason, GenerationRequest, TokenSink
from .engines import EngineError
from .tiny_model import read_engine_file

_log = logging.getLogger(__name__)

VLLM_DTYPES: Final[Mapping[str, str]] = {
    "float64": "float32",
    "float32": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
}
"""``--dtype`` → vLLM's ``dtype``. vLLM computes in no float64 (its ``_STR_DTYPE_TO_TORCH_DTYPE``
holds float16, bfloat16 and float32), so float64, the worker's default, runs in float32: the vLLM
engine has no argmax-stable setting, and a continued cut may decode other tokens than the
uninterrupted call would have (D306 holds for the transformers engine only)."""
GPU_MEMORY_UTILIZATION: Final = 0.15
"""The share of the GPU one worker's vLLM takes (vLLM's default is 0.9). The tiny model needs a
fraction of it; a small share leaves room for the worker restarted after a kill -9 to start while
the killed one's memory is still being freed."""
ABORT_DEADLINE_S: Final = 5.0
"""How long freeing a stopped call's vLLM request may take before the call leaves without it."""


def vllm_dtype(dtype: str) -> str:
    """vLLM's ``dtype`` for the worker's ``--dtype``.

    Raises:
        EngineError: vLLM has no such dtype; the message names the ones it has.
    """
    mapped = VLLM_DTYPES.get(dtype)
    if mapped is None:
        raise EngineError(
            f"the vllm engine has no dtype {dtype!r}; choose one of {', '.join(VLLM_DTYPES)}"
        )
    return mapped


def model_directory(options: EngineOptions) -> Path:
    """The model directory the worker was given.

    Raises:
        EngineError: None was given, or it is not a directory.
    """
    if options.model is None:
        raise EngineError("the vllm engine needs --model DIR (build one: midflight model tiny DIR)")
    if not options.model.is_dir():
        raise EngineError(f"the vllm engine's --model {options.model} is not a directory")
    return options.model


def engine_arg_kwargs(model: Path, options: EngineOptions) -> dict[str, Any]:
    """The keyword arguments of ``AsyncEngineArgs`` for the model and the worker's options.

    Raises:
        EngineError: The dtype is not one vLLM has.
    """
    return {
        "model": str(model),
        "tokenizer": str(model),
        "dtype": vllm_dtype(options.dtype),
        "seed": options.seed,
        "max_num_seqs": options.max_batch,
        # CUDA graphs and torch.compile cost more start-up time than a tiny model ever repays.
        "enforce_eager": True,
        "gpu_memory_utilization": GPU_MEMORY_UTILIZATION,
        # The log-prob of the masked distribution the token was drawn from (allowed_token_ids
        # applied), not of the raw logits over the whole vocabulary.
        "logprobs_mode": "processed_logprobs",
        "disable_log_stats": True,  # the worker has its own metrics; vLLM's log a line per 10 s
    }


def model_stop_token_ids(model: Path) -> frozenset[int]:
    """The model's stop tokens: :data:`~e2e._worker.tiny_model.ENGINE_FILE`'s, else the
    end-of-sequence ids of its ``generation_config.json``, else of its ``config.json``."""
    named = read_engine_file(model).get("stop_token_ids")
    if named is not None:
        return frozenset(named)
    for config in ("generation_config.json", "config.json"):
        path = model / config
        if not path.exists():
            continue
        eos = json.loads(path.read_text()).get("eos_token_id")
        if eos is not None:
            return frozenset([eos] if isinstance(eos, int) else eos)
    return frozenset()


def model_output_token_ids(model: Path) -> frozenset[int] | None:
    """The tokens the model may output (:data:`~e2e._worker.tiny_model.ENGINE_FILE`'s), or
    ``None`` for any token of its vocabulary."""
    named = read_engine_file(model).get("output_token_ids")
    return None if named is None else frozenset(named)


def engine_prompt_ids(request: GenerationRequest) -> list[int]:
    """What vLLM prefills: the prompt, then the durable prefix of a continued cut."""
    return [*request.prompt_token_ids, *request.prefix_token_ids]


def sampling_kwargs(
    request: GenerationRequest, output_token_ids: frozenset[int] | None
) -> dict[str, Any]:
    """The keyword arguments of ``SamplingParams`` for one call (``output_kind`` is added by the
    engine: it is a vLLM enum).

    vLLM keeps a stop id's token in ``CompletionOutput.token_ids`` (its scheduler appends the
    token, then ``check_stop`` ends the request), so the stop token is part of the completion as
    the interface asks; ``skip_special_tokens`` and ``include_stop_str_in_output`` shape only the
    text, which ``detokenize=False`` leaves out.
    """
    stop_token_ids = sorted(request.stop_token_ids)
    allowed = (
        None if output_token_ids is None else sorted(output_token_ids | request.stop_token_ids)
    )
    return {
        "n": 1,
        "temperature": 0.0,  # greedy
        "max_tokens": request.remaining_tokens,
        "stop_token_ids": stop_token_ids,
        # vLLM would otherwise also stop on the model's EOS: the request's stop ids are the only ones.
        "ignore_eos": True,
        "allowed_token_ids": allowed,
        "logprobs": 0,  # the sampled token's log-prob alone
        "detokenize": False,
    }


def finish_reason_of(vllm_reason: str | None) -> FinishReason | None:
    """Ours for a ``CompletionOutput.finish_reason``: ``None`` while the call decodes, ``length``
    and ``stop`` as they are, and ``abort`` for the rest (vLLM's ``abort``, ``error``,
    ``repetition``): the engine gave the call up."""
    if vllm_reason is None:
        return None
    if vllm_reason == "length":
        return "length"
    if vllm_reason == "stop":
        return "stop"
    return "abort"


class SampledLogprob(Protocol):
    """``vllm.logprobs.Logprob``, as far as it is read."""

    @property
    def logprob(self) -> float: ...


class CompletionDelta(Protocol):
    """``vllm.outputs.CompletionOutput`` of a ``DELTA`` stream, as far as it is read."""

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def logprobs(self) -> Sequence[Mapping[int, SampledLogprob]] | None: ...

    @property
    def finish_reason(self) -> str | None: ...


class RequestOutputDelta(Protocol):
    """``vllm.outputs.RequestOutput`` of a ``DELTA`` stream, as far as it is read."""

    @property
    def outputs(self) -> Sequence[CompletionDelta]: ...


def only_completion(output: RequestOutputDelta) -> CompletionDelta:
    """The one completion of an ``n=1`` request's output.

    Raises:
        ValueError: The output holds another number of completions.
    """
    if len(output.outputs) != 1:
        raise ValueError(f"a vLLM output of an n=1 request held {len(output.outputs)} completions")
    return output.outputs[0]


def sampled_tokens(output: RequestOutputDelta) -> list[tuple[int, float]]:
    """The tokens a delta adds, each with its log-prob (the sampled token's entry of its
    position's ``{token_id: Logprob}``).

    Raises:
        ValueError: The delta's log-probs do not cover its tokens.
    """
    completion = only_completion(output)
    token_ids = list(completion.token_ids)
    positions = completion.logprobs
    if not token_ids:
        return []
    if positions is None or len(positions) != len(token_ids):
        given = 0 if positions is None else len(positions)
        raise ValueError(f"a vLLM delta of {len(token_ids)} tokens carried {given} log-probs")
    pairs = []
    for token_id, position in zip(token_ids, positions, strict=True):
        sampled = position.get(token_id)
        if sampled is None:
            raise ValueError(f"a vLLM delta has no log-prob for its sampled token {token_id}")
        pairs.append((token_id, float(sampled.logprob)))
    return pairs


async def stream_call(
    outputs: AsyncGenerator[RequestOutputDelta, None],
    tokens: TokenSink,
    abort: Callable[[], Awaitable[None]],
    *,
    abort_deadline_s: float = ABORT_DEADLINE_S,
) -> FinishReason:
    """Append each token of a call's vLLM stream to ``tokens`` as it comes; the call's finish.

    A call that leaves before vLLM finished it (cancelled, or failed) awaits ``abort`` first,
    shielded from the cancellation and bounded by ``abort_deadline_s``, so its slot in vLLM's
    batch is freed before the cancellation propagates. ``AsyncLLM.generate`` aborts on its own
    when it is cancelled, but only once it holds the request's queue, and that abort can itself
    be cancelled; a second abort of a gone request is a no-op in vLLM.

    Returns:
        ``length`` or ``stop``; ``abort`` when vLLM gave the call up.
    """
    finish: FinishReason | None = None
    try:
        async with contextlib.aclosing(outputs):
            async for output in outputs:
                for token_id, log_prob in sampled_tokens(output):
                    tokens.append(token_id, log_prob)
                finish = finish_reason_of(only_completion(output).finish_reason)
    finally:
        if finish is None:
            with anyio.move_on_after(abort_deadline_s, shield=True) as waited:
                await abort()
            if waited.cancelled_caught:
                _log.warning(
                    "freeing a stopped call's vLLM request took over %ss", abort_deadline_s
                )
    return "abort" if finish is None else finish  # a stream that ended unfinished: given up
