"""One model call through the policy server: gate, capture, worker, custody, egress.

Chat completions, the Responses API and the Messages API (:mod:`e2e._servers.policy_apis`) reach one
handler, :meth:`PolicyServer.serve`. A call under ``/ng-rollout/<capture_key>/`` renders its
messages into prompt bytes, passes the gate (a retired attempt is refused; while a checkpoint is
open the call waits), has its parent resolved into a ``CaptureAdmission``
(:func:`participants.resolve_admission`), has the worker generate and stage it under that
admission, records the worker's commit coordinates as a custody row
(:func:`participants.record_custody`), then waits at egress while a checkpoint is open (the
response is held) and logs the response to the evidence file, fsynced, before sending it. A plain
call (no prefix) is untagged: gated and held the same way, but never captured nor cut.

After a restore, a re-issued call whose request matches a restored cut sends the cut's
continuation with its admission and the worker generates only the remainder.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.to_thread
import httpx
from fastapi.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from coordinator import HttpClient
from participants import (
    ModelParticipant,
    ModelTicket,
    generation_cut_restart_reason,
    record_custody,
    resolve_admission,
)
from protocols import (
    CaptureAdmission,
    CaptureLedger,
    CompletionReply,
    EpisodeId,
    InvalidRequestError,
    RequestItem,
    StaleAttemptError,
    WireError,
    as_request_items,
    conversation_digest,
    decode,
    encode,
    render_prompt,
)

from .._trace.propagation import TRACE_HOOKS
from .evidence import EvidenceLog
from .peer_pool import HELD_CALL_TIMEOUT, peer_transport
from .policy_apis import ModelApi, ModelCall, ModelReply
from .worker_client import ContinuationRefused, call_worker


def request_digest(prompt: list[int]) -> str:
    """SHA-256 hex of a call's rendered prompt bytes (the evidence's request digest)."""
    return hashlib.sha256(bytes(prompt)).hexdigest()


class _ReleasingResponse(JSONResponse):
    """A JSON response that releases the call's ticket once its bytes are sent (or failed)."""

    def __init__(self, content: Any, release: Callable[[], None]) -> None:
        super().__init__(content)
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


