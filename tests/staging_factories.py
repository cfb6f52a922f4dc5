"""Builders shared by the staging, worker-helper and worker tests."""

from __future__ import annotations

from typing import Any

from protocols import CaptureAdmission, StagedCallRecord, compute_chain_hash, hash_token_ids
from protocols._cuts import GenerationCutContinuation

GOLDEN_EXTRAS: dict[str, Any] = {"routed_experts": [[[1, 2]], [[3, 4]]]}


def golden_record(**changes: Any) -> StagedCallRecord:
    """The golden vector of policy-model-and-ledger §4.1, with optional changes."""
    fields: dict[str, Any] = {
        "rollout_id": "rollout-1",
        "model_call_id": "call-1",
        "parent_call_id": "parent-1",
        "mode": "token_in",
        "prev_len": 3,
        "weight_version": 7,
        "token_ids_delta": [10, 11],
        "token_mask_delta": [0.0, 1.0],
        "generation_log_probs_delta": [0.0, -0.25],
        "chain_hash": "11" * 32,
        "cumulative_hash": "22" * 32,
        "extras": GOLDEN_EXTRAS,
    }
    fields.update(changes)
    return StagedCallRecord.from_components(**fields)


def root_admission(
    rollout_id: str = "r1", model_call_id: str = "c1", **extra: Any
) -> CaptureAdmission:
    """A text-mode root admission."""
    return CaptureAdmission(
        rollout_id=rollout_id, model_call_id=model_call_id, mode="text", **extra
    )


def child_admission(
    parent: StagedCallRecord,
    parent_tokens: list[int],
    *,
    rollout_id: str = "r1",
    model_call_id: str = "c2",
    **extra: Any,
) -> CaptureAdmission:
    """A token_in admission extending ``parent`` whose full token sequence is ``parent_tokens``."""
    return CaptureAdmission(
        rollout_id=rollout_id,
        model_call_id=model_call_id,
        parent_call_id=parent.model_call_id,
        prev_len=len(parent_tokens),
        mode="token_in",
        required_prefix_token_ids=list(parent_tokens),
        parent_chain_hash=parent.chain_hash,
        **extra,
    )


def root_record(
    prompt: list[int], generated: list[int], *, rollout_id: str = "r1", model_call_id: str = "c1"
) -> StagedCallRecord:
    """The staged record of a finished root call."""
    tokens = prompt + generated
    return StagedCallRecord.from_components(
        rollout_id=rollout_id,
        model_call_id=model_call_id,
        parent_call_id=None,
        mode="text",
        prev_len=0,
        weight_version=0,
        token_ids_delta=tokens,
        token_mask_delta=[0.0] * len(prompt) + [1.0] * len(generated),
        generation_log_probs_delta=[0.0] * len(prompt) + [-0.5] * len(generated),
        chain_hash=compute_chain_hash(None, tokens),
        cumulative_hash=hash_token_ids(tokens),
    )


def continuation_of(
    record: StagedCallRecord, keys: list[str], **changes: Any
) -> GenerationCutContinuation:
    """A continuation naming ``record`` as the staged prefix under ``keys``."""
    fields: dict[str, Any] = {
        "source_capture_key": record.rollout_id,
        "source_model_call_id": record.model_call_id,
        "staging_keys": keys,
        "prefix_token_count": record.generated_token_count,
        "prefix_digest": record.digest,
        "effective_output_limit": 64,
    }
    fields.update(changes)
    return GenerationCutContinuation(**fields)
