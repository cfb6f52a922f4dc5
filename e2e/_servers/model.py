"""The policy server (``midflight serve model``): model calls captured through the ledger.

Chat completions, the Responses API and the Messages API (:mod:`e2e._servers.policy_apis`) reach one
handler, :meth:`PolicyServer.serve`. A call under ``/ng-rollout/<capture_key>/`` renders its
messages into prompt bytes, passes the gate (a retired attempt is refused; while a checkpoint is
open the call waits), resolves its parent through the capture ledger's lineage matcher, has the
worker generate and stage it under a ``CaptureAdmission``, records the worker's commit coordinates
as a custody row, then waits at egress while a checkpoint is open (the response is held) and logs
the response to the evidence file, fsynced, before sending it. A plain call (no prefix) is
untagged: gated and held the same way, but never captured nor cut. The control routes and the
ledger routes are mounted beside them.

When admission closes, the participant asks the worker (:mod:`e2e._servers.worker_client`) to cut the
calls in flight. After a restore, a re-issued call whose request matches a restored cut sends the
cut's continuation with its admission and the worker generates only the remainder.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.to_thread
import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from participants import (
    DEFAULT_ADMISSION_WAIT_SECONDS,
    MODEL_FAULTS,
    ControlPlane,
    ControlTelemetry,
    FileCaptureLedger,
    ModelParticipant,
    ModelTicket,
    error_responses,
    generation_cut_restart_reason,
    ledger_control_router,
    participant_app,
)
from protocols import (
    FINGERPRINT_VERSION,
    CallRecord,
    CaptureAdmission,
    CaptureLedger,
    CaptureLedgerCommit,
    CommitCoords,
    CompletionReply,
    EpisodeId,
    InvalidRequestError,
    LineageResolution,
    RequestItem,
    RequestItems,
    StaleAttemptError,
    WireError,
    as_request_items,
    conversation_digest,
    decode,
    encode,
    render_prompt,
)

from .context import ServeContext, active_fault, control_settings
from .evidence import EvidenceLog, read_evidence
from .peer_pool import PEER_POOL
from .policy_apis import (
    CHAT_API,
    MESSAGES_API,
    RESPONSES_API,
    ROLLOUT_PREFIX,
    ChatCompletionRequest,
    MessagesRequest,
    ModelApi,
    ModelCall,
    ModelReply,
    ResponsesRequest,
    chat_call,
    messages_call,
    responses_call,
)
from .worker_client import (
    WORKER_TIMEOUT,
    ContinuationRefused,
    HttpCutRequester,
    call_worker,
)

MODEL_CALL_ERRORS: Final = error_responses(
    (
        "invalid_rollout_id",
        "stale_attempt",
        "admission_closed",
        "checkpoint_coordinator_unavailable",
    ),
    authenticated=False,
)
"""The refusals of a model call (declared in OpenAPI)."""


def request_digest(prompt: list[int]) -> str:
    """SHA-256 hex of a call's rendered prompt bytes (the evidence's request digest)."""
    return hashlib.sha256(bytes(prompt)).hexdigest()


def policy_evidence_path(root: Path, name: str = "policy") -> Path:
    """Where the policy server ``name`` with this run root appends its evidence."""
    return root / "evidence" / f"{name}.jsonl"


def read_policy_evidence(
    root: Path, name: str = "policy", event: str = "egress"
) -> list[dict[str, Any]]:
    """The policy server's evidence events of one kind (``egress`` or ``admit``), in order."""
    return [e for e in read_evidence(policy_evidence_path(root, name)) if e.get("event") == event]


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
        async with httpx.AsyncClient(
            base_url=self.worker_url,
            timeout=WORKER_TIMEOUT,
            transport=self._transport,
            limits=PEER_POOL,
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
        resolution = await self.ledger.resolve(key, items)
        admission = _admission(key, ticket.model_call_id, resolution)
        if admission is None:
            if resolution.reason == "rollout_retired":
                raise StaleAttemptError(f"the capture ledger of {key} is retired")
            # The call is served, but its tokens cannot be chained: poison it in the manifest.
            await self.ledger.record_failure(key, ticket.model_call_id, "unresolved_parent")
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
            content = decode(reply.token_ids)
            await self._record(key, ticket, items, content, admission, resolution, reply, api)
        return reply

    async def _call_worker(
        self, prompt: list[int], max_tokens: int, admission: CaptureAdmission | None
    ) -> CompletionReply:
        assert self.client is not None, "the policy server is not running"
        return await call_worker(self.client, prompt, max_tokens, admission)

    async def _record(
        self,
        key: str,
        ticket: ModelTicket,
        items: list[RequestItem],
        content: str,
        admission: CaptureAdmission,
        resolution: LineageResolution,
        reply: CompletionReply,
        api: ModelApi,
    ) -> None:
        coords = reply.ng_commit_coords
        reason = _coords_problem(coords, admission)
        if reason is not None or coords is None:
            await self.ledger.record_failure(
                key, ticket.model_call_id, reason or "worker_capture_failed"
            )
            return
        await self.ledger.record(
            custody_commit(
                key,
                ticket,
                items,
                content,
                admission,
                resolution,
                coords,
                api.response_id(ticket.model_call_id),
            )
        )


def custody_commit(
    key: str,
    ticket: ModelTicket,
    messages: RequestItems,
    content: str,
    admission: CaptureAdmission,
    resolution: LineageResolution,
    coords: CommitCoords,
    response_id: str,
) -> CaptureLedgerCommit:
    """What ``record`` receives for a call the worker staged (``coords`` checked already)."""
    # A staged disposition guarantees these (CommitCoords validates it).
    assert coords.staging_key is not None
    assert coords.digest is not None
    assert coords.extras_digest is not None
    assert coords.chain_hash is not None
    assert coords.cumulative_hash is not None
    parent_chain = resolution.match.staging_chain if resolution.match is not None else ()
    record = CallRecord(
        model_call_id=ticket.model_call_id,
        parent_call_id=coords.parent_call_id,
        staging_key=coords.staging_key,
        weight_version=coords.weight_version,
        prev_len=coords.prev_len,
        delta_len=coords.delta_len,
        cum_len=coords.cum_len,
        digest=coords.digest,
        extras_digest=coords.extras_digest,
        mode=admission.mode,
        admitted_at=ticket.admitted_at,
        chain_hash=coords.chain_hash,
        cumulative_hash=coords.cumulative_hash,
        response_id=response_id,
        fingerprint_version=FINGERPRINT_VERSION,
    )
    return CaptureLedgerCommit(
        rollout_id=key,
        record=record,
        staging_chain=(*parent_chain, coords.staging_key),
        request_items=messages,
        response_items=[{"role": "assistant", "content": content}],
    )


def _admission(key: str, call_id: str, resolution: LineageResolution) -> CaptureAdmission | None:
    """The worker's contract for the call; ``None`` when its parent could not be resolved."""
    if resolution.status == "root":
        return CaptureAdmission(rollout_id=key, model_call_id=call_id, mode="text")
    match = resolution.match
    if resolution.status != "resolved" or match is None or not match.staging_chain:
        return None
    return CaptureAdmission(
        rollout_id=key,
        model_call_id=call_id,
        parent_call_id=match.model_call_id,
        prev_len=match.prev_len,
        mode="token_in",
        staging_chain=list(match.staging_chain),
        parent_chain_hash=match.chain_hash,
    )


def _coords_problem(coords: CommitCoords | None, admission: CaptureAdmission) -> str | None:
    """Why the worker's coordinates cannot become a custody row, if they cannot."""
    if coords is None:
        return "worker_response_missing_commit_coordinates"
    if coords.disposition != "staged":
        return "worker_capture_failed"
    if (
        coords.rollout_id != admission.rollout_id
        or coords.model_call_id != admission.model_call_id
        or coords.parent_call_id != admission.parent_call_id
        or coords.prev_len != admission.prev_len
    ):
        return "invalid_worker_commit_coordinates"
    return None


def create_model_app(
    ctx: ServeContext,
    *,
    ledger: CaptureLedger | None = None,
    worker_url: str | None = None,
    worker_transport: httpx.AsyncBaseTransport | None = None,
    admission_wait_seconds: float | None = None,
) -> FastAPI:
    """The policy server's app: chat completions, control routes, ledger routes.

    Args:
        ctx: Name, run root, peers and tokens.
        ledger: The capture ledger; a ``FileCaptureLedger`` under ``<root>/ledger/`` by default.
        worker_url: The worker's base URL; the cluster's ``worker`` by default.
        worker_transport: Transport of the worker client (tests).
        admission_wait_seconds: Bound of a call waiting for resume (the gate's default if None).
    """
    capture = ledger if ledger is not None else FileCaptureLedger(ctx.root / "ledger")
    fault = active_fault()
    requester = HttpCutRequester(ctx.control_token, worker_transport)
    # One registry for the control plane and the cut counter: /metrics shows both.
    telemetry = ControlTelemetry("model", ctx.name)
    participant = ModelParticipant(
        capture,
        ctx.name,
        registry=telemetry.registry,
        faults=[fault] if fault in MODEL_FAULTS else [],
        cut_requester=requester,
        call_aborter=requester.abort,
        admission_wait_seconds=(
            DEFAULT_ADMISSION_WAIT_SECONDS
            if admission_wait_seconds is None
            else admission_wait_seconds
        ),
    )
    server = PolicyServer(
        participant,
        EvidenceLog(policy_evidence_path(ctx.root, ctx.name)),
        worker_url or ctx.peer_url("worker"),
        worker_transport,
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        async with server.running(), requester.running():
            yield

    plane = ControlPlane(participant, settings=control_settings(ctx), telemetry=telemetry)
    app = participant_app(
        plane, token=ctx.control_token, title="midflight policy server", lifespan=lifespan
    )
    app.state.policy = server
    app.state.plane = plane
    if ctx.capture_token:
        app.include_router(
            ledger_control_router(
                capture,
                capture_token=ctx.capture_token,
                is_checkpoint_open=participant.is_checkpoint_open,
            )
        )

    # One handler, three thin adapters, each under the rollout prefix (a call of an episode)
    # and plain (an untagged call: served and gated, never captured).
    @app.post(
        ROLLOUT_PREFIX + CHAT_API.path,
        summary="A chat completion of one episode's attempt",
        responses=MODEL_CALL_ERRORS,
    )
    async def chat_completions(capture_key: str, body: ChatCompletionRequest) -> JSONResponse:
        return await server.serve(capture_key, chat_call(body), CHAT_API)

    @app.post(
        CHAT_API.path,
        summary="An untagged chat completion (captured by no episode)",
        responses=MODEL_CALL_ERRORS,
    )
    async def untagged_chat_completions(body: ChatCompletionRequest) -> JSONResponse:
        return await server.serve(None, chat_call(body), CHAT_API)

    @app.post(
        ROLLOUT_PREFIX + RESPONSES_API.path,
        summary="A response of one episode's attempt",
        responses=MODEL_CALL_ERRORS,
    )
    async def responses(capture_key: str, body: ResponsesRequest) -> JSONResponse:
        return await server.serve(capture_key, responses_call(body), RESPONSES_API)

    @app.post(
        RESPONSES_API.path,
        summary="An untagged response (captured by no episode)",
        responses=MODEL_CALL_ERRORS,
    )
    async def untagged_responses(body: ResponsesRequest) -> JSONResponse:
        return await server.serve(None, responses_call(body), RESPONSES_API)

    @app.post(
        ROLLOUT_PREFIX + MESSAGES_API.path,
        summary="A message of one episode's attempt",
        responses=MODEL_CALL_ERRORS,
    )
    async def messages(capture_key: str, body: MessagesRequest) -> JSONResponse:
        return await server.serve(capture_key, messages_call(body), MESSAGES_API)

    @app.post(
        MESSAGES_API.path,
        summary="An untagged message (captured by no episode)",
        responses=MODEL_CALL_ERRORS,
    )
    async def untagged_messages(body: MessagesRequest) -> JSONResponse:
        return await server.serve(None, messages_call(body), MESSAGES_API)

    return app
