"""What the worker asks of an inference engine: the interface every ``--engine`` implements.

The worker (:class:`~e2e._worker.engine.WorkerEngine`) owns everything of a call that is not
decoding: admission, the durable prefix of a continued cut, staging, generation cuts, aborts and
evidence. An engine only decodes. For each admitted call the worker hands it a
:class:`GenerationRequest` and the call's :class:`TokenSink`; the engine appends every token to
the sink as soon as it is produced (a cut stages the sink's tokens as they stand, so decoding is
never paused for a cut) and returns the call's :data:`FinishReason`.

A batching engine (a transformer with a KV cache, vLLM) decodes many calls together: each call's
:meth:`GenerationEngine.generate` is one request waiting on the engine's batch, and
:meth:`GenerationEngine.running` holds whatever the engine runs beside its calls (a batch
scheduler) for the server's lifetime. A call is stopped by cancelling its ``generate``; the
engine then frees what the call held (its slot in the batch, its KV cache) before the
cancellation propagates.

A continuation is an ordinary request whose ``prefix_token_ids`` is the durable prefix: the engine
decodes only :attr:`GenerationRequest.remaining_tokens` tokens after prompt + prefix (a real
engine prefills both). The worker never hands an engine a prefix that has already finished
(:func:`prefix_finish`): it answers that call itself, so no engine decodes one token too many.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

StagedFinishReason = Literal["length", "stop"]
"""How a staged call ended: what its reply and a terminal cut of it state."""
FinishReason = Literal[StagedFinishReason, "abort"]
"""Why a call ended: ``max_tokens`` reached, a stop token generated, or the engine gave it up
(the worker stages nothing of an ``abort`` and answers it as a stopped call)."""


@dataclass(frozen=True)
class GenerationRequest:
    """One call as the worker hands it to an engine.

    Attributes:
        prompt_token_ids: The call's prompt as the caller sent it.
        max_tokens: The call's output limit, the durable prefix counted.
        prefix_token_ids: The durable prefix of a continued cut, already generated (empty for a
            fresh call); the engine decodes after prompt + prefix.
        prefix_weight_version: The policy version that generated the prefix (``None`` without
            one); never newer than the engine's own (the worker checks it at admission).
        stop_token_ids: Tokens that end the call with ``stop`` once generated (the engine's own,
            such as its end-of-sequence token); the stop token is part of the completion.
    """

    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    prefix_token_ids: tuple[int, ...] = ()
    prefix_weight_version: int | None = None
    stop_token_ids: frozenset[int] = frozenset()

    @property
    def remaining_tokens(self) -> int:
        """How many tokens the engine may still generate after the prefix."""
        return self.max_tokens - len(self.prefix_token_ids)


def prefix_finish(request: GenerationRequest) -> FinishReason | None:
    """How a call whose prefix already finished ends, or ``None`` when there is more to decode.

    A prefix that ends in a stop token finishes with ``stop``, one that reached ``max_tokens``
    with ``length``: such a call is answered from its prefix, without decoding again.
    """
    prefix = request.prefix_token_ids
    if prefix and prefix[-1] in request.stop_token_ids:
        return "stop"
    if request.remaining_tokens <= 0:
        return "length"
    return None


class TokenSink(Protocol):
    """Where an engine puts a call's tokens as it produces them (the worker's buffer of it)."""

    def append(self, token_id: int, log_prob: float) -> None:
        """Take the call's next generated token and its log-prob; never retracted."""


@dataclass(frozen=True)
class EngineOptions:
    """What ``midflight serve worker`` hands an engine's factory.

    Attributes:
        seed: The generation seed.
        token_delay_ms: Delay before each generated token (the deterministic engine's pacing).
        model: The model directory of an engine that loads one (``save_pretrained`` layout);
            ``None`` for the deterministic engine, and for the transformers engine the tiny model
            built under the run root.
        dtype: The floating-point type a model engine computes in: ``float64`` (the default)
            makes its greedy decoding argmax-stable across batch shapes and prefills, so a
            continued cut decodes what the uninterrupted call would have (D306); ``float32`` is
            faster and may diverge after a cut.
        max_batch: Most calls a batching engine decodes together.
    """

    seed: int = 0
    token_delay_ms: float = 2.0
    model: Path | None = None
    dtype: str = "float64"
    max_batch: int = 64


class GenerationEngine(Protocol):
    """An inference engine behind the worker (see the module docstring for the contract).

    Attributes:
        name: The engine's registry name (``deterministic``, ...).
        weight_version: The policy version the engine generates with; the worker stamps it on
            every call it admits.
        stop_token_ids: The engine's own stop tokens, put in every request.
    """

    @property
    def name(self) -> str: ...

    @property
    def weight_version(self) -> int: ...

    @property
    def stop_token_ids(self) -> frozenset[int]: ...

    def running(self) -> AbstractAsyncContextManager[None]:
        """Run what the engine needs beside its calls for as long as the server runs."""
        ...

    async def generate(self, request: GenerationRequest, tokens: TokenSink) -> FinishReason:
        """Decode one call, appending each token to ``tokens`` as it is produced.

        Generates at most ``request.remaining_tokens`` tokens after prompt + prefix and stops
        after a token of ``request.stop_token_ids``. Cancelling the call stops it: whatever the
        engine held for it is freed before the cancellation propagates.

        Returns:
            ``length``, ``stop``, or ``abort`` when the engine gave the call up.
        """
        ...
