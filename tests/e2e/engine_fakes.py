"""An engine registered by the tests: the deterministic engine with a stop token, recording the
requests it was handed (what proves a finished prefix never reaches an engine)."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field

from e2e._worker.deterministic import DeterministicEngine
from e2e._worker.engine_api import EngineOptions, FinishReason, GenerationRequest, TokenSink
from e2e._worker.engines import EngineEntry

STOP_TOKEN = ord("q")
"""The recording engine's stop token."""
RECORDING_ENTRY = EngineEntry(
    factory="tests.e2e.engine_fakes:build_recording_engine",
    extra=None,
    summary="the deterministic engine with a stop token, recording its requests",
)


@dataclass
class RecordingEngine:
    """The deterministic engine stopping at :data:`STOP_TOKEN`, keeping every request it got."""

    inner: DeterministicEngine
    requests: list[GenerationRequest] = field(default_factory=list)
    name: str = "recording"
    weight_version: int = 0

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self.inner.stop_token_ids

    def running(self) -> AbstractAsyncContextManager[None]:
        return self.inner.running()

    async def generate(self, request: GenerationRequest, tokens: TokenSink) -> FinishReason:
        self.requests.append(request)
        return await self.inner.generate(request, tokens)


def build_recording_engine(options: EngineOptions) -> RecordingEngine:
    """The registry's factory of :class:`RecordingEngine`."""
    inner = DeterministicEngine(
        seed=options.seed,
        token_delay_ms=options.token_delay_ms,
        stop_token_ids=frozenset({STOP_TOKEN}),
    )
    return RecordingEngine(inner)


class Sink:
    """A call's buffer, as the worker keeps it (every engine test's :class:`TokenSink`)."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.log_probs: list[float] = []

    def append(self, token_id: int, log_prob: float) -> None:
        self.token_ids.append(token_id)
        self.log_probs.append(log_prob)
