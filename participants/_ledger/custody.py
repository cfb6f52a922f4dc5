"""One captured call through the capture ledger: admit it before the worker, record it after.

A policy server calls :func:`resolve_admission` once the call passed its gate and before it asks
the worker to generate, and :func:`record_custody` with the coordinates the worker answered. The
pure steps are ``protocols.admission_from_resolution``, ``protocols.commit_coords_problem`` and
``protocols.custody_commit``; these two add the ledger's reads and writes around them:

- a call whose parent cannot be resolved is still served (no admission: the worker stages
  nothing), and a failure row ``unresolved_parent`` poisons the rollout's manifest, since its
  tokens cannot be chained to the calls before it;
- a call of a retired ledger is refused with ``StaleAttemptError`` (its attempt is over);
- coordinates that are missing, failed or name another call become a failure row, never a
  custody row.

See ``docs/capture-protocol.md`` for the whole path of a call.
"""

from __future__ import annotations

from protocols import (
    CaptureAdmission,
    CaptureLedger,
    CaptureLedgerCommit,
    CommitCoords,
    RequestItems,
    StaleAttemptError,
    admission_from_resolution,
    commit_coords_problem,
    custody_commit,
)


async def resolve_admission(
    ledger: CaptureLedger, rollout_id: str, model_call_id: str, request_items: RequestItems
) -> CaptureAdmission | None:
    """Resolve a call's parent in ``ledger`` and turn it into the worker's admission.

    Args:
        ledger: The capture ledger of the model server.
        rollout_id: The capture key of the attempt the call belongs to.
        model_call_id: The call's id (the gate's ticket names it).
        request_items: The request's conversation items, validated once by the caller.

    Returns:
        The admission to send the worker with the call; ``None`` when the parent could not be
        resolved — a failure row ``unresolved_parent`` is then recorded and the call is served
        uncaptured.

    Raises:
        StaleAttemptError: The rollout's ledger is retired.
    """
    resolution = await ledger.resolve(rollout_id, request_items)
    admission = admission_from_resolution(rollout_id, model_call_id, resolution)
    if admission is None:
        if resolution.reason == "rollout_retired":
            raise StaleAttemptError(f"the capture ledger of {rollout_id} is retired")
        # The call is served, but its tokens cannot be chained: poison it in the manifest.
        await ledger.record_failure(rollout_id, model_call_id, "unresolved_parent")
    return admission


async def record_custody(
    ledger: CaptureLedger,
    admission: CaptureAdmission,
    coords: CommitCoords | None,
    *,
    request_items: RequestItems,
    response_items: RequestItems,
    response_id: str,
    admitted_at: float | None = None,
    context_digest: str | None = None,
) -> CaptureLedgerCommit | None:
    """Record the worker's coordinates for an admitted call as its custody row in ``ledger``.

    Args:
        ledger: The capture ledger of the model server.
        admission: The admission the worker generated under (a continued cut's included).
        coords: The worker's commit coordinates (``ng_commit_coords``); ``None`` if it sent none.
        request_items: The request's conversation items.
        response_items: The items the response adds to the conversation.
        response_id: The id of the response that delivers the call.
        admitted_at: Wall-clock time the call was admitted (the gate's ticket has it).
        context_digest: ``conversation_digest(request_items)`` if already computed (the gate's
            ticket has it as ``request_digest``): the row's context digest, not hashed again
            (D429). It must be that digest of ``request_items``.

    Returns:
        The commit recorded; ``None`` when the coordinates could not become a custody row and a
        failure row with the reason (``protocols.commit_coords_problem``) was recorded instead.
    """
    problem = commit_coords_problem(coords, admission)
    if problem is not None or coords is None:
        await ledger.record_failure(
            admission.rollout_id, admission.model_call_id, problem or "worker_capture_failed"
        )
        return None
    commit = custody_commit(
        admission,
        coords,
        request_items=request_items,
        response_items=response_items,
        response_id=response_id,
        admitted_at=admitted_at,
        context_digest=context_digest,
    )
    await ledger.record(commit)
    return commit
