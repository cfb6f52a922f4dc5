"""The generation-cut route an inference worker serves: inventory in, receipt out.

``POST /ng-control/v1/generation-cut`` (:data:`protocols.GENERATION_CUT_PATH`) takes the
policy-model server's :class:`~protocols.GenerationCutInventory` of the calls it has in flight on
this worker and answers the worker's :class:`~protocols.GenerationCutReceipt`: one ack per call,
``durable_prefix`` or ``durable_failure``. Returning the receipt is the worker's durability
boundary, so the cut function must have staged every prefix it acks before it returns
(:meth:`~participants.RolloutTokenCapture.build_prefix_record` and a staging store's ``put`` do
the work; see ``docs/worker.md``).

The bearer token is checked first, before the body is read, in constant time; every refusal is
the ``{"error": {"code", "detail"}}`` envelope (401, 422 for a body that is not an inventory).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import APIRouter

from protocols import (
    GENERATION_CUT_PATH,
    WORKER_CUT_SPAN,
    GenerationCutInventory,
    GenerationCutReceipt,
)

from .._http.router import authenticated_route_class, error_responses
from .._tracing import checkpoint_span, set_checkpoint_attributes

GenerationCutHandler = Callable[[GenerationCutInventory], Awaitable[GenerationCutReceipt]]
"""What cuts a worker's calls: stages the prefix of every listed call, answers the receipt."""


def generation_cut_router(cut: GenerationCutHandler, *, token: str) -> APIRouter:
    """A router with the worker's generation-cut route, guarded by the control token.

    Args:
        cut: Makes the listed calls' generated prefixes durable and answers the receipt.
        token: The control token the policy server sends as ``Authorization: Bearer <token>``.

    Raises:
        ValueError: The token is empty: the route would be open to anyone.
    """
    router = APIRouter(route_class=authenticated_route_class(token))

    # No docstring: the operation's OpenAPI description stays what the worker always served.
    @router.post(
        GENERATION_CUT_PATH,
        response_model=GenerationCutReceipt,
        responses=error_responses(()),
    )
    async def generation_cut(body: GenerationCutInventory) -> GenerationCutReceipt:
        calls = len(body.active_prefixes)
        with checkpoint_span(WORKER_CUT_SPAN, id=body.checkpoint_id, calls=calls) as span:
            receipt = await cut(body)
            durable = sum(1 for ack in receipt.prefixes if ack.disposition == "durable_prefix")
            set_checkpoint_attributes(span, cut=durable, cut_failed=calls - durable)
            return receipt

    return router
