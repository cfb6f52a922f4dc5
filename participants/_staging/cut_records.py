"""The columns of a call's records, and its next generation-cut record built on its staged prefix.

A call's first record carries its delta: the prompt past the authorized prefix (mask 0.0) and the
generated tokens (mask 1.0), or, for a call that continues a cut, the cut's tokens and then the
new ones. A later cut record (a chunk) carries only the tokens generated since. :func:`build_cut`
builds either on the call's :class:`~protocols.StagedPrefix`, so each column is encoded once for
the record's hashes, its digest and every later digest of the prefix (D423).
"""

from __future__ import annotations

from collections.abc import Sequence

from protocols import StagedPrefix

from .records import ActiveCall


def first_columns(
    call: ActiveCall,
    prompt_token_ids: Sequence[int],
    generated_token_ids: Sequence[int],
    generated_logprobs: Sequence[float],
) -> tuple[list[int], list[float], list[float]]:
    """The token ids, masks and log-probs of the call's first (cumulative) record.

    Raises:
        ValueError: The prompt does not start with the authorized prefix (or, for a continued
            call, is not the prefix followed by the cut's tokens), or the columns disagree.
    """
    admission = call.admission
    prompt = list(prompt_token_ids)
    generated = list(generated_token_ids)
    log_probs = list(generated_logprobs)
    if len(generated) != len(log_probs):
        raise ValueError("generated token ids and log-probs must have equal lengths")
    if prompt[: admission.prev_len] != call.prefix_token_ids:
        raise ValueError("the prompt does not start with the authorized token prefix")
    cut = call.generation_cut
    if cut is None:
        carried = prompt[admission.prev_len :]
        return (
            carried + generated,
            [0.0] * len(carried) + [1.0] * len(generated),
            [0.0] * len(carried) + log_probs,
        )
    if prompt != call.prefix_token_ids + cut.token_ids_delta:
        raise ValueError("the prompt is not the prefix followed by the cut's tokens")
    return (
        cut.token_ids_delta + generated,
        cut.token_mask_delta + [1.0] * len(generated),
        cut.generation_log_probs_delta + log_probs,
    )


def check_prefix_of(call: ActiveCall, prefix: StagedPrefix) -> None:
    """Refuse a staged prefix of another call, or one made for another parent.

    Raises:
        ValueError: The prefix's records or its parent are not the call's.
    """
    if prefix.records:
        first = prefix.records[0]
        if (first.rollout_id, first.model_call_id) != (call.rollout_id, call.model_call_id):
            raise ValueError("a staged record belongs to another call")
    if (
        prefix.parent_chain_hash != call.admission.parent_chain_hash
        or prefix.parent_token_count != len(call.prefix_token_ids)
    ):
        raise ValueError("the staged prefix was made for another parent")


def build_cut(
    call: ActiveCall,
    staged: StagedPrefix,
    *,
    prompt_token_ids: Sequence[int],
    generated_token_ids: Sequence[int],
    generated_logprobs: Sequence[float],
) -> StagedPrefix:
    """The call's next generation-cut record, answered as ``staged`` extended by it.

    With nothing staged it is the record :meth:`RolloutTokenCapture.build_prefix_record
    <participants.RolloutTokenCapture.build_prefix_record>` builds; after that, the chunk
    ``build_generation_chunk_record`` builds. Each column is encoded once, for the
    record's hashes and digest and every later digest of the prefix (D423). The new record is
    the answer's ``records[-1]``; keep the answer only once that record is durable.

    Args:
        call: The live call.
        staged: The call's staged prefix (``RolloutTokenCapture.staged_prefix``; empty before its
            first cut).
        prompt_token_ids: The engine prompt (read only for the first record).
        generated_token_ids: The tokens generated since ``staged``: every generated token
            when nothing is staged yet.
        generated_logprobs: Their log-probs.

    Raises:
        ValueError: As the two builders, or ``staged`` is another call's or parent's.
    """
    check_prefix_of(call, staged)
    if not staged:
        columns = first_columns(call, prompt_token_ids, generated_token_ids, generated_logprobs)
        return extend(call, staged, columns, call.oldest_weight_version)
    columns = chunk_columns(generated_token_ids, generated_logprobs)
    return extend(call, staged, columns, call.weight_version)


def chunk_columns(
    generated_token_ids: Sequence[int], generated_logprobs: Sequence[float]
) -> tuple[list[int], list[float], list[float]]:
    """The token ids, masks (all 1.0) and log-probs of a chunk of new tokens.

    Raises:
        ValueError: No token, or the columns disagree.
    """
    tokens, log_probs = list(generated_token_ids), list(generated_logprobs)
    if not tokens:
        raise ValueError("a generation chunk needs at least one token")
    if len(tokens) != len(log_probs):
        raise ValueError("generated token ids and log-probs must have equal lengths")
    return tokens, [1.0] * len(tokens), log_probs


def extend(
    call: ActiveCall,
    prefix: StagedPrefix,
    columns: tuple[list[int], list[float], list[float]],
    weight_version: int,
) -> StagedPrefix:
    """``prefix`` extended by a record of ``columns`` under the call's identity."""
    tokens, masks, log_probs = columns
    admission = call.admission
    return prefix.next_record(
        rollout_id=admission.rollout_id,
        model_call_id=admission.model_call_id,
        parent_call_id=admission.parent_call_id,
        mode=admission.mode,
        prev_len=admission.prev_len,
        weight_version=weight_version,
        token_ids=tokens,
        token_masks=masks,
        log_probs=log_probs,
    )
