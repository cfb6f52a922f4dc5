"""The capture protocol of one model call, as pure functions: admission, then custody.

A policy server captures a call in two steps around the worker's generation:

1. **Admission.** The capture ledger's lineage matcher resolves which recorded call the request
   continues (:class:`LineageResolution`); :func:`admission_from_resolution` turns that into the
   worker's contract, a :class:`CaptureAdmission` — a bare ``text`` root, or a ``token_in`` child
   naming its parent, the parent's length and chain hash, and the staging chain the worker fetches
   the parent's tokens from. A parent that cannot be resolved gives no admission: the call is
   served, but its tokens cannot be chained.
2. **Custody.** The worker answers with its commit coordinates (:class:`CommitCoords`).
   :func:`commit_coords_problem` says why they cannot become a custody row (missing, not staged,
   or not the call that was admitted); otherwise :func:`custody_commit` builds what the ledger's
   ``record`` receives: a token-free :class:`CallRecord` and the staging chain of the call's
   ancestry, ending with its own key.

The ledger I/O around them (resolve, record, the failure rows) is
``participants.resolve_admission`` / ``participants.record_custody``.
"""

from __future__ import annotations

from ._call_record import CallRecord
from ._ledger import CaptureLedgerCommit
from ._lineage import FINGERPRINT_VERSION, LineageResolution, RequestItems
from ._staging import CaptureAdmission, CommitCoords


def admission_from_resolution(
    rollout_id: str, model_call_id: str, resolution: LineageResolution
) -> CaptureAdmission | None:
    """The worker's admission of a call whose parent the ledger resolved.

    Args:
        rollout_id: The capture key of the attempt.
        model_call_id: The call's id.
        resolution: What the ledger's lineage matcher answered for the call's request items.

    Returns:
        A ``text`` admission for a root, a ``token_in`` one (parent, ``prev_len``, chain hash,
        staging chain) for a resolved parent; ``None`` when the parent is unresolved or has no
        staging chain to fetch its tokens from.
    """
    if resolution.status == "root":
        return CaptureAdmission(rollout_id=rollout_id, model_call_id=model_call_id, mode="text")
    match = resolution.match
    if resolution.status != "resolved" or match is None or not match.staging_chain:
        return None
    return CaptureAdmission(
        rollout_id=rollout_id,
        model_call_id=model_call_id,
        parent_call_id=match.model_call_id,
        prev_len=match.prev_len,
        mode="token_in",
        staging_chain=list(match.staging_chain),
        parent_chain_hash=match.chain_hash,
    )


def commit_coords_problem(coords: CommitCoords | None, admission: CaptureAdmission) -> str | None:
    """Why the worker's coordinates cannot become the admitted call's custody row, if they cannot.

    Returns:
        ``None`` when they can; else the failure reason to record (one of ``POISON_REASONS``):
        ``worker_response_missing_commit_coordinates`` (none came back),
        ``worker_capture_failed`` (the worker could not stage the call) or
        ``invalid_worker_commit_coordinates`` (they name another call, parent or prefix).
    """
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


def custody_commit(
    admission: CaptureAdmission,
    coords: CommitCoords,
    *,
    request_items: RequestItems,
    response_items: RequestItems,
    response_id: str,
    admitted_at: float | None = None,
    context_digest: str | None = None,
) -> CaptureLedgerCommit:
    """What the ledger's ``record`` receives for a call the worker staged under ``admission``.

    Args:
        admission: The admission the worker generated under (a continued cut's included).
        coords: The worker's commit coordinates for it.
        request_items: The request's conversation items (the lineage of the next call hashes them).
        response_items: The items the response added (one assistant item, say).
        response_id: The id of the response that delivers the call.
        admitted_at: Wall-clock time the call was admitted, if known.
        context_digest: ``conversation_digest(request_items)`` when the caller computed it
            already, as a policy server does at admission: the custody row's ``context_digest``
            without hashing the request again (D429). It must be that digest of these items.

    Raises:
        ValueError: The coordinates cannot become a custody row (see
            :func:`commit_coords_problem`; record a failure row with that reason instead), or
            ``context_digest`` is not a SHA-256 hex digest.
    """
    problem = commit_coords_problem(coords, admission)
    if problem is not None:
        raise ValueError(f"the commit coordinates cannot become a custody row: {problem}")
    # A staged disposition guarantees these (CommitCoords validates it).
    assert coords.staging_key is not None
    assert coords.digest is not None
    assert coords.extras_digest is not None
    assert coords.chain_hash is not None
    assert coords.cumulative_hash is not None
    record = CallRecord(
        model_call_id=admission.model_call_id,
        parent_call_id=coords.parent_call_id,
        staging_key=coords.staging_key,
        weight_version=coords.weight_version,
        prev_len=coords.prev_len,
        delta_len=coords.delta_len,
        cum_len=coords.cum_len,
        digest=coords.digest,
        extras_digest=coords.extras_digest,
        mode=admission.mode,
        admitted_at=admitted_at,
        chain_hash=coords.chain_hash,
        cumulative_hash=coords.cumulative_hash,
        response_id=response_id,
        fingerprint_version=FINGERPRINT_VERSION,
    )
    commit = CaptureLedgerCommit(
        rollout_id=admission.rollout_id,
        record=record,
        # The parent's chain is the one the worker fetched the prefix through.
        staging_chain=(*admission.staging_chain, coords.staging_key),
        request_items=request_items,
        response_items=response_items,
    )
    return commit if context_digest is None else commit.with_context_digest(context_digest)