class PolicyServer:
    """The data plane of one policy server process.

    Args:
        participant: The model participant (gate and ledger).
        evidence: The egress evidence log.
        worker_url: Base URL of the inference worker.
        worker_transport: Transport of the worker client (tests inject one).
    """

    def __init__(
        self,
        participant: ModelParticipant,
        evidence: EvidenceLog,
        worker_url: str,
        worker_transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.participant = participant
        self.ledger: CaptureLedger = participant.ledger
        self.evidence = evidence
        self.worker_url = worker_url
        self._transport = worker_transport
        self.client: httpx.AsyncClient | None = None

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """The worker client, for as long as the server runs."""
        async with HttpClient(
            base_url=self.worker_url,
            timeout=HELD_CALL_TIMEOUT,
            transport=self._transport or peer_transport(),
            event_hooks=TRACE_HOOKS,
        ) as client:
            self.client = client
            try:
                yield
            finally:
                self.client = None

    async def serve(self, key: str | None, call: ModelCall, api: ModelApi) -> JSONResponse:
        """Serve one model call of the attempt ``key`` (``None``: untagged), in ``api``'s shape.

        Every API reaches this one handler (see the module docstring). An untagged call passes
        the gate like any other but is never captured, cut or written to the evidence.
        """
        episode = None if key is None else EpisodeId.from_capture_key(key)
        try:
            prompt = encode(render_prompt(call.messages))
            # Validated once, and before admission, so a refusal leaves no ticket behind: the
            # digest, the lineage matcher and the custody row all read the items (D261).
            items = as_request_items(call.messages)
        except ValueError as exc:  # a framing byte, a character outside Latin-1, a bad item
            raise InvalidRequestError(f"messages cannot be rendered: {exc}") from None
        ticket = await self.participant.admit(episode)
        ticket.request_digest = conversation_digest(items)
        ticket.restart_reason = generation_cut_restart_reason(call.constraints)
        gate = self.participant.gate
        if key is not None:
            # Logged before the worker is asked: a call re-executed after a restore shows up
            # even if its response is never delivered.
            await anyio.to_thread.run_sync(
                self.evidence.append,
                {
                    "event": "admit",
                    "capture_key": key,
                    "model_call_id": ticket.model_call_id,
                    "request_digest": request_digest(prompt),
                    "t": time.time(),
                },
            )
        handed_over = False
        try:
            with ticket.scope:
                if key is None:
                    reply = await self._call_worker(prompt, call.max_tokens, None)
                    ticket.backend = self.worker_url  # never cut: it belongs to no episode
                else:
                    reply = await self._generate(key, ticket, call, items, prompt, api)
                content = decode(reply.token_ids)
                body = api.render(
                    ModelReply(
                        response_id=api.response_id(ticket.model_call_id),
                        model_call_id=ticket.model_call_id,
                        content=content,
                        finish_reason=reply.finish_reason,
                        prompt_tokens=len(prompt),
                        completion_tokens=len(reply.token_ids),
                    )
                )
                await gate.deliver(ticket)
                if key is not None:
                    # Delivered from here on: a retire arriving now must not cut off the log.
                    with anyio.CancelScope(shield=True):
                        await anyio.to_thread.run_sync(
                            self.evidence.append,
                            {
                                "event": "egress",
                                "capture_key": key,
                                "model_call_id": ticket.model_call_id,
                                "request_digest": request_digest(prompt),
                                "response_tokens": len(reply.token_ids),
                                "continued_cut": ticket.claimed_cut is not None,
                                "held": ticket.held,
                                "t": time.time(),
                            },
                        )
                handed_over = True
                return _ReleasingResponse(body, functools.partial(self.participant.release, ticket))
        finally:
            if not handed_over:
                self.participant.release(ticket)
                # A cut claimed from the coordinator that no response used goes back to it;
                # the channel's own timeout bounds this, even for a cancelled call.
                with anyio.CancelScope(shield=True), contextlib.suppress(WireError):
                    await self.participant.return_unused_cut(ticket)
        raise StaleAttemptError(f"{key} was retired while its call was in flight")

    async def _generate(
        self,
        key: str,
        ticket: ModelTicket,
        call: ModelCall,
        items: list[RequestItem],
        prompt: list[int],
        api: ModelApi,
    ) -> CompletionReply:
        # A retired ledger raises stale_attempt; an unresolved parent is served uncaptured.
        admission = await resolve_admission(self.ledger, key, ticket.model_call_id, items)
        ticket.backend = self.worker_url
        self.participant.changes.notify()  # the call is now one a cut round would list
        restored = None
        if admission is not None:
            await self.participant.prefetch_restored_cut(ticket)  # several workers: claim it
            restored = self.participant.take_restored_cut(ticket)
        if admission is not None and restored is not None:
            continued = admission.model_copy(update={"generation_cut": restored.continuation})
            cuts = self.participant.cut_telemetry
            try:
                reply = await self._call_worker(prompt, call.max_tokens, continued)
                admission = continued
                cuts.continuation("continued", key, ticket.model_call_id)
            except ContinuationRefused:
                # The worker refused the cut before generating anything: regenerate instead.
                ticket.claimed_cut = None
                cuts.continuation("refused", key, ticket.model_call_id)
                reply = await self._call_worker(prompt, call.max_tokens, admission)
        else:
            reply = await self._call_worker(prompt, call.max_tokens, admission)
        if admission is not None:
            await record_custody(
                self.ledger,
                admission,
                reply.ng_commit_coords,
                request_items=items,
                response_items=[{"role": "assistant", "content": decode(reply.token_ids)}],
                response_id=api.response_id(ticket.model_call_id),
                admitted_at=ticket.admitted_at,
                context_digest=ticket.request_digest,  # of these items, at admission (D429)
            )
        return reply

    async def _call_worker(
        self, prompt: list[int], max_tokens: int, admission: CaptureAdmission | None
    ) -> CompletionReply:
        assert self.client is not None, "the policy server is not running"
        return await call_worker(self.client, prompt, max_tokens, admission)
