"""The deterministic engine (``--engine deterministic``, the default): the contract's generation
function behind the engine interface.

Output token *i* of a call is :func:`~e2e._worker.generation.generate_token` of (seed, prompt,
*i*), so a continuation decodes positions ``len(prefix)`` up to ``max_tokens`` and yields exactly
the tokens of an uninterrupted call: what lets the drill prove exactly-once token for token. It
needs no package beyond the project's own.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Final

import anyio
import anyio.lowlevel

from .engine_api import EngineOptions, FinishReason, GenerationRequest, TokenSink
from .generation import generate_token

TOKEN_LOG_PROB: Final = -math.log(37)
"""Every generated token's log-prob: the worker draws uniformly from a 37-token alphabet."""
UNPACED_TOKENS_PER_YIELD: Final = 64
"""With no token delay, decoding yields to the event loop once per this many tokens, not per
token: in one process (the benches) each yield resumes the whole environment → agent → model →
worker await chain, which cost more than the tokens themselves (D253)."""


@dataclass(frozen=True)
class DeterministicEngine:
    """Decodes each call on the event loop, one token per ``token_delay_ms``.

    Args:
        seed: The generation seed.
        token_delay_ms: Delay before each generated token; with none, decoding yields once per
            :data:`UNPACED_TOKENS_PER_YIELD` tokens.
        stop_token_ids: Tokens that end a call with ``stop`` (none by default: the reference
            workload always runs to ``max_tokens``).
    """

    seed: int = 0
    token_delay_ms: float = 2.0
    stop_token_ids: frozenset[int] = frozenset()
    name: str = "deterministic"
    weight_version: int = 0

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Nothing runs beside the calls: each call decodes in its own request."""
        yield

    async def generate(self, request: GenerationRequest, tokens: TokenSink) -> FinishReason:
        """Append output tokens ``len(prefix)`` up to ``max_tokens``; ``stop`` after a stop token."""
        prompt_bytes = bytes(request.prompt_token_ids)
        start = len(request.prefix_token_ids)
        delay = self.token_delay_ms / 1000
        for position in range(start, request.max_tokens):
            if delay > 0:
                await anyio.sleep(delay)
            elif (position - start) % UNPACED_TOKENS_PER_YIELD == 0:
                await anyio.lowlevel.checkpoint()  # unpaced: yield (and see a cancel) per chunk
            token = generate_token(self.seed, prompt_bytes, position)
            tokens.append(token, TOKEN_LOG_PROB)
            if token in request.stop_token_ids:
                return "stop"
        return "length"


def build_deterministic_engine(options: EngineOptions) -> DeterministicEngine:
    """The registry's factory of the deterministic engine."""
    return DeterministicEngine(seed=options.seed, token_delay_ms=options.token_delay_ms)
