"""What a call may start from: its resolved prefix, and the generation cut it continues.

``begin_call`` resolves the exact token prefix a call starts with and, for a call that continues
a generation cut, proves that the staged prefix belongs to it (keys, source call, digest,
lineage, generated-token count, policy version, and both hashes recomputed from the call's own
parent). :func:`rebuild_generation_cut` joins a cut's staged records back into one snapshot.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

from protocols import (
    CaptureAdmission,
    StagedCallRecord,
    StagedPrefix,
    compute_chain_hash,
    hash_token_ids,
)

from .errors import CaptureError


def rebuild_generation_cut(records: Sequence[StagedCallRecord]) -> StagedCallRecord:
    """Join a cut's staged records (first the cumulative one, then chunks) into one snapshot.

    Every record belongs to the same call, only the first may hold prompt tokens, and policy
    versions never decrease. The snapshot keeps the first record's identity and version (the
    oldest) and the last record's chain and cumulative hashes, which cover the whole prefix (see
    ``build_generation_chunk_record``); its digest is what a cut's receipt names.

    Raises:
        ValueError: The records do not form one call's prefix.
    """
    if not records:
        raise ValueError("a generation cut needs at least one staged record")
    StagedPrefix.of(records)  # the records form one call's prefix, or this raises
    first, last = records[0], records[-1]
    if len(records) == 1:
        return first
    joined = chain.from_iterable
    tokens = list(joined(record.token_ids_delta for record in records))
    masks = list(joined(record.token_mask_delta for record in records))
    log_probs = list(joined(record.generation_log_probs_delta for record in records))
    return StagedCallRecord.from_components(
        rollout_id=first.rollout_id,
        model_call_id=first.model_call_id,
        parent_call_id=first.parent_call_id,
        mode=first.mode,
        prev_len=first.prev_len,
        weight_version=first.weight_version,
        token_ids_delta=tokens,
        token_mask_delta=masks,
        generation_log_probs_delta=log_probs,
        chain_hash=last.chain_hash,
        cumulative_hash=last.cumulative_hash,
    )


def resolve_prefix(
    admission: CaptureAdmission, prefix_token_ids: Sequence[int] | None, where: str
) -> list[int]:
    given = None if prefix_token_ids is None else list(prefix_token_ids)
    if given is not None and any(type(t) is not int or t < 0 for t in given):
        raise CaptureError(f"{where}: prefix_token_ids must be non-negative ints")
    if admission.mode == "text":
        if given:
            raise CaptureError(f"{where}: a text root takes no prefix")
        return []
    inline = list(admission.required_prefix_token_ids)
    if given is None:
        if not inline:
            raise CaptureError(f"{where}: a staging_chain admission needs the resolved prefix")
        return inline
    if len(given) != admission.prev_len:
        raise CaptureError(
            f"{where}: the prefix holds {len(given)} ids, prev_len is {admission.prev_len}"
        )
    if inline and inline != given:
        raise CaptureError(f"{where}: the prefix disagrees with the admission's inline prefix")
    return given


def check_generation_cut(
    admission: CaptureAdmission,
    snapshot: StagedCallRecord,
    *,
    prefix: list[int],
    staging_keys: Sequence[str] | None,
    weight_version: int,
    where: str,
) -> None:
    continuation = admission.generation_cut
    if continuation is None:
        raise CaptureError(f"{where}: the admission does not authorize continuing a cut")
    if staging_keys is None or list(staging_keys) != continuation.staging_keys:
        raise CaptureError(f"{where}: the cut was fetched from other staging keys")
    if (
        snapshot.rollout_id != continuation.source_capture_key
        or snapshot.model_call_id != continuation.source_model_call_id
    ):
        raise CaptureError(f"{where}: the cut belongs to another source call")
    if snapshot.digest != continuation.prefix_digest:
        raise CaptureError(f"{where}: the cut's digest differs from the continuation's")
    if (snapshot.parent_call_id, snapshot.prev_len, snapshot.mode) != (
        admission.parent_call_id,
        admission.prev_len,
        admission.mode,
    ):
        raise CaptureError(f"{where}: the cut's lineage differs from the replacement call's")
    if snapshot.generated_token_count != continuation.prefix_token_count:
        raise CaptureError(
            f"{where}: the cut holds {snapshot.generated_token_count} generated tokens, "
            f"the continuation says {continuation.prefix_token_count}"
        )
    if snapshot.weight_version > weight_version:
        raise CaptureError(
            f"{where}: the cut's policy version {snapshot.weight_version} is newer than the "
            f"current {weight_version}"
        )
    # The digest only vouches for the snapshot's own fields. Recompute both hashes from this
    # call's parent so that a prefix built on other parent tokens (same parent id and length)
    # cannot be spliced in.
    if compute_chain_hash(admission.parent_chain_hash, snapshot.token_ids_delta) != (
        snapshot.chain_hash
    ) or hash_token_ids(prefix + snapshot.token_ids_delta) != (snapshot.cumulative_hash):
        raise CaptureError(f"{where}: the cut was built on other parent tokens")
