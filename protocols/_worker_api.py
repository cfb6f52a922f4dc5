"""The deterministic inference worker's completion and abort routes, on the wire.

``POST /v1/completions`` takes the prompt as token ids, the output limit, the capture admission
(``ng_capture``) and optionally a generation cut to continue (``ng_generation_cut``), and answers
the whole completion with the worker's commit coordinates. ``POST /ng-control/v1/abort`` (control
token) stops the named calls and answers once they have left: nothing of theirs is staged after.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

from pydantic import Field

from ._cuts import GenerationCutContinuation
from ._staging import CaptureAdmission, CommitCoords
from ._strict import StrictWireModel

ABORT_CALLS_PATH: Final = "/ng-control/v1/abort"
"""Where a worker stops model calls (control token); the policy server calls it at a retire."""

MAX_COMPLETION_TOKENS: Final = 65536
MAX_PROMPT_TOKENS: Final = 1_048_576

TokenByte = Annotated[int, Field(ge=0, le=255)]


class CompletionRequest(StrictWireModel):
    """Body of ``POST /v1/completions``.

    Attributes:
        prompt_token_ids: The rendered prompt (bytes).
        max_tokens: The call's output limit, a continued cut's prefix counted: the worker generates
            at most this many tokens (fewer when a stop token ends the call).
        ng_capture: The model server's admission; without it nothing is staged.
        ng_generation_cut: A durable prefix to continue; the same as ``ng_capture.generation_cut``
            when both are given.
    """

    prompt_token_ids: list[TokenByte] = Field(min_length=1, max_length=MAX_PROMPT_TOKENS)
    max_tokens: int = Field(ge=1, le=MAX_COMPLETION_TOKENS)
    ng_capture: CaptureAdmission | None = None
    ng_generation_cut: GenerationCutContinuation | None = None


class CompletionReply(StrictWireModel):
    """Reply of ``POST /v1/completions``: the whole completion, cut prefix included."""

    token_ids: list[int]
    finish_reason: Literal["stop", "length"]
    ng_commit_coords: CommitCoords | None = None


MAX_ABORTED_CALLS: Final = 10_000


class AbortCallsRequest(StrictWireModel):
    """Body of ``POST /ng-control/v1/abort``: the model calls to stop (a retire's, say)."""

    model_call_ids: list[Annotated[str, Field(min_length=1, max_length=200)]] = Field(
        max_length=MAX_ABORTED_CALLS
    )


class AbortCallsReply(StrictWireModel):
    """Reply of ``POST /ng-control/v1/abort``: the calls that were running and have now left."""

    aborted: list[str]
