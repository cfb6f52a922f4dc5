"""The vLLM engine (``--engine vllm --model DIR``): each call one request of vLLM's async engine,
decoded in vLLM's continuous batch on a GPU.

Needs the ``vllm`` extra (``pip install -e '.[vllm]'``); the registry imports this module only
when the engine is chosen, so a missing vLLM is its one-line error. What a call becomes in vLLM's
terms is :mod:`~e2e._worker.vllm_mapping` (plain data, tested without vLLM); this module only hands
it to vLLM's classes.

- ``running()`` builds ``AsyncLLM.from_engine_args(AsyncEngineArgs(...))`` for the server's
  lifetime (it loads the model and starts vLLM's engine-core process) and ``shutdown()``\\ s it.
  Both block the event loop, as in vLLM's own API server: they run before the worker serves and
  after it stopped.
- ``generate()`` sends ``TokensPrompt(prompt_token_ids=prompt + prefix)`` with greedy
  ``SamplingParams`` (``output_kind=RequestOutputKind.DELTA``) and appends each token of each
  delta to the call's sink as ``AsyncLLM.generate`` yields it. A cancelled call aborts its vLLM
  request (``AsyncLLM.abort``) before the cancellation propagates.
- No pause for a cut: issue 22 sketched ``AsyncLLM.pause_generation(mode="keep")``, each request's
  output so far as the prefix, then ``AsyncLLM.resume_generation()``. Both exist in vLLM 0.33.0,
  but the worker cuts from the sink, which holds every token vLLM has streamed (D302), so a pause
  would only stall the batch while the round stages.
- ``weight_version`` is 0 (the worker serves one policy); the stop tokens are ``midflight.json``'s,
  else the model's ``generation_config.json`` end-of-sequence ids.

vLLM computes in no float64: ``--dtype float64`` (the default) runs in float32, so this engine is
not argmax-stable across batch shapes and prefills, and a continued cut may decode other tokens
than the uninterrupted call would have. vLLM's batch-invariant kernels (``VLLM_BATCH_INVARIANT=1``,
``vllm/envs.py``) aim at that and are not enabled: untried here, and a process-wide setting.

The vLLM names used, as read in the vLLM 0.33.0 wheel from PyPI (the same paths in
``vllm-project/vllm``):

- ``vllm/v1/engine/async_llm.py``: ``AsyncLLM.from_engine_args(engine_args)``,
  ``AsyncLLM.generate(prompt, sampling_params, request_id)`` (an async generator of
  ``RequestOutput``; on ``CancelledError``/``GeneratorExit`` it aborts the request itself, by its
  internal id, once it holds its queue), ``AsyncLLM.abort(request_id)`` (an external id is mapped
  to its internal ones by ``OutputProcessor.abort_requests``), ``AsyncLLM.shutdown(timeout=None)``,
  ``pause_generation(mode=..., clear_cache=...)``, ``resume_generation()``; ``PauseMode =
  Literal["abort", "wait", "keep"]`` is in ``vllm/v1/engine/__init__.py``.
- ``vllm/engine/arg_utils.py``: ``AsyncEngineArgs(EngineArgs)`` with ``model``, ``tokenizer``,
  ``dtype``, ``seed``, ``max_num_seqs``, ``enforce_eager``, ``gpu_memory_utilization``,
  ``logprobs_mode``, ``disable_log_stats``.
- ``vllm/sampling_params.py``: ``SamplingParams`` with ``n``, ``temperature`` (0: greedy),
  ``max_tokens`` (at least 1), ``stop_token_ids``, ``ignore_eos``, ``allowed_token_ids``,
  ``logprobs``, ``detokenize``, ``output_kind``; ``RequestOutputKind.DELTA``;
  ``update_from_generation_config`` adds the model's EOS ids only without ``ignore_eos``.
- ``vllm/inputs/llm.py``: ``TokensPrompt`` (``prompt_token_ids``), re-exported as
  ``vllm.TokensPrompt``; ``vllm/__init__.py`` re-exports ``AsyncEngineArgs`` and ``SamplingParams``.
- ``vllm/outputs.py``: ``RequestOutput.outputs``, ``CompletionOutput.token_ids``, ``.logprobs``
  (``list[dict[int, Logprob]]``, ``vllm/logprobs.py``), ``.finish_reason`` (a string of
  ``FINISH_REASON_STRINGS = ("stop", "length", "abort", "error", "repetition")``,
  ``vllm/v1/engine/__init__.py``); ``RequestOutput.add(..., aggregate=True)`` merges deltas a slow
  reader has not taken yet, so none is lost.
- ``vllm/v1/core/sched/scheduler.py`` (``_update_request_with_output``) and
  ``vllm/v1/core/sched/utils.py`` (``check_stop``): a stop id's token is appended before the
  request stops, so it is part of ``token_ids``.
- ``vllm/v1/sample/sampler.py``: with greedy sampling and ``processed_logprobs`` the log-probs are
  a log-softmax of the logits after the ``allowed_token_ids`` mask.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from vllm import AsyncEngineArgs, SamplingParams, TokensPrompt
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM

from .engine_api import EngineOptions, FinishReason, GenerationRequest, TokenSink
from .vllm_mapping import (
    engine_arg_kwargs,
    engine_prompt_ids,
    model_directory,
    model_output_token_ids,
    model_stop_token_ids,
    sampling_kwargs,
    stream_call,
)


@dataclass(eq=False)
class VllmEngine:
    """Decodes every call as one request of a vLLM ``AsyncLLM`` that runs while the server runs.

    Args:
        engine_args: The keyword arguments of ``AsyncEngineArgs``
            (:func:`~e2e._worker.vllm_mapping.engine_arg_kwargs`).
        stop_token_ids: The model's stop tokens, put in every request.
        output_token_ids: The tokens a call may generate (``None``: any of the vocabulary).
    """

    engine_args: dict[str, Any]
    stop_token_ids: frozenset[int]
    output_token_ids: frozenset[int] | None
    name: str = "vllm"
    weight_version: int = 0
    _llm: Any = field(default=None, init=False, repr=False)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Load the model into a vLLM engine for as long as the server runs; shut it down after."""
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self.engine_args))
        self._llm = llm
        try:
            yield
        finally:
            self._llm = None
            llm.shutdown()

    async def generate(self, request: GenerationRequest, tokens: TokenSink) -> FinishReason:
        """Decode the call as one vLLM request, appending each token as vLLM streams it.

        Raises:
            RuntimeError: The engine is not running (``running()`` was not entered).
        """
        llm = self._llm
        if llm is None:
            raise RuntimeError("the vllm engine is not running")
        request_id = f"midflight-{uuid.uuid4().hex}"
        params = SamplingParams(
            **sampling_kwargs(request, self.output_token_ids),
            output_kind=RequestOutputKind.DELTA,
        )
        prompt = TokensPrompt(prompt_token_ids=engine_prompt_ids(request))

        async def abort() -> None:
            await llm.abort(request_id)

        return await stream_call(llm.generate(prompt, params, request_id), tokens, abort)


def build_vllm_engine(options: EngineOptions) -> VllmEngine:
    """The registry's factory of the vLLM engine (the model loads when ``running()`` is entered).

    Raises:
        EngineError: No model directory, or a dtype vLLM does not have.
    """
    model = model_directory(options)
    return VllmEngine(
        engine_args=engine_arg_kwargs(model, options),
        stop_token_ids=model_stop_token_ids(model),
        output_token_ids=model_output_token_ids(model),
    )
