"""How the policy server talks to its inference worker: generations and generation cuts.

Generations go over the data client; cut requests over a connection pool of their own, because
the data connections are busy with the very generations being cut. A worker that refuses a
restored cut (it checks the cut before generating anything) makes the call regenerate.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Final

import httpx
import structlog

from coordinator import IDLE_CONNECTION_EXPIRY_S, HttpClient, http_transport
from protocols import (
    ABORT_CALLS_PATH,
    GENERATION_CUT_PATH,
    VERIFIED_INVENTORY,
    AbortCallsRequest,
    CaptureAdmission,
    CheckpointCoordinatorUnavailableError,
    CompletionReply,
    GenerationCutInventory,
    GenerationCutReceipt,
    InternalError,
    MidflightError,
)

from .._trace.propagation import TRACE_HOOKS

ABORT_TIMEOUT_SECONDS: Final = 30.0
"""An abort waits for a call's final staging at most; a worker that does not answer is down."""
_log = structlog.get_logger("midflight.policy")

CONTROL_POOL: Final = httpx.Limits(
    max_connections=8, max_keepalive_connections=4, keepalive_expiry=IDLE_CONNECTION_EXPIRY_S
)
"""The cut and abort requests' own pool; idle connections expire before the worker closes them."""
CUT_REFUSED_STATUSES: Final = frozenset({400, 422})
"""Worker answers to a call carrying a cut that mean "not this cut": the call regenerates.

The worker checks the cut (staged prefix, digest, prompt) before it generates anything and
answers ``invalid_request`` (422) when it does not fit; 400 is what other workers use."""


class ContinuationRefused(MidflightError):
    """The worker refused a restored cut before generating: the call is sent again without it."""


def control_root(base_url: str) -> str:
    """A worker's control root: its base URL without a trailing ``/`` and ``/v1``."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


class HttpCutRequester:
    """Asks workers to cut their calls, on a connection pool of its own.

    Args:
        control_token: The bearer token of the workers' control routes.
        transport: Transport of the control client (tests inject one).
    """

    def __init__(
        self, control_token: str | None, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self._token = control_token
        self._transport = transport
        self.client: httpx.AsyncClient | None = None

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """The control client, for as long as the server runs."""
        headers = {"authorization": f"Bearer {self._token}"} if self._token else {}
        async with HttpClient(
            headers=headers,
            transport=self._transport or http_transport(CONTROL_POOL),
            event_hooks=TRACE_HOOKS,
        ) as client:
            self.client = client
            try:
                yield
            finally:
                self.client = None

    async def __call__(
        self, backend: str, inventory: GenerationCutInventory, budget_seconds: float
    ) -> GenerationCutReceipt:
        """POST the inventory to ``backend``; raise on anything but a 2xx receipt."""
        if self.client is None:
            raise RuntimeError("the cut requester is not running")
        response = await self.client.post(
            control_root(backend) + GENERATION_CUT_PATH,
            content=inventory.model_dump_json(),
            headers={"content-type": "application/json"},
            timeout=max(budget_seconds, 0.001),
        )
        response.raise_for_status()
        # Its embedded inventory is compared with ours by validate_for (the participant's next
        # step), so ours, already verified, spares digesting it again.
        return GenerationCutReceipt.model_validate_json(
            response.content, context={VERIFIED_INVENTORY: inventory}
        )

    async def abort(self, backend: str, model_call_ids: list[str]) -> None:
        """Stop these calls on ``backend`` and wait until they left (D245).

        An unreachable worker runs nothing, and one that refuses is logged: a retire never
        fails for the worker's sake.
        """
        if self.client is None:
            raise RuntimeError("the cut requester is not running")
        body = AbortCallsRequest(model_call_ids=model_call_ids)
        try:
            response = await self.client.post(
                control_root(backend) + ABORT_CALLS_PATH,
                content=body.model_dump_json(),
                headers={"content-type": "application/json"},
                timeout=ABORT_TIMEOUT_SECONDS,
            )
        except httpx.TransportError as exc:
            _log.warning("worker.abort_failed", backend=backend, error=repr(exc))
            return
        if response.status_code != 200:
            _log.warning(
                "worker.abort_refused",
                backend=backend,
                status=response.status_code,
                body=response.text[:500],
            )


async def call_worker(
    client: httpx.AsyncClient,
    prompt: list[int],
    max_tokens: int,
    admission: CaptureAdmission | None,
) -> CompletionReply:
    """One generation on the worker ``client`` points at.

    Raises:
        ContinuationRefused: The admission carries a cut and the worker refused it.
        CheckpointCoordinatorUnavailableError: The worker is unreachable.
        InternalError: The worker refused the call.
    """
    payload: dict[str, Any] = {"prompt_token_ids": prompt, "max_tokens": max_tokens}
    if admission is not None:
        payload["ng_capture"] = admission.model_dump(mode="json")
    try:
        response = await client.post("/v1/completions", json=payload)
    except httpx.TransportError as exc:
        raise CheckpointCoordinatorUnavailableError(
            f"the inference worker at {client.base_url} is unreachable: {exc!r}"
        ) from None
    continuing = admission is not None and admission.generation_cut is not None
    if continuing and response.status_code in CUT_REFUSED_STATUSES:
        raise ContinuationRefused(f"the worker refused the cut: {response.text[:500]}")
    if response.status_code != 200:
        raise InternalError(
            f"the inference worker refused the call: {response.status_code} {response.text[:500]}"
        )
    return CompletionReply.model_validate_json(response.content)
